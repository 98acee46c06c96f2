"""Structural checks of lessons 00-03 (no kernel is started: these read the committed .ipynb files).

nbval re-runs the notebooks and compares outputs; these tests guard the conventions that keep that
comparison meaningful and the lessons usable:

* every lesson opens with learning objectives and a time estimate, and ends with a summary and references;
* interactive widget cells are tagged ``nbval-ignore-output`` and followed by a static twin;
* committed outputs contain no stderr, no errors, no memory addresses and no raw timings;
* lesson 02's first ``PoolExplorer`` is bound to ``explorer`` (the browser test drives that widget).
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

COURSE = Path(__file__).resolve().parent.parent / "course"
LESSONS = ["00_welcome.ipynb", "01_kv_cache_fundamentals.ipynb", "02_paged_kv_cache.ipynb",
           "03_prefix_sharing.ipynb"]
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
RAW_TIME = re.compile(r"\b\d+(\.\d+)?\s?(ms|µs|us|seconds|sec)\b|\b\d+\.\d+\s?s\b")


def load(name: str):
    return nbformat.read(COURSE / name, as_version=4)


def text_outputs(cell) -> list[str]:
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            out.append(o.data.get("text/plain", ""))
    return out


def tags(cell) -> list[str]:
    return list(cell.metadata.get("tags", []))


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_frame(name):
    nb = load(name)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "Learning objectives" in first.source and "minutes" in first.source
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "## Summary" in markdown and "## References" in markdown
    assert last.cell_type == "markdown" and "## References" in last.source
    assert "Try it" in markdown


@pytest.mark.parametrize("name", LESSONS)
def test_committed_outputs_are_clean(name):
    nb = load(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "notebook is not fully executed"
    for c in code:
        for o in c.outputs:
            assert o.output_type != "error", f"error output in {name}: {o.get('evalue')}"
            assert not (o.output_type == "stream" and o.name == "stderr"), f"stderr in {name}: {o.text[:200]}"
        if "nbval-ignore-output" in tags(c):
            continue
        for text in text_outputs(c):
            assert not ADDRESS.search(text), f"memory address in {name}: {text[:200]}"
            assert not RAW_TIME.search(text), f"raw timing in {name}: {text[:200]}"
    assert "widgets" not in nb.metadata, "widget state must be stripped (scripts/run_notebook.py)"


@pytest.mark.parametrize("name", LESSONS)
def test_widgets_are_ignored_and_have_a_static_twin(name):
    nb = load(name)
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code" or "PoolExplorer(" not in c.source:
            continue
        assert "nbval-ignore-output" in tags(c), f"{name} cell {i}: widget output must be ignored by nbval"
        rest = [x for x in nb.cells[i + 1:] if x.cell_type == "code"]
        assert rest and "draw_frames_strip" in rest[0].source, f"{name} cell {i}: no static twin follows"


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
