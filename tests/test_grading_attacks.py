"""Submissions that implement nothing and try to score: each scores 0 on what it touched, named.

The submissions live in ``tests/fixtures/grading_attacks/`` (its README says what each does);
one gradebook run grades them beside the reference solutions and the untouched stubs, two at a
time as ``make grade DIR=... JOBS=2`` does, on checks 1a and 5a:

* running ``solutions/`` through a gate bypass, or handing in symbolic links into it, scores 0
  with status ``tampering`` or ``refused``;
* the reference modules reached through a re-export are refused (``tampering``);
* a neighbour's staged file cannot be read (``tampering``: the child tried);
* a process started in a session of its own is gone when its check ends;
* a check that hangs costs that check's points only, and the gradebook says which one;
* a student folder named like a formula is text in the CSV; a copy of the reference is flagged.
"""
from __future__ import annotations

import csv
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from minikv.grading.gradebook import WEIGHTS, grade_folder, grade_submission
from minikv.grading.make_exercises import SOLUTIONS

FIXTURES = Path(__file__).parent / "fixtures" / "grading_attacks"
IDS = ["1a", "5a"]
BUDGET_S = "40"  # every check's budget in these runs (MINIKV_CHECK_BUDGET_S): the hang stops here


def _marked(marker: str) -> list[int]:
    """Processes whose command line carries ``marker``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
        except OSError:
            continue
    return found


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    root = tmp_path_factory.mktemp("attacks")
    marker = f"minikv-survivor-{os.getpid()}-{time.monotonic_ns()}"
    # a neighbour being graded at the same time: its staged copy of the reference, where a grader stages
    neighbour = Path(tempfile.mkdtemp(prefix="minikv-grade-", dir="/tmp"))
    (neighbour / "submission").mkdir()
    shutil.copy(SOLUTIONS / "ex1_chained_hash.py", neighbour / "submission" / "ex1_chained_hash.py")
    fill = {"@NEIGHBOUR@": str(neighbour / "submission" / "ex1_chained_hash.py"), "@MARKER@": marker}
    for folder in FIXTURES.iterdir():
        if folder.is_dir():
            (root / folder.name).mkdir()
            for f in folder.glob("*.py"):
                text = f.read_text(encoding="utf-8")
                for k, v in fill.items():
                    text = text.replace(k, v)
                (root / folder.name / f.name).write_text(text, encoding="utf-8")
    (root / "symlinks").mkdir()
    for name in ("ex1_chained_hash.py", "ex5_timing_stats.py"):
        (root / "symlinks" / name).symlink_to(SOLUTIONS / name)
    shutil.copy(SOLUTIONS / "ex1_chained_hash.py", root / "hang")  # a right 1a beside the hanging 5a
    (root / "reference").mkdir()
    (root / "stubs").mkdir()
    for path in SOLUTIONS.glob("*.py"):
        shutil.copy(path, root / "reference")
    (root / "=2+3 formula").mkdir()
    shutil.copy(SOLUTIONS / "ex1_chained_hash.py", root / "=2+3 formula")
    env = os.environ.get("MINIKV_CHECK_BUDGET_S")
    os.environ["MINIKV_CHECK_BUDGET_S"] = BUDGET_S
    try:
        rows = {r.student: r for r in grade_folder(root, ids=IDS, jobs=2, progress=lambda *_: None)}
    finally:
        os.environ.pop("MINIKV_CHECK_BUDGET_S") if env is None else os.environ.update(MINIKV_CHECK_BUDGET_S=env)
        shutil.rmtree(neighbour, ignore_errors=True)
    with open(root / "gradebook.csv", encoding="utf-8") as f:
        table = {r["student"]: r for r in csv.DictReader(f)}
    return rows, table, marker


@pytest.mark.parametrize("student,ex_id,status", [
    ("run_solutions", "1a", "tampering"), ("symlinks", "1a", "refused"), ("symlinks", "5a", "refused"),
    ("reexport", "1a", "tampering"), ("reexport", "5a", "tampering"), ("neighbour", "1a", "tampering")])
def test_a_submission_that_borrows_the_answer_scores_zero_named(graded, student, ex_id, status):
    rows, table, _ = graded
    row = rows[student]
    assert row.results[ex_id] is False and row.statuses[ex_id] == status, row.messages[ex_id]
    assert table[student][ex_id] == "0" and f"{ex_id}:{status}" in table[student]["not_passed"]


def test_what_each_borrower_tried_is_named(graded):
    rows, _, _ = graded
    assert "solutions/ex1_chained_hash.py" in rows["run_solutions"].messages["1a"]
    assert "symbolic link" in rows["symlinks"].messages["1a"]
    assert "minikv.security" in rows["reexport"].messages["1a"]
    assert "minikv.audit.stats" in rows["reexport"].messages["5a"]
    assert "minikv-grade-" in rows["neighbour"].messages["1a"]


def test_the_reference_scores_full_marks_and_the_stubs_zero_beside_them(graded):
    rows, table, _ = graded
    assert rows["reference"].status == "passed", rows["reference"].messages
    assert int(table["reference"]["points"]) == sum(WEIGHTS[e] for e in IDS)
    assert rows["stubs"].passed == 0 and table["stubs"]["points"] == "0"
    # the reference's own files are a copy of the reference: flagged, and their points stand
    assert "ex1_chained_hash.py:identical" in table["reference"]["matches_reference"]


def test_no_process_outlives_its_check(graded):
    _, _, marker = graded
    assert _marked(marker) == [], "a process the submission started is still running after its grade"


def test_a_hanging_check_costs_only_its_own_points(graded):
    rows, table, _ = graded
    row = rows["hang"]
    assert row.results["1a"] is True and row.statuses["5a"] == "timeout", row.messages
    assert f"past its limit of {float(BUDGET_S):.0f} s" in row.messages["5a"]
    assert table["hang"]["1a"] == str(WEIGHTS["1a"]) and "5a:timeout" in table["hang"]["not_passed"]


def test_a_formula_in_a_folder_name_is_text_in_the_csv(graded):
    _, table, _ = graded
    assert "'=2+3 formula" in table and "=2+3 formula" not in table
    assert table["'=2+3 formula"]["1a"] == str(WEIGHTS["1a"])  # a copy of the reference: points stand
    assert table["'=2+3 formula"]["matches_reference"] == "ex1_chained_hash.py:identical"


def test_a_grader_that_hangs_is_killed_with_all_it_started_and_leaves_no_folder(tmp_path, monkeypatch):
    # the backstop behind the per-check budget: the whole submission's timeout, fired while the
    # learner's module (which started a process in a session of its own) still hangs at import
    import glob
    import threading

    marker = f"minikv-survivor-{os.getpid()}-{time.monotonic_ns()}"
    sub = tmp_path / "sub"
    sub.mkdir()
    text = (FIXTURES / "survivor" / "ex1_chained_hash.py").read_text().replace("@MARKER@", marker)
    (sub / "ex1_chained_hash.py").write_text(text + "\nimport time\ntime.sleep(10 ** 6)\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    seen, done = [], threading.Event()

    def watch():  # proof that the survivor did start before the timeout, or the test proves nothing
        while not done.is_set() and not seen:
            seen.extend(_marked(marker))
            time.sleep(0.2)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        row = grade_submission(sub, timeout=60, ids=["1a"])
    finally:
        done.set()
        watcher.join()
    assert row.status == "timeout" and "longer than 60 s" in row.error, row
    assert seen, "the survivor never started within the timeout (a machine this slow proves nothing here)"
    assert _marked(marker) == []
    assert list(scratch.iterdir()) == []  # the staged package and every sealed child's folder are gone
    left = [f for f in glob.glob("/tmp/minikv-sealed-*/pkg/*/ex1_chained_hash.py")
            if marker in Path(f).read_text(errors="replace")]
    assert left == [], left
