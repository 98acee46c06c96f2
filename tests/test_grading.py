"""The graders of the exercises: each rejects the stub and every realistic mutant, and passes the
reference solution; the committed exercises/ is exactly what solutions/ generates.

The stubs are generated afresh from solutions/ into a temporary package (a learner who filled in
exercises/ does not change what this test sees); ``test_exercises_are_in_sync`` is the one test
that reads the committed exercises/.
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from minikv import UnsafeSettingWarning
from minikv.grading import hashing, scrubbing
from minikv.grading import mutants as M
from minikv.grading._report import CheckFailed
from minikv.grading.make_exercises import (EXERCISES, SOLUTIONS, MarkerError, generate, stale_files,
                                           strip_solutions)
from minikv.grading.runner import EXERCISES as GRADED
from minikv.grading.runner import grade, summary_table

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _quiet_unsafe():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        yield


@pytest.fixture(scope="module")
def stub_package(tmp_path_factory):
    """exercises/ as generated from solutions/, importable as ``grading_stubs``."""
    root = tmp_path_factory.mktemp("stubs")
    pkg = root / "grading_stubs"
    pkg.mkdir()
    for name, text in generate().items():
        (pkg / name).write_text(text, encoding="utf-8")
    sys.path.insert(0, str(root))
    try:
        yield "grading_stubs"
    finally:
        sys.path.remove(str(root))
        for mod in [m for m in sys.modules if m == "grading_stubs" or m.startswith("grading_stubs.")]:
            del sys.modules[mod]


def _extra(ex, package):
    mod = importlib.import_module(f"{package}.{ex.module}")
    return {k: getattr(mod, k) for k in ex.extra}


IDS = [e.id for e in GRADED]
BY_ID = {e.id: e for e in GRADED}


def test_exercise_table_is_consistent():
    """The runner's table: unique ids; every lesson is a course notebook; every exercise names a
    function/class that exists in both packages; every extra is a keyword its grader takes."""
    assert len(set(IDS)) == len(IDS), IDS
    for ex in GRADED:
        assert list((ROOT / "course").glob(f"{ex.lesson}_*.ipynb")), (ex.id, ex.lesson)
        for package in ("exercises", "solutions"):
            assert ex.target(package) is not None
        params = inspect.signature(ex.check).parameters
        assert all(name in params for name in ex.extra), (ex.id, ex.extra, list(params))
        assert all(isinstance(getattr(importlib.import_module(f"solutions.{ex.module}"), n), type(ex.check))
                   for n in ex.extra), ex.id  # extras are the module's helper functions


# ------------------------------------------------------------------ solution / stub / mutants

@pytest.mark.parametrize("ex_id", IDS)
def test_solution_passes(ex_id, graded_solutions):
    """Every reference passes its grader on the first attempt.  No grader is retried: L2's verdict rests
    on a *virtual* clock (seeded noise, whatever the machine's load) and its reference recovers every one
    of 30,000 simulated secrets (tests/test_labs.py replays 300); a retry here once hid a reference that
    was wrong for about 1 secret in 130.  The verdicts come from one grading run of solutions/ in its own
    process (the ``graded_solutions`` fixture, which test_grading_the_solutions_passes below reads too)."""
    ex = BY_ID[ex_id]
    done, results, messages = graded_solutions
    assert ex_id in results, done.stdout[-3000:] + done.stderr[-3000:]
    out = messages[ex_id]
    assert results[ex_id] is True, out
    # one verdict line (a grader may print per-finding feedback around it, as the capstone does)
    verdicts = [line for line in out.splitlines() if line.startswith(("✅", "❌"))]
    assert len(verdicts) == 1 and verdicts[0].startswith(f"✅ {ex.check.__name__} passed: "), out


def test_grading_the_solutions_passes(graded_solutions):
    """``make grade`` on solutions/ (the same run the verdicts above read): exit 0 and every exercise
    passing; the package's own entry point, ``python -m solutions.grade``, is the same main."""
    done, results, _ = graded_solutions
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert f"{len(GRADED)}/{len(GRADED)} exercises pass" in done.stdout
    assert sorted(results) == sorted(IDS) and all(results.values())
    quick = subprocess.run([sys.executable, "-m", "solutions.grade", "1a", "3b"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert quick.returncode == 0 and "2/2 exercises pass" in quick.stdout, quick.stdout[-2000:] + quick.stderr[-2000:]


@pytest.mark.parametrize("ex_id", IDS)
def test_stub_fails_as_not_implemented(ex_id, stub_package, capsys):
    ex = BY_ID[ex_id]
    assert ex.check(ex.target(stub_package), **_extra(ex, "solutions")) is False
    out = capsys.readouterr().out
    assert out.startswith(f"❌ {ex.check.__name__}: ") and "not implemented yet" in out, out
    assert "Hint:" in out


MUTANT_CASES = [(ex_id, name) for ex_id in IDS for name, _, _ in M.MUTANTS.get(ex_id, [])]
DEFENSE_IDS = [e.id for e in GRADED if e.module.startswith("ex")]  # the five defense topics (lessons 07-08)


def test_every_exercise_has_at_least_three_diagnosed_mutants():
    assert set(DEFENSE_IDS) <= set(M.MUTANTS) <= set(IDS)
    for ex_id, cases in M.MUTANTS.items():
        assert len(cases) >= 3, ex_id
        assert all(doc and doc.strip() for _, _, doc in cases), ex_id
        assert all((ex_id, name) in M.DIAGNOSES for name, _, _ in cases), ex_id


@pytest.mark.parametrize("ex_id, name", MUTANT_CASES, ids=[f"{e}-{n}" for e, n in MUTANT_CASES])
def test_mutant_fails_naming_its_bug_class(ex_id, name, capsys):
    """Each mutant is rejected, and the verdict names ITS class of bug (not merely 'wrong')."""
    ex = BY_ID[ex_id]
    impl = dict((n, i) for n, i, _ in M.MUTANTS[ex_id])[name]
    assert ex.check(impl, **_extra(ex, "solutions")) is False
    out = capsys.readouterr().out
    assert out.startswith(f"❌ {ex.check.__name__} failed: "), out
    assert "Hint:" in out and "not implemented" not in out
    verdict = out.split("Hint:")[0]
    assert M.DIAGNOSES[(ex_id, name)] in verdict, f"expected the bug class {M.DIAGNOSES[(ex_id, name)]!r} in: {out}"


NEGATIVE = [(ex_id, name) for ex_id, cases in M.NEGATIVE_CONTROLS.items() for name, _, _ in cases]


@pytest.mark.parametrize("ex_id, name", NEGATIVE, ids=[f"{e}-{n}" for e, n in NEGATIVE])
def test_negative_controls_are_accepted(ex_id, name, capsys):
    """Correct code that differs only in method (an asymptotic p-value instead of the exact one) passes."""
    ex = BY_ID[ex_id]
    impl = dict((n, i) for n, i, _ in M.NEGATIVE_CONTROLS[ex_id])[name]
    assert ex.check(impl, **_extra(ex, "solutions")) is True, capsys.readouterr().out


def test_the_required_bug_classes_are_all_modelled():
    """Issue 10's list: colliding tenant encodings (None/'None', ''/None, separators, Unicode forms),
    sha256(secret || x), in-place ops on a copy, two-sided tests, probes that never share a step,
    scrubbers that miss preemption or abort."""
    wanted = {("2a", "str-tenant"), ("2a", "none-is-empty"), ("1a", "typed-separator"), ("2a", "nfc-normalised"),
              ("2a", "sha256-concat"), ("2b", "sha256-concat"), ("3a", "on-a-copy"), ("5a", "two-sided"),
              ("4b", "grouped-by-tenant"), ("3b", "finished-only"), ("3b", "skip-aborted")}
    assert wanted <= set(M.DIAGNOSES)
    assert M.NEGATIVE_CONTROLS["5a"]


# The engine runs must catch the isolation and lifecycle bugs on their own, not only the
# direct-call checks that come first (a learner's bug may slip past those).
S = hashing.ENGINE_SECRET
ENGINE_STAGE_MUTANTS = {
    "hasher ignores tenant key": lambda: hashing.engine_stage_hasher(M.hash_ignores_tenant, "sha256"),
    "hasher unchained": lambda: hashing.engine_stage_hasher(M.hash_unchained, "sha256"),
    "keyed first block only": lambda: hashing.engine_stage_hasher(M.KeyedFirstBlockOnly(S), "hmac-sha256"),
    "keyed salt never used": lambda: hashing.engine_stage_hasher(M.KeyedSaltNeverUsed(S), "hmac-sha256"),
    "derive None == ''": lambda: hashing.engine_stage_key_derivation(M.derive_none_is_empty),
    **{f"block_keys {n}": (lambda i=i: hashing.engine_stage_block_keys(i)) for n, i, _ in M.MUTANTS["2c"]},
    # (compares-reason crashes on its first call, a crash the grader reports as such: nothing to catch here)
    **{f"placement {n}": (lambda i=i: scrubbing.engine_stage_placement(i)) for n, i, _ in M.MUTANTS["3b"]
       if n != "compares-reason"},
}


@pytest.mark.parametrize("name", list(ENGINE_STAGE_MUTANTS))
def test_engine_stage_alone_catches(name):
    with pytest.raises(CheckFailed):
        ENGINE_STAGE_MUTANTS[name]()


def test_key_layout_engine_run_sees_both_directions_and_catches_leaks_alone():
    """Exercise 2d's engine run on its own: the solution's layout caches exactly what each scope allows
    on the replayed prompt (both directions: own and tenant blocks hit, nothing private across), and the
    run alone -- without the direct-call checks -- catches the leaking and the over-keyed mutants."""
    from solutions.ex2_tenant_keys import key_layout

    from minikv.grading import key_layout as kl
    cached, sizes, log = kl.run_in_engine(key_layout)
    assert not log.leaks and sum(cached) / sum(sizes) == pytest.approx(kl.reference_hit_rate())
    replays = dict(zip([(t, u) for t, u, *_ in kl.workload()[-5:]], cached[-5:]))
    public, tenant = 16, 32  # full blocks of the public part (18 tokens), then of public + tenant part (32)
    assert replays == {("acme", "bob"): tenant, ("globex", "alice"): public, ("initech", "carol"): public,
                       ("acme", "alice"): 44, ("acme", None): tenant}
    for mutant in (M.layout_user_part_tenant_key, M.layout_straddle_looser):
        assert kl.run_in_engine(mutant)[2].leaks, mutant.__name__
    over, sizes, log = kl.run_in_engine(M.layout_tenant_part_per_user)
    assert not log.leaks and sum(over) / sum(sizes) < kl.reference_hit_rate() - 0.05


def test_engine_stages_pass_the_solutions():
    from solutions.ex1_chained_hash import chained_block_hash
    from solutions.ex2_tenant_keys import TenantKeyedHasher, block_keys, derive_tenant_key
    from solutions.ex3_scrubbing import scrub_action

    hashing.engine_stage_hasher(chained_block_hash, "sha256")
    hashing.engine_stage_hasher(TenantKeyedHasher(S), "hmac-sha256")
    hashing.engine_stage_key_derivation(derive_tenant_key)
    hashing.engine_stage_block_keys(block_keys)
    cached, _ = scrubbing.engine_stage_placement(scrub_action)
    assert sum(cached) > 0, "the scrubber workload must include cache hits"

    def on_alloc(transition, seq):  # the other correct placement: zero on the way OUT of the free list,
        # and, since the tier clause wants no plaintext left behind a sealed copy, on offload too
        return "zero" if transition in ("allocate", "offload") else "keep"
    scrubbing.engine_stage_placement(on_alloc)

    def on_alloc_only(transition, seq):  # wrong under the tier clause: an offloaded block's K/V wait,
        return "zero" if transition == "allocate" else "keep"  # in plaintext, on the free list
    with pytest.raises(CheckFailed, match="offloaded K/V left in the pool"):
        scrubbing.engine_stage_placement(on_alloc_only)


def test_the_engines_reference_is_what_the_course_teaches(capsys):
    """minikv's own hashers and key derivation pass the exercise graders (the engine does what
    lesson 07 teaches), with the same labels as the solutions (which build on exercise 1a's own
    wire format, so their bytes may differ from the engine's)."""
    import hmac

    from solutions import ex1_chained_hash, ex2_tenant_keys

    from minikv.grading import check_chained_hash, check_tenant_key_derivation, check_tenant_keyed_hasher
    from minikv.security.encoding import encode_fields
    from minikv.security.hashing import BLOCK_DOMAIN, HmacSha256Hasher, make_hasher
    from minikv.security.keys import derive_tenant_key as engine_derive_tenant_key
    engine_sha256 = make_hasher("sha256", S)
    assert check_chained_hash(engine_sha256, encode_fields=encode_fields) is True
    assert check_tenant_keyed_hasher(HmacSha256Hasher) is True
    assert check_tenant_key_derivation(engine_derive_tenant_key) is True
    from minikv.grading import key_layout as kl  # 2d's reference layout isolates (it skips input checks)
    blocks = len(kl.IDENTITIES) * sum(n // 4 for n, _, _ in kl.SHAPES)
    assert kl.check_isolation_direct(kl.reference_key_layout) == blocks
    assert capsys.readouterr().out.count("✅") == 3
    blocks = [(None, (1, 2, 3, 4), (), None), (b"p" * 32, (5, 6), ("x",), b"k" * 32)]
    from minikv.security import hashing as sh
    from minikv.security import keys as sk
    assert ex1_chained_hash.BLOCK_DOMAIN == BLOCK_DOMAIN and ex2_tenant_keys.BLOCK_LABEL == sh.BLOCK_LABEL
    assert (ex2_tenant_keys.TENANT_LABEL, ex2_tenant_keys.SHARED_LABEL) == (sk.TENANT_LABEL, sk.SHARED_LABEL)
    assert ex2_tenant_keys.MIN_SECRET_BYTES == sk.MIN_SECRET_BYTES
    for block in blocks:  # the engine's construction
        assert engine_sha256(*block) == hashlib.sha256(encode_fields(BLOCK_DOMAIN, *block)).digest()
    for tenant in ("alice", "", None):  # the solution's: HMAC over its own 1a encoding
        want = hmac.digest(S, ex1_chained_hash.encode_fields(sk.TENANT_LABEL, tenant), "sha256")
        assert ex2_tenant_keys.derive_tenant_key(S, tenant) == want
        assert len(engine_derive_tenant_key(S, tenant)) == 32


# ------------------------------------------------------------------ generator and runner

def test_exercises_are_in_sync():
    stale = stale_files()
    assert not stale, (f"exercises/ differs from what solutions/ generates: {stale}. Maintainers: run "
                       "`python -m minikv.grading.make_exercises`. (A learner who edited exercises/ sees this "
                       "failure by design; use `make grade` instead.)")


def test_generator_check_mode_exit_status(tmp_path, capsys):
    from minikv.grading.make_exercises import main, write
    assert main(["--check"]) == 0
    assert write(tmp_path)[1] == []
    assert stale_files(tmp_path) == []
    (tmp_path / "ex1_chained_hash.py").write_text("# edited\n")
    assert stale_files(tmp_path) == ["ex1_chained_hash.py"]


def test_every_solution_region_becomes_a_stub():
    for path in sorted(SOLUTIONS.glob("ex*.py")):
        source = path.read_text(encoding="utf-8")
        stub = strip_solutions(source)
        assert source.count("# BEGIN SOLUTION") == stub.count("raise NotImplementedError(") > 0, path.name
        assert "# BEGIN SOLUTION" not in stub and "# END SOLUTION" not in stub
        compile(stub, path.name, "exec")
    assert (EXERCISES / "grade.py").read_text().endswith((SOLUTIONS / "grade.py").read_text())


def test_strip_solutions_rules():
    src = ("def f(x):\n    \"\"\"doc\"\"\"\n    # BEGIN SOLUTION\n    return x\n\n\ndef _helper():\n    pass\n"
           "    # END SOLUTION\n\n\nclass C:\n    def m(self):\n        # BEGIN SOLUTION\n        return 1\n"
           "        # END SOLUTION\n# BEGIN SOLUTION\nSECRET = 1\n# END SOLUTION\n")
    out = strip_solutions(src)
    assert 'raise NotImplementedError("f: ' in out and "_helper" not in out
    assert 'raise NotImplementedError("C.m: ' in out and "SECRET" not in out
    for bad in ("    # BEGIN SOLUTION\n    x\n", "    # END SOLUTION\n", "# BEGIN SOLUTION\n  # END SOLUTION\n",
                "x = 1  # BEGIN SOLUTION\n"):
        with pytest.raises(MarkerError):
            strip_solutions(bad)


def test_runner_table_and_exit_status(stub_package, capsys):
    from minikv.grading.runner import main
    assert main("solutions", ["5", "4a"]) == 0
    assert main(stub_package, ["4a"]) == 1
    out = capsys.readouterr().out
    assert "3/3 exercises pass" in out and "0/1 exercises pass" in out
    assert grade(stub_package, ["1a"], quiet=True) == {"1a": False}
    assert "❌ FAIL" in summary_table({"1a": False}) and "✅ pass" in summary_table({"1a": True})


def test_make_grade_entry_point_runs_as_a_module():
    """`make grade` runs `python -m exercises.grade`: it must import and print the table (the
    committed stubs fail, so the exit status is 1 unless a learner has solved 4a)."""
    done = subprocess.run([sys.executable, "-m", "exercises.grade", "4a"], cwd=ROOT, capture_output=True, text=True)
    assert "grading exercises/" in done.stdout and "1 exercises pass" in done.stdout, done.stdout + done.stderr
    assert done.returncode == (0 if "1/1 exercises pass" in done.stdout else 1)


def test_a_broken_exercise_module_is_reported_and_the_rest_still_run(tmp_path, capsys):
    pkg = tmp_path / "broken_ex"
    pkg.mkdir()
    for name, text in generate().items():
        (pkg / name).write_text(text, encoding="utf-8")
    (pkg / "ex5_timing_stats.py").write_text("def broken(:\n")
    sys.path.insert(0, str(tmp_path))
    try:
        results = grade("broken_ex", ["5a", "4a"])
    finally:
        sys.path.remove(str(tmp_path))
    out = capsys.readouterr().out
    assert results == {"4a": False, "5a": False}
    assert "cannot import broken_ex.ex5_timing_stats" in out and "SyntaxError" in out


def test_lessons_hand_out_no_solution():
    """Lessons 07 and 08 fold no solution: no line of a solution region appears in their markdown or
    code (the hints live in `make hint`, whose last level alone may show code)."""
    import nbformat
    regions = _solution_lines()
    for name in ("07_tenant_keyed_hashing.ipynb", "08_scrubbing.ipynb"):
        nb = nbformat.read(ROOT / "course" / name, as_version=4)
        text = "\n".join(c.source for c in nb.cells)
        assert "<summary>Solution</summary>" not in text, name
        leaked = sorted(line for line in regions if line in text)
        assert not leaked, f"{name} contains solution lines: {leaked[:3]}"


def _solution_lines() -> set[str]:
    """Distinctive lines inside the # BEGIN/END SOLUTION regions of solutions/ (no comments, no
    one-word lines such as `return keys`)."""
    lines = set()
    for path in sorted(SOLUTIONS.glob("ex*.py")):
        inside = False
        for line in path.read_text(encoding="utf-8").splitlines():
            stripped = line.strip()
            if stripped in ("# BEGIN SOLUTION", "# END SOLUTION"):
                inside = stripped == "# BEGIN SOLUTION"
                continue
            code = stripped.split("  #")[0].strip()
            if inside and len(code) >= 30 and not code.startswith(("#", "raise ", "return ZERO", "return KEEP")):
                lines.add(code)
    return lines


def test_stubs_and_first_hints_hand_out_no_solution():
    from minikv.grading.hints import HINTS
    lines = _solution_lines()
    assert len(lines) >= 20
    for name, text in generate().items():
        leaked = [line for line in lines if line in text]
        assert not leaked, f"exercises/{name} contains solution lines: {leaked[:3]}"
    for ex_id, levels in HINTS.items():
        assert len(levels) == 3, ex_id
        for level in levels[:2]:
            assert not any(line in level for line in lines), (ex_id, level)
            assert "\n    " not in level, f"hint {ex_id} shows code before its last level"
        assert "\n" in levels[2] or "    " in levels[2], f"hint {ex_id} level 3 should sketch code"


def test_every_topic_takes_at_least_ten_lines_of_the_learners_own_logic():
    """Issue 10: each of the five topics is a task, not a blank -- counted on the reference solution's
    regions: code lines only (no blank lines, comments or docstrings)."""
    for path in sorted(SOLUTIONS.glob("ex[1-5]_*.py")):
        inside, n = False, 0
        for line in path.read_text(encoding="utf-8").splitlines():
            stripped = line.strip()
            if stripped in ("# BEGIN SOLUTION", "# END SOLUTION"):
                inside = stripped == "# BEGIN SOLUTION"
            elif inside and stripped and not stripped.startswith("#") and stripped != "pass":
                n += 1
        assert n >= 10, f"{path.name}: only {n} lines of the learner's own logic"


def test_3c_smoke_test_passes_a_correct_zero_blocks_and_misses_real_bugs():
    """Exercise 3c's premise: the colleague's smoke test accepts a correct ``zero_blocks`` and rejects
    one that does nothing, yet several of 3a's own mutants (bugs its grader names) slip past it, so
    the learner has real bugs to find, in more than one class."""
    from minikv.grading.written_mutants import bug_class, smoke_test
    from solutions.ex3_scrubbing import zero_blocks

    assert smoke_test(zero_blocks) is True
    assert smoke_test(lambda pool, ids: None) is False
    survivors = [name for name, impl, _ in M.MUTANTS["3a"] if smoke_test(impl)]
    assert {"k-only", "layer0-only"} <= set(survivors), survivors
    assert bug_class("block 3 was not zeroed (bug class: V forgotten): ...") == "V forgotten"
    assert bug_class("after f(pool, [1, 4]), block 2 changed: x") == bug_class("after f(pool, [8]), block 5 changed: y")


def test_3d_budget_counts_the_workloads_required_blocks_whatever_the_scrubber():
    """Exercise 3d's budget is counted, not timed: the required blocks (handovers of a block some request held
    before) are the workload's, the same under every safe design; the reference zeroes exactly those in one
    write per handover, and minikv's own two safe scrubbers are over budget, each for its own waste."""
    from minikv.grading import scrub_budget as sb
    from solutions.ex3_scrubbing import BudgetScrubber

    ref = sb.reference_cost()
    mine, cached = sb.measure(BudgetScrubber)
    assert cached > 0 and mine == ref and ref["zeroed"] == ref["required"] > 0 and ref["writes"] == ref["handovers"]
    eager, _ = sb.measure(M.BudgetEagerOnFree)
    lazy, _ = sb.measure(M.BudgetEveryAlloc)
    assert eager["required"] == lazy["required"] == ref["required"]
    assert eager["unreused"] > 0 == eager["pristine"] and lazy["pristine"] > 0 == lazy["unreused"]
    assert not sb.over_budget(ref) and sb.over_budget(eager) and sb.over_budget(lazy)
