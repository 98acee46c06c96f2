"""Structural checks of lessons 07 and 08, the exercise lessons (no kernel is started).

nbval re-runs both notebooks with the reference solutions (``MINIKV_EXERCISES=solutions``, set by
the Makefile) and compares outputs; these tests guard the conventions around that: a learner who
opens a lesson runs ``exercises/`` (their own code, failing checks until written), the lesson says
that its outputs are the solutions' run and that the reference implementations are off-limits,
every exercise has its rating, a pointer to ``make hint`` and a check cell that passed, no solution
is folded in, outputs are clean and machine-independent, and the required references are cited.
"""
from __future__ import annotations

import re

import pytest

from tests.course_notebooks import ADDRESS, load, markdown, outputs

LESSONS = {
    "07_tenant_keyed_hashing.ipynb": ("1a", "1b", "2a", "2b", "2c", "2d", "5a"),
    "08_scrubbing.ipynb": ("3a", "3b", "3c", "3d", "4a"),
}
REFERENCES = ["cache_salt", "#44701", "#30827", "#53347", "CVE-2025-25183", "Shadow in the Cache",
              "Auditing Prompt Caching in Language Model APIs"]


@pytest.mark.parametrize("name", LESSONS)
def test_references_cited(name):
    md = markdown(load(name))  # the common frame is checked in test_course_structure.py
    for ref in REFERENCES:
        assert ref in md, f"{name} does not cite {ref}"


@pytest.mark.parametrize("name", LESSONS)
def test_runs_the_learners_exercises_unless_ci_says_solutions(name):
    nb = load(name)
    setup = next(c for c in nb.cells if c.cell_type == "code" and "USE = " in c.source)
    assert re.search(r'^USE = os\.environ\.get\("MINIKV_EXERCISES", "exercises"\)$', setup.source, re.M), setup.source
    md = markdown(nb)
    assert "MINIKV_EXERCISES=solutions" in md, "say in one line that the committed outputs are the solutions' run"
    for ref_impl in ("minikv/security/", "minikv/attacks/prefix_oracle.py", "minikv/audit/detector.py"):
        assert ref_impl in md, f"{name} must say that {ref_impl} is off-limits"
    assert "off-limits" in md


def test_make_test_runs_the_lessons_against_the_solutions():
    from pathlib import Path
    makefile = (Path(__file__).resolve().parents[1] / "Makefile").read_text()
    nbval = next(line for line in makefile.splitlines() if "--nbval" in line)
    assert "MINIKV_EXERCISES=solutions" in nbval


@pytest.mark.parametrize("name", LESSONS)
def test_every_exercise_is_rated_hinted_and_checked_with_no_solution_folded_in(name):
    nb = load(name)
    md = markdown(nb)
    for ex_id in LESSONS[name]:
        assert f"### Exercise {ex_id}" in md, ex_id
    boxes = md.count("### Exercise ")
    assert md.count("**Difficulty**") == boxes and md.count("**Importance**") == boxes
    assert "<summary>Solution</summary>" not in md
    assert md.count("make hint EX=") >= boxes
    passed = [text for c in nb.cells if c.cell_type == "code" for kind, text in outputs(c) if "✅" in text]
    assert len(passed) >= len(LESSONS[name]), "every exercise's check must have passed in the committed run"


@pytest.mark.parametrize("name", LESSONS)
def test_no_failed_check_and_clean_text_in_every_cell(name):
    """Beyond the course-wide check (test_course_structure.py): here even nbval-ignored cells
    must be free of addresses, and no check may have failed (a ❌ is allowed only where a lesson
    deliberately grades a mutant).  Timings may be printed as numbers (issue 13): nbval's
    sanitizer (tests/nbval_sanitize.cfg) rewrites them before comparing."""
    for c in (c for c in load(name).cells if c.cell_type == "code"):
        for kind, text in outputs(c):
            assert not ADDRESS.search(text), text
            assert "❌" not in text or "mutants." in c.source, f"a check failed: {text[:200]!r}"
