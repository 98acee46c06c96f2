"""The grading tools around the graders: `make grade` on stubs and on solutions, the gradebook of a
folder of submissions, the reference-import gate, tiered hints and version-stamped stubs."""
from __future__ import annotations

import csv
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from minikv.grading import guard, hints
from minikv.grading.gradebook import WEIGHTS, grade_folder, grade_submission
from minikv.grading.make_exercises import SOLUTIONS, generate, is_pristine, write
from minikv.grading.runner import EXERCISES, grade

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def stubs(tmp_path):
    """exercises/ as generated, importable as ``tool_stubs`` (a learner's edits never leak in)."""
    pkg = tmp_path / "tool_stubs"
    pkg.mkdir()
    for name, text in generate().items():
        (pkg / name).write_text(text, encoding="utf-8")
    sys.path.insert(0, str(tmp_path))
    yield pkg
    sys.path.remove(str(tmp_path))
    for mod in [m for m in sys.modules if m.split(".")[0] == "tool_stubs"]:
        del sys.modules[mod]


def _run(*args, cwd=ROOT, env_path=None, timeout=600):
    env = None
    if env_path:
        import os
        env = {**os.environ, "PYTHONPATH": f"{env_path}{os.pathsep}{ROOT}"}
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


# ------------------------------------------------------------------ make grade: stubs fail, solutions pass

def test_grading_untouched_stubs_fails_with_a_readable_table(stubs):
    done = _run("-m", "minikv.grading.runner", "tool_stubs", env_path=stubs.parent)
    assert done.returncode == 1, done.stdout + done.stderr
    out = done.stdout
    ids = [e.id for e in EXERCISES if (stubs / f"{e.module}.py").is_file()]
    assert f"0/{len(ids)} exercises pass" in out
    for ex_id in ids:  # one table row per exercise, each a FAIL
        assert any(line.startswith(ex_id) and line.endswith("❌ FAIL") for line in out.splitlines()), ex_id
    assert out.count("is not implemented yet") >= len(ids)


# The reference solutions' own run (test_grading_the_solutions_passes) is in tests/test_grading.py, beside
# the per-exercise verdicts it shares a grading run with: one file goes to one pytest-xdist worker.


# ------------------------------------------------------------------ the gate

def test_the_gate_refuses_reference_imports_and_says_why(stubs, capsys):
    (stubs / "ex3_scrubbing.py").write_text(
        "from minikv.security.scrub import zero_blocks\nfrom minikv.grading.harness import ZERO\n")
    (stubs / "ex4_isolation_audit.py").write_text(
        "import importlib\naudit_verdict = importlib.import_module('minikv.audit.detector')\n")
    results = grade("tool_stubs", ["3a", "4a"])
    out = capsys.readouterr().out
    assert results == {"3a": False, "4a": False}
    assert "ex3_scrubbing.py:1 imports minikv.security.scrub" in out and "minikv.security holds the reference" in out
    assert "minikv.audit.detector" in out and "not graded" in out
    assert "grade must measure your code" in out


@pytest.mark.parametrize("source, what", [
    ("from minikv.attacks import prefix_oracle\n", "minikv.attacks.prefix_oracle"),
    ("import minikv.security.keys as k\n", "minikv.security.keys"),
    ("from minikv import security\n", "minikv.security"),
    ("__import__('minikv.security.hashing')\n", "minikv.security.hashing"),
])
def test_the_gate_catches_every_spelling(source, what):
    hits = guard.forbidden_imports(source)
    assert hits and hits[0][1] == what


def test_solutions_pass_the_strict_gate_and_cheats_do_not():
    for path in sorted(SOLUTIONS.glob("ex*.py")):
        assert guard.check_file(path, grading_submission=True) == [], path.name
    cheats = {"from minikv.grading import hashing\nhashing.expect = lambda *a, **k: None\n": "minikv.grading",
              "import minikv.engine.engine as e\ne.LLMEngine.step = None\n": "patches an imported module",
              "import sys\n": "imports sys", "x = open('gradebook.json', 'w')\n": "uses open",
              "f = (lambda: 0).__globals__\n": "reaches into __globals__"}
    for source, why in cheats.items():
        msgs = guard.check_file(_write_tmp(source), grading_submission=True)
        assert msgs and any(why in m for m in msgs), (source, msgs)


def _write_tmp(source: str) -> Path:
    import tempfile
    path = Path(tempfile.mkdtemp()) / "ex1_chained_hash.py"
    path.write_text(source)
    return path


# ------------------------------------------------------------------ gradebook

def test_gradebook_grades_each_submission_in_its_own_process(tmp_path):
    subs = tmp_path / "subs"
    (subs / "ada").mkdir(parents=True)
    (subs / "bob").mkdir()
    (subs / "eve").mkdir()
    for name in ("ex4_isolation_audit.py", "ex5_timing_stats.py"):
        (subs / "ada" / name).write_text((SOLUTIONS / name).read_text())
    (subs / "ada" / "notes.txt").write_text("not an exercise")
    # eve tries to make every check pass by patching the grader, then by importing the reference
    (subs / "eve" / "ex4_isolation_audit.py").write_text(
        "import minikv.grading._report as r\nr.expect = lambda *a, **k: None\n")
    (subs / "eve" / "ex5_timing_stats.py").write_text("from minikv.audit.stats import ks_test, roc_auc\n"
                                                      "from minikv.security.keys import derive_tenant_key\n")
    rows = grade_folder(subs, tmp_path / "out", timeout=300, ids=["4a", "5"], progress=lambda s: None)
    by = {r.student: r for r in rows}
    assert by["ada"].results == {"4a": True, "5a": True, "5b": True} and by["ada"].ignored == ["notes.txt"]
    assert by["bob"].results == {"4a": False, "5a": False, "5b": False}  # no files: the stubs
    assert by["eve"].passed == 0 and "not graded" in by["eve"].messages["4a"]
    assert "minikv.security" in by["eve"].messages["5a"]
    assert by["eve"].statuses == {"4a": "tampering", "5a": "refused", "5b": "refused"}
    table = list(csv.DictReader(open(tmp_path / "out" / "gradebook.csv")))
    assert [(r["student"], r["points"], r["max_points"], r["status"]) for r in table] == \
        [("ada", "4", "4", "passed"), ("bob", "0", "4", "failed"), ("eve", "0", "4", "tampering")]
    assert table[2]["not_passed"] == "4a:tampering 5a:refused 5b:refused"
    assert [r["4a"] for r in table] == ["1", "0", "0"] and table[0]["5a"] == "2"  # points: the WEIGHTS table
    assert table[0]["files"].split() == [f"{n}:{hashlib.sha256((SOLUTIONS / n).read_bytes()).hexdigest()[:16]}"
                                         for n in ("ex4_isolation_audit.py", "ex5_timing_stats.py")]
    assert table[1]["files"] == "" and all(r["stub_version"] == table[0]["stub_version"] != "" for r in table)
    assert all(r["graded_at"].endswith("Z") for r in table)
    book = json.loads((tmp_path / "out" / "gradebook.json").read_text())
    assert book["exercises"] == ["4a", "5a", "5b"] and len(book["submissions"]) == 3
    assert all(s["seconds"] > 0 for s in book["submissions"])
    assert all(s["ignored"] == [] for s in book["submissions"] if s["student"] != "ada")
    # a re-grade of the unchanged folder gives the same rows, apart from when they were graded
    grade_folder(subs, tmp_path / "again", timeout=300, ids=["4a", "5"], progress=lambda s: None, jobs=1)
    again = list(csv.DictReader(open(tmp_path / "again" / "gradebook.csv")))
    assert [{**r, "graded_at": ""} for r in again] == [{**r, "graded_at": ""} for r in table]


def test_gradebook_times_out_an_endless_loop(tmp_path):
    sub = tmp_path / "loop"
    sub.mkdir()
    (sub / "ex4_isolation_audit.py").write_text((SOLUTIONS / "ex4_isolation_audit.py").read_text().replace(
        "    # BEGIN SOLUTION\n    if cross_tenant", "    while True:\n        pass\n    if cross_tenant", 1))
    row = grade_submission(sub, timeout=20, ids=["4a"])
    assert row.status == "timeout" and "longer than 20 s" in row.error and row.passed == 0


def test_gradebook_gives_the_reference_capstone_full_marks(tmp_path):
    """Folder mode grades the capstone: the reference audit, as a student's file, passes C.  (The strict
    gate used to refuse the stub's own ``import os`` there, so every student scored 0 on C.)"""
    sub = tmp_path / "ada"
    sub.mkdir()
    (sub / "capstone_audit.py").write_text((SOLUTIONS / "capstone_audit.py").read_text(encoding="utf-8"),
                                           encoding="utf-8")
    row = grade_submission(sub, timeout=300, ids=["C"])
    assert row.results == {"C": True} and row.statuses == {"C": "passed"}, (row.error, row.messages)
    assert row.status == "passed" and row.points("C") == WEIGHTS["C"] > 0 and "imports os" not in row.messages["C"]
    assert list(row.files) == ["capstone_audit.py"]


def test_gradebook_refuses_a_missing_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such folder"):
        grade_folder(tmp_path / "nope")
    with pytest.raises(ValueError, match="no submission folders"):
        grade_folder(tmp_path)


# ------------------------------------------------------------------ hints

def test_hints_advance_one_level_per_call_and_only_the_last_shows_code(tmp_path):
    state = tmp_path / "hints.json"
    texts = [hints.next_hint("2a", state) for _ in range(4)]
    assert [t.split(" for ")[0] for t in texts] == ["Hint 1/3", "Hint 2/3", "Hint 3/3", "Hint 3/3"]
    assert "again for level 2" in texts[0] and "last level" in texts[2]
    assert "encode_fields(TENANT_LABEL, tenant)" in texts[2] and "hmac.digest" not in "".join(texts)  # no key line
    assert hints.next_hint("3b", state).startswith("Hint 1/3 for exercise 3b")  # per exercise
    assert hints.next_hint("2a", state, level=1).startswith("Hint 1/3")  # --level: no advance
    with pytest.raises(ValueError, match="no hints for exercise '9z'"):
        hints.next_hint("9z", state)
    assert set(hints.HINTS) >= {e.id for e in EXERCISES if not e.id.startswith(("L", "C"))}


def _solution_lines(ex) -> set[str]:
    """The non-trivial lines between BEGIN/END SOLUTION in the exercise's solution module."""
    text = (SOLUTIONS / f"{ex.module}.py").read_text(encoding="utf-8")
    lines, inside = set(), False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("# BEGIN SOLUTION") or stripped.startswith("# END SOLUTION"):
            inside = stripped.startswith("# BEGIN")
        elif inside and len(stripped) >= 16 and not stripped.startswith("#"):
            lines.add(stripped)
    return lines


#: exercises whose hints were rewritten to teach (issue 37): levels 1 and 2 ask questions
TEACHING_HINTS = ("2a", "3b", "L1", "1b", "2b", "3a", "4b", "C", "3c", "2d", "L4", "3d")
#: ... and whose level 3 must also hold none of their forbidden phrases (it leaves out the key line)
KEY_LINE_LEFT_OUT = ("2a", "1b", "2b", "3a", "4b", "C", "3c", "2d", "L4", "3d")


def test_levels_1_and_2_ask_and_never_state_the_rule():
    """Level 1 and 2 hints hold no line of the solution and none of the exercise's forbidden phrases
    (the rule in the words the old hints used); every exercise of TEACHING_HINTS has such a list and asks
    questions at levels 1 and 2; those of KEY_LINE_LEFT_OUT keep their phrases out of level 3 too."""
    by_id = {e.id: e for e in EXERCISES}
    assert set(TEACHING_HINTS) <= set(hints.FORBIDDEN_PHRASES)
    for ex_id, levels in hints.HINTS.items():
        low = (levels[0] + " " + levels[1])
        for line in _solution_lines(by_id[ex_id]) if ex_id in by_id else ():
            assert line not in low, f"{ex_id}: a level 1-2 hint contains the solution line {line!r}"
        for phrase in hints.FORBIDDEN_PHRASES.get(ex_id, []):
            assert phrase.lower() not in low.lower(), f"{ex_id}: a level 1-2 hint states the rule ({phrase!r})"
            assert phrase.lower() not in levels[2].lower() or ex_id not in KEY_LINE_LEFT_OUT, \
                f"{ex_id}: level 3 has the key line ({phrase!r})"
    for ex_id in TEACHING_HINTS:
        assert all("?" in level for level in hints.HINTS[ex_id][:2]), ex_id


def test_make_hint_command_runs():
    done = _run("-m", "minikv.grading.hints", "1a", "--level", "1")
    assert done.returncode == 0 and done.stdout.startswith("Hint 1/3 for exercise 1a"), done.stdout + done.stderr


# ------------------------------------------------------------------ version-stamped stubs

def test_regenerating_never_overwrites_an_edited_stub(tmp_path):
    written, kept = write(tmp_path)
    assert kept == [] and "ex1_chained_hash.py" in written
    stub = tmp_path / "ex1_chained_hash.py"
    assert is_pristine(stub.read_text())
    mine = stub.read_text().replace('raise NotImplementedError("encode_fields', 'return b""  # mine\n    raise X("', 1)
    stub.write_text(mine)
    untouched = tmp_path / "ex5_timing_stats.py"
    untouched.write_text(untouched.read_text())  # same content: still pristine
    written, kept = write(tmp_path)
    assert kept == ["ex1_chained_hash.py"] and written == []
    assert stub.read_text() == mine, "the learner's edits were overwritten"
    assert (tmp_path / "ex1_chained_hash.py.new").read_text() == generate()["ex1_chained_hash.py"]
    unstamped = tmp_path / "ex4_isolation_audit.py"  # an old stub without a stamp counts as edited
    unstamped.write_text("# old stub\n")
    assert "ex4_isolation_audit.py" in write(tmp_path)[1]


def test_regenerate_prints_what_it_kept(tmp_path, monkeypatch, capsys):
    from minikv.grading import make_exercises
    monkeypatch.setattr(make_exercises, "EXERCISES", tmp_path)
    write(tmp_path)
    (tmp_path / "ex2_tenant_keys.py").write_text("# my work\n")
    monkeypatch.setattr(make_exercises, "write", lambda: write(tmp_path))
    assert make_exercises.main([]) == 0
    out = capsys.readouterr().out
    assert "kept exercises/ex2_tenant_keys.py: it holds your edits" in out and ".new" in out


#: what a fresh interpreter of the grading imports, once per graded call: a lab's server, a lab's
#: victim run (a mutant guesser), a sealed child before it loads the learner's file
LIGHT_CHILDREN = ("minikv.grading.lab_server", "minikv.grading.lab_server_prior", "minikv.grading.mutants.guessers",
                  "minikv.grading.mutants.labs", "minikv.grading._sealed_child", "solutions.lab4_ranked_guesser")


@pytest.mark.parametrize("module", LIGHT_CHILDREN)
def test_a_graded_child_does_not_import_the_engine_it_does_not_use(module):
    # ``minikv.grading`` and ``minikv.grading.mutants`` export their graders and mutants lazily: when
    # they imported them eagerly, every one of these children loaded torch, scipy and the engine,
    # 3.8 s a start, five starts per lab check (issue 36)
    code = (f"import sys, {module}\n"
            "print(sorted(m for m in ('torch', 'scipy', 'minikv.engine', 'minikv.llm') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == "[]", f"importing {module} also imported {p.stdout.strip()}"


# ------------------------------------------------------------------ intake: read before anything runs

def test_intake_refuses_links_fifos_and_large_files_and_flags_copies_of_the_reference(tmp_path):
    import os

    from minikv.grading.intake import MAX_FILE_BYTES, stage

    sub = tmp_path / "sub"
    sub.mkdir()
    (sub / "ex1_chained_hash.py").symlink_to(SOLUTIONS / "ex1_chained_hash.py")
    os.mkfifo(sub / "ex2_tenant_keys.py")  # copying it would wait for a writer forever
    (sub / "ex3_scrubbing.py").write_text("#" * (MAX_FILE_BYTES + 1))
    (sub / "more").mkdir()
    (sub / "more" / "code").symlink_to(ROOT / "solutions")  # a linked folder is never entered
    # the reference with its comments, docstrings and layout changed: the same syntax tree
    ref = (SOLUTIONS / "ex5_timing_stats.py").read_text()
    (sub / "ex5_timing_stats.py").write_text(ref.replace('"""', '"""Mine. ', 1).replace("    # ", "    #  ") + "\n\n")
    (sub / "ex4_isolation_audit.py").write_text((SOLUTIONS / "ex4_isolation_audit.py").read_text())
    found = stage(sub, tmp_path / "pkg", generate())
    assert set(found["refused"]) == {"ex1_chained_hash.py", "ex2_tenant_keys.py", "ex3_scrubbing.py", "more/code"}
    assert "symbolic link" in found["refused"]["ex1_chained_hash.py"]
    assert "FIFO" in found["refused"]["ex2_tenant_keys.py"]
    assert f"over the {MAX_FILE_BYTES}" in found["refused"]["ex3_scrubbing.py"]
    assert found["matches"] == {"ex4_isolation_audit.py": "identical", "ex5_timing_stats.py": "same syntax tree"}
    # a refused file is not staged: its stub stands in
    assert (tmp_path / "pkg" / "ex1_chained_hash.py").read_text() == generate()["ex1_chained_hash.py"]


def test_a_different_implementation_is_not_flagged_as_the_reference():
    from minikv.grading.intake import matches_reference

    ref = (SOLUTIONS / "ex1_chained_hash.py").read_bytes()
    assert matches_reference("ex1_chained_hash.py", ref.replace(b"struct", b"strukt")) is None
    assert matches_reference("ex1_chained_hash.py", generate()["ex1_chained_hash.py"].encode()) is None


@pytest.mark.parametrize("cell,shown", [("=2+3 x", "'=2+3 x"), ("+1", "'+1"), ("-1+2", "'-1+2"), ("@SUM(A1)", "'@SUM(A1)"),
                                        ("\tx", "'\tx"), ("\rx", "'\rx"), ("ada", "ada"), (3, 3), ("", "")])
def test_a_csv_cell_that_starts_like_a_formula_is_text(cell, shown):
    from minikv.grading.gradebook import csv_cell

    assert csv_cell(cell) == shown


def test_a_submission_folder_that_is_a_link_is_refused_whole(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "ex1_chained_hash.py").write_text((SOLUTIONS / "ex1_chained_hash.py").read_text())
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    row = grade_submission(tmp_path / "linked", ids=["1a"])
    assert row.statuses == {"1a": "refused"} and row.results == {"1a": False} and row.status == "refused"
    assert "symbolic link" in row.messages["1a"]
