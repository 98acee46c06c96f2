"""Grade a package of exercise implementations (``exercises`` or ``solutions``).

``python -m exercises.grade`` (what ``make grade`` runs) calls :func:`main` with its own
package name; it imports every exercise module, runs each grader and prints a summary table.
An exercise whose module cannot even be imported is reported as failed (with the error) and
the others still run.  Before importing, the file is read by the reference-import gate
(:mod:`.guard`): an exercise that imports the engine's reference implementation fails with a
message that says why, without being run.

``python -m minikv.grading.runner PACKAGE [ids] --json FILE`` also writes the results as JSON
(what ``make grade DIR=...``, :mod:`.gradebook`, reads from each submission's subprocess).
"""
from __future__ import annotations

import importlib
import importlib.util
import io
import json
import sys
from pathlib import Path
from contextlib import redirect_stdout
from dataclasses import dataclass
from typing import Callable

from . import guard, hashing, isolation, key_layout, scrub_budget, scrubbing, stats, tenant_keys, written_mutants
from . import capstone, labs_detector, labs_oracle, labs_prior  # the attack labs and the capstone (H8)


@dataclass(frozen=True)
class Exercise:
    id: str
    module: str            # module name inside the package
    name: str              # the function/class the learner implements
    check: Callable        # the grader
    title: str
    lesson: str
    extra: tuple = ()      # names of further attributes passed to the grader as keywords

    def target(self, package: str):
        return getattr(importlib.import_module(f"{package}.{self.module}"), self.name)


#: One group per module the learner edits: (module, lesson, rows).  A row is (id, the function or
#: class to implement, its grader, title[, names of the module's attributes the grader also gets]).
_TABLE = (
    ("ex1_chained_hash", "07", (
        ("1a", "encode_fields", hashing.check_encode_fields, "typed, length-prefixed encoding"),
        ("1b", "chained_block_hash", hashing.check_chained_hash, "chained, domain-separated block hash",
         ("encode_fields",)))),
    ("ex2_tenant_keys", "07", (
        ("2a", "derive_tenant_key", tenant_keys.check_tenant_key_derivation, "server-side per-tenant keys (HMAC)",
         ("encode_fields",)),
        ("2b", "TenantKeyedHasher", tenant_keys.check_tenant_keyed_hasher, "tenant-keyed block hasher",
         ("encode_fields",)),
        ("2c", "block_keys", tenant_keys.check_block_keys, "tenant key in every block (plumbing)"),
        ("2d", "key_layout", key_layout.check_key_layout, "open design: public/tenant/user key layout"))),
    ("ex3_scrubbing", "08", (
        ("3a", "zero_blocks", scrubbing.check_zero_blocks, "zero blocks: all layers, K and V"),
        ("3b", "scrub_action", scrubbing.check_scrub_placement, "scrub placement in the block lifecycle"),
        ("3c", "sneaky_zero_blocks_a", written_mutants.check_written_mutants,
         "write the mutant: bugs a smoke test misses, 3a's grader catches", ("sneaky_zero_blocks_b",)),
        ("3d", "BudgetScrubber", scrub_budget.check_scrub_budget, "open design: a scrubber within a cost budget"))),
    ("ex4_isolation_audit", "08", (
        ("4a", "audit_verdict", isolation.check_audit_verdict, "two-directional verdict"),
        ("4b", "isolation_audit", isolation.check_isolation_audit, "concurrent isolation audit"))),
    ("ex5_timing_stats", "07", (
        ("5a", "ks_test", stats.check_ks_test, "one-sided KS test"),
        ("5b", "roc_auc", stats.check_roc_auc, "ROC AUC of 'faster => hit'"))),
    ("lab1_prefix_oracle", "04", (("L1", "extract_secret", labs_oracle.check_oracle_attack,
                                   "lab: steal a secret via cached_tokens"),)),
    ("lab2_timing", "04", (("L2", "extract_secret_by_timing", labs_oracle.check_timing_attack,
                            "lab: steal it from TTFT (self-priming)"),)),
    ("lab4_ranked_guesser", "04", (("L4", "guess_secret", labs_prior.check_ranked_guesser,
                                    "lab: beat exhaustive with a model prior"),)),
    ("lab3_detector", "09", (("L3", "detect_probing", labs_detector.check_detector,
                              "lab: probing detector on a trail"),)),
    ("capstone_audit", "12", (("C", "audit_fleet", capstone.check_capstone, "capstone: audit the mystery fleet"),)),
)
EXERCISES: list[Exercise] = [Exercise(ex_id, module, name, check, title, lesson, *extra)
                             for module, lesson, rows in _TABLE for ex_id, name, check, title, *extra in rows]


def select(ids: list[str] | None) -> list[Exercise]:
    """Exercises whose id equals or starts with one of ``ids`` ("2" selects 2a to 2d)."""
    if not ids:
        return list(EXERCISES)
    chosen = [e for e in EXERCISES if any(e.id == i or e.id.startswith(i) for i in ids)]
    if not chosen:
        raise SystemExit(f"no exercise matches {' '.join(ids)}; ids: {', '.join(e.id for e in EXERCISES)}")
    return chosen


def module_file(package: str, module: str) -> Path | None:
    """The source file of ``package.module`` (imports only the package's ``__init__``)."""
    try:
        spec = importlib.util.find_spec(f"{package}.{module}")
    except (ImportError, ValueError):
        return None
    return Path(spec.origin) if spec is not None and spec.origin else None


def grade_one(ex: Exercise, package: str, quiet: bool = False, strict: bool = False) -> tuple[bool, str]:
    """Run one grader on ``package``'s implementation; return (passed, printed message).
    ``strict`` (graded submissions): the gate also refuses imports of the graders, and the
    learner's code runs sealed in a child process (:mod:`.sealed`), never in this one."""
    ok, text, _ = grade_one_status(ex, package, quiet, strict)
    return ok, text


def grade_one_status(ex: Exercise, package: str, quiet: bool = False, strict: bool = False) -> tuple[bool, str, str]:
    """:func:`grade_one` plus a status: passed, failed, refused (by the gate), timeout, tampering,
    error (the grader's own machinery failed: :class:`~._report.GraderFault`)."""
    buf = io.StringIO()
    path = package_dir(package) / f"{ex.module}.py" if strict else module_file(package, ex.module)
    stub = stub_source(ex.module) if strict else None
    refused = guard.check_file(path, grading_submission=strict, stub=stub) if path is not None else []
    status = "refused"
    if hasattr(ex.check, "last_fault"):  # a check that never runs (an import failed) leaves no stale fault
        ex.check.last_fault = None
    with redirect_stdout(buf):
        if refused:
            print(f"❌ {ex.check.__name__}: not graded -- " + "\n   ".join(refused))
            ok = False
            status = "tampering" if any("tampering" in r for r in refused) else "refused"
        elif strict:
            from .sealed_run import sealed_check

            ok, status = sealed_check(ex, package_dir(package), package)
        else:
            ok = _run_check(ex, package)
            status = "passed" if ok else "failed"
    if status in ("passed", "failed") and getattr(ex.check, "last_fault", None):
        status = "error"  # the grader's machinery failed (GraderFault): regrade, no verdict on the code
    text = buf.getvalue()
    if not quiet:
        print(text, end="")
    return ok, text, status


def package_dir(package: str) -> Path:
    """The folder of a top-level package, found without importing (running) it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"no package {package!r} on the path")
    return Path(list(spec.submodule_search_locations)[0])


def stub_source(module: str) -> str | None:
    """The generated stub of ``module`` (what the gate lets a submission import: its own stub's imports)."""
    from .make_exercises import generate

    return generate().get(f"{module}.py")


def _run_check(ex: Exercise, package: str) -> bool:
    try:
        target = ex.target(package)
        kwargs = {k: getattr(importlib.import_module(f"{package}.{ex.module}"), k) for k in ex.extra}
    except Exception as exc:  # noqa: BLE001 -- a syntax error in one file must not stop the others
        print(f"❌ {ex.check.__name__}: cannot import {package}.{ex.module}.{ex.name}: "
              f"{type(exc).__name__}: {exc}")
        return False
    return ex.check(target, **kwargs)


def grade(package: str = "exercises", ids: list[str] | None = None, quiet: bool = False,
          messages: dict[str, str] | None = None, strict: bool = False,
          statuses: dict[str, str] | None = None, seconds: dict[str, float] | None = None) -> dict[str, bool]:
    """Grade ``package``; returns ``{exercise id: passed}`` and (unless quiet) prints a table.
    ``messages``, if given, receives each grader's printed verdict; ``statuses`` each status,
    ``seconds`` the seconds each check took."""
    import time

    results: dict[str, bool] = {}
    for ex in select(ids):
        t0 = time.perf_counter()
        results[ex.id], text, status = grade_one_status(ex, package, quiet, strict)
        if seconds is not None:
            seconds[ex.id] = round(time.perf_counter() - t0, 1)
        if messages is not None:
            messages[ex.id] = text.strip()
        if statuses is not None:
            statuses[ex.id] = status
    if not quiet:
        print()
        print(summary_table(results))
    return results


def summary_table(results: dict[str, bool]) -> str:
    by_id = {e.id: e for e in EXERCISES}
    name_w = max(len(e.name) for e in EXERCISES) + 2  # the columns fit the longest name and title
    what_w = max(len(e.title) for e in EXERCISES) + 2
    rule = "-" * (12 + name_w + what_w + 7)
    lines = [f"{'ex':<4}{'lesson':<8}{'implement':<{name_w}}{'what':<{what_w}}result", rule]
    for ex_id, ok in results.items():
        e = by_id[ex_id]
        lines.append(f"{e.id:<4}{e.lesson:<8}{e.name:<{name_w}}{e.title:<{what_w}}{'✅ pass' if ok else '❌ FAIL'}")
    n_ok = sum(results.values())
    lines.append(rule)
    lines.append(f"{n_ok}/{len(results)} exercises pass" + ("" if n_ok == len(results) else
                 " -- scroll up for what failed and a hint for each"))
    return "\n".join(lines)


def fingerprint() -> dict[str, int]:
    """``{qualified name: id of its code}`` for every function and method of the loaded
    ``minikv.grading`` and ``minikv.engine`` modules: a monkeypatch changes one of them."""
    prints = {}
    for name, mod in list(sys.modules.items()):
        if not name.startswith(("minikv.grading", "minikv.engine")) or mod is None:
            continue
        for attr, obj in list(vars(mod).items()):
            for sub, fn in [(attr, obj)] + (list(vars(obj).items()) if isinstance(obj, type) else []):
                code = getattr(fn, "__code__", None)
                if code is not None:
                    prints[f"{name}.{attr}.{sub}"] = id(code)
    return prints


def main(package: str = "exercises", argv: list[str] | None = None, json_path: str | None = None,
         strict: bool = False, sign_key: bytes | None = None) -> int:
    """Entry point of ``python -m <package>.grade [ids...]``: 0 when all pass, 1 otherwise.
    ``strict`` (graded submissions): the stricter gate, every check sealed (:mod:`.sealed`), and a
    check afterwards that no function of the graders or the engine was replaced in this process.
    ``sign_key``: the JSON carries an HMAC of its content under it (the gradebook checks it)."""
    import warnings

    from .. import engine as _engine  # noqa: F401 -- load what the fingerprint covers
    from . import harness  # noqa: F401

    warnings.filterwarnings("ignore", category=UserWarning, module="minikv")
    print(f"grading {package}/ ...\n")
    if strict:
        from ._sandbox import become_subreaper
        from .sealed import isolation, make_undumpable

        make_undumpable()
        become_subreaper()  # an escaped learner process is re-parented here, and ended with its check
        print(isolation() + "\n")
    before = fingerprint() if strict else {}
    messages: dict[str, str] = {}
    statuses: dict[str, str] = {}
    seconds: dict[str, float] = {}
    results = grade(package, list(argv or []) or None, messages=messages, strict=strict, statuses=statuses,
                    seconds=seconds)
    error = ""
    if strict:
        after = fingerprint()
        changed = sorted(k for k in before if after.get(k) != before[k])
        if changed:
            error = f"tampering: grader/engine code was replaced ({', '.join(changed[:3])}): every result voided"
            results = {k: False for k in results}
            statuses = {k: "tampering" for k in results}
            print(f"❌ {error}")
    if json_path:
        payload = {"results": results, "messages": messages, "statuses": statuses, "seconds": seconds,
                   "error": error}
        if sign_key:
            payload["sig"] = sign(payload, sign_key)
        text = json.dumps(payload, ensure_ascii=False)
        if json_path == "-":  # on stdout, after a marker: no file another process could rewrite
            print("\n" + RESULT_MARK + text, flush=True)
        else:
            Path(json_path).write_text(text)
    return 0 if all(results.values()) else 1


RESULT_MARK = "@@MINIKV-RESULT@@"


def sign(payload: dict, key: bytes) -> str:
    """HMAC-SHA256 of a result payload (without its ``sig``), in canonical JSON."""
    import hashlib
    import hmac

    body = json.dumps({k: v for k, v in payload.items() if k != "sig"}, sort_keys=True, ensure_ascii=False)
    return hmac.new(key, body.encode(), hashlib.sha256).hexdigest()


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(prog="python -m minikv.grading.runner", description="grade a package of exercises")
    ap.add_argument("package", help="importable package name (exercises, solutions, or a submission)")
    ap.add_argument("ids", nargs="*", help="exercise ids (default: all)")
    ap.add_argument("--json", dest="json_path", help="also write the results to this JSON file ('-': stdout)")
    ap.add_argument("--strict", action="store_true", help="graded submission: sealed runs, the strict gate")
    ap.add_argument("--sign-stdin", action="store_true", help="read a key from stdin and sign the JSON with it")
    a = ap.parse_args()
    key = bytes.fromhex(sys.stdin.readline().strip()) if a.sign_stdin else None
    sys.exit(main(a.package, a.ids, a.json_path, a.strict, key))
