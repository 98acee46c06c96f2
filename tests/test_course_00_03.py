"""Lesson-specific checks of lessons 00 and 02 (the conventions every lesson keeps are in
``test_course_structure.py``).

* lesson 02's first ``PoolExplorer`` is bound to ``explorer`` (the browser test drives that widget);
* lesson 00 really compares minikv's tokens with transformers'.
"""
from __future__ import annotations

import re

from tests.course_notebooks import load, text_outputs


def test_lesson_02_explorer_is_the_first_widget():
    nb = load("02_paged_kv_cache.ipynb")
    widget_cells = [c for c in nb.cells if c.cell_type == "code" and "PoolExplorer(" in c.source]
    assert widget_cells, "lesson 02 has no PoolExplorer"
    assert re.search(r"^explorer = PoolExplorer\(", widget_cells[0].source, re.M)
    following = nb.cells[nb.cells.index(widget_cells[0]) + 1:]
    summaries = [c for c in following if c.cell_type == "code" and ".summary()" in c.source]
    assert summaries and any(t.startswith("step ") for t in text_outputs(summaries[0]))


def test_lesson_00_checks_minikv_against_transformers():
    nb = load("00_welcome.ipynb")
    src = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    assert "AutoModelForCausalLM" in src and "assert out.outputs[0].token_ids == hf_tokens" in src
    outputs = "\n".join(t for c in nb.cells if c.cell_type == "code" for t in text_outputs(c))
    assert "The capital of France is Paris." in outputs
