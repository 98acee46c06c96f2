"""Structural checks of lessons 07 and 08, the exercise lessons (no kernel is started).

nbval re-runs both notebooks with the reference solutions and compares outputs; these tests guard
the conventions around that: the committed notebooks use ``solutions`` (CI must grade the reference,
learners switch to ``exercises``), every exercise has its rating, hints, a folded solution and a
check cell that passed, outputs are clean and machine-independent, and the required references
are cited.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

COURSE = Path(__file__).resolve().parent.parent / "course"
LESSONS = {
    "07_tenant_keyed_hashing.ipynb": ("1a", "1b", "2a", "2b", "2c", "5a"),
    "08_scrubbing.ipynb": ("3a", "3b", "4a"),
}
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
RAW_TIME = re.compile(r"\b\d+(\.\d+)?\s?(ms|µs|us|seconds|sec)\b|\b\d+\.\d+\s?s\b")
REFERENCES = ["cache_salt", "#44701", "#30827", "#53347", "CVE-2025-25183", "Shadow in the Cache",
              "Auditing Prompt Caching in Language Model APIs"]


def load(name):
    return nbformat.read(COURSE / name, as_version=4)


def outputs(cell):
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            yield o.get("name"), o.text
        elif o.output_type in ("execute_result", "display_data"):
            yield "display", o.data.get("text/plain", "")
        else:
            yield o.output_type, ""


@pytest.mark.parametrize("name", LESSONS)
def test_lesson_frame_and_references(name):
    nb = load(name)
    first, last = nb.cells[0], nb.cells[-1]
    assert first.cell_type == "markdown" and first.source.startswith("# ")
    assert "Learning objectives" in first.source and "minutes" in first.source
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "## Summary" in markdown and last.cell_type == "markdown" and "## References" in last.source
    assert "Try it" in markdown and "<details>" in markdown
    for ref in REFERENCES:
        assert ref in markdown, f"{name} does not cite {ref}"


@pytest.mark.parametrize("name", LESSONS)
def test_committed_with_the_reference_solutions(name):
    nb = load(name)
    setup = next(c for c in nb.cells if c.cell_type == "code" and "USE = " in c.source)
    assert re.search(r'^USE = "solutions"$', setup.source, re.M), "commit lessons with USE = \"solutions\""
    assert "exercises" in setup.source, "the setup cell must tell learners how to switch to exercises/"


@pytest.mark.parametrize("name", LESSONS)
def test_every_exercise_is_rated_hinted_solved_and_checked(name):
    nb = load(name)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for ex_id in LESSONS[name]:
        assert f"### Exercise {ex_id}" in markdown, ex_id
    boxes = markdown.count("### Exercise ")
    assert markdown.count("**Difficulty**") == boxes and markdown.count("**Importance**") == boxes
    assert markdown.count("<summary>Solution</summary>") >= boxes
    assert markdown.count("<summary>Hint 1</summary>") >= boxes
    passed = [text for c in nb.cells if c.cell_type == "code" for kind, text in outputs(c) if "✅" in text]
    assert len(passed) >= len(LESSONS[name]), "every exercise's check must have passed in the committed run"


@pytest.mark.parametrize("name", LESSONS)
def test_committed_outputs_are_clean(name):
    nb = load(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "notebook is not fully executed"
    for c in code:
        for kind, text in outputs(c):
            assert kind not in ("stderr", "error"), f"{kind} output in: {c.source[:60]!r}"
            assert not ADDRESS.search(text), text
            assert not RAW_TIME.search(text), f"raw timing in output: {text[:200]!r}"
            assert "❌" not in text or "mutants." in c.source, f"a check failed: {text[:200]!r}"
