"""Structural checks of lessons 07 and 08, the exercise lessons (no kernel is started).

nbval re-runs both notebooks with the reference solutions and compares outputs; these tests guard
the conventions around that: the committed notebooks use ``solutions`` (CI must grade the reference,
learners switch to ``exercises``), every exercise has its rating, hints, a folded solution and a
check cell that passed, outputs are clean and machine-independent, and the required references
are cited.
"""
from __future__ import annotations

import re

import pytest

from tests.course_notebooks import ADDRESS, RAW_TIME, load, markdown, outputs

LESSONS = {
    "07_tenant_keyed_hashing.ipynb": ("1a", "1b", "2a", "2b", "2c", "5a"),
    "08_scrubbing.ipynb": ("3a", "3b", "4a"),
}
REFERENCES = ["cache_salt", "#44701", "#30827", "#53347", "CVE-2025-25183", "Shadow in the Cache",
              "Auditing Prompt Caching in Language Model APIs"]


@pytest.mark.parametrize("name", LESSONS)
def test_hints_are_folded_and_references_cited(name):
    md = markdown(load(name))  # the common frame is checked in test_course_structure.py
    assert "<details>" in md
    for ref in REFERENCES:
        assert ref in md, f"{name} does not cite {ref}"


@pytest.mark.parametrize("name", LESSONS)
def test_committed_with_the_reference_solutions(name):
    nb = load(name)
    setup = next(c for c in nb.cells if c.cell_type == "code" and "USE = " in c.source)
    assert re.search(r'^USE = "solutions"$', setup.source, re.M), "commit lessons with USE = \"solutions\""
    assert "exercises" in setup.source, "the setup cell must tell learners how to switch to exercises/"


@pytest.mark.parametrize("name", LESSONS)
def test_every_exercise_is_rated_hinted_solved_and_checked(name):
    nb = load(name)
    md = markdown(nb)
    for ex_id in LESSONS[name]:
        assert f"### Exercise {ex_id}" in md, ex_id
    boxes = md.count("### Exercise ")
    assert md.count("**Difficulty**") == boxes and md.count("**Importance**") == boxes
    assert md.count("<summary>Solution</summary>") >= boxes
    assert md.count("<summary>Hint 1</summary>") >= boxes
    passed = [text for c in nb.cells if c.cell_type == "code" for kind, text in outputs(c) if "✅" in text]
    assert len(passed) >= len(LESSONS[name]), "every exercise's check must have passed in the committed run"


@pytest.mark.parametrize("name", LESSONS)
def test_no_failed_check_and_clean_text_in_every_cell(name):
    """Beyond the course-wide check (test_course_structure.py): here even nbval-ignored cells
    must be free of addresses and raw timings, and no check may have failed (a ❌ is allowed
    only where a lesson deliberately grades a mutant)."""
    for c in (c for c in load(name).cells if c.cell_type == "code"):
        for kind, text in outputs(c):
            assert not ADDRESS.search(text), text
            assert not RAW_TIME.search(text), f"raw timing in output: {text[:200]!r}"
            assert "❌" not in text or "mutants." in c.source, f"a check failed: {text[:200]!r}"
