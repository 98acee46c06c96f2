"""Conventions every lesson keeps (no kernel is started: these read the committed .ipynb files).

* it opens with learning objectives and a time estimate, has "Try it" prompts, and ends with a
  summary and references;
* committed outputs contain no errors, no stderr and (outside nbval-ignored cells) no memory
  addresses or raw timings, and widget state is stripped;
* interactive ``PoolExplorer`` cells are ignored by nbval and followed by a static twin.
"""
from __future__ import annotations

import pytest

from tests.course_notebooks import ADDRESS, ALL_LESSONS, RAW_TIME, load, markdown, outputs, tags, text_outputs


def test_the_course_has_all_its_lessons():
    assert [name[:2] for name in ALL_LESSONS] == [f"{i:02d}" for i in range(11)]


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_lesson_frame(name):
    nb = load(name)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "Learning objectives" in first.source and "minutes" in first.source
    md = markdown(nb)
    assert "## Summary" in md and "Try it" in md
    assert last.cell_type == "markdown" and "## References" in last.source


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_committed_outputs_are_clean(name):
    nb = load(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "notebook is not fully executed"
    for c in code:
        for kind, text in outputs(c):
            assert kind not in ("stderr", "error"), f"{kind} output in {name}: {c.source[:60]!r}"
        if "nbval-ignore-output" in tags(c):
            continue
        for text in text_outputs(c):
            assert not ADDRESS.search(text), f"memory address in {name}: {text[:200]}"
            assert not RAW_TIME.search(text), f"raw timing in {name}: {text[:200]}"
    assert "widgets" not in nb.metadata, "widget state must be stripped (scripts/run_notebook.py)"


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_widgets_are_ignored_and_have_a_static_twin(name):
    nb = load(name)
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code" or "PoolExplorer(" not in c.source:
            continue
        assert "nbval-ignore-output" in tags(c), f"{name} cell {i}: widget output must be ignored by nbval"
        rest = [x for x in nb.cells[i + 1:] if x.cell_type == "code"]
        assert rest and "draw_frames_strip" in rest[0].source, f"{name} cell {i}: no static twin follows"
