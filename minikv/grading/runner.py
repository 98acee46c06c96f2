"""Grade a package of exercise implementations (``exercises`` or ``solutions``).

``python -m exercises.grade`` (what ``make grade`` runs) calls :func:`main` with its own
package name; it imports every exercise module, runs each grader and prints a summary table.
An exercise whose module cannot even be imported is reported as failed (with the error) and
the others still run.
"""
from __future__ import annotations

import importlib
import io
from contextlib import redirect_stdout
from dataclasses import dataclass
from typing import Callable

from . import hashing, isolation, scrubbing, stats, tenant_keys


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


EXERCISES: list[Exercise] = [
    Exercise("1a", "ex1_chained_hash", "encode_fields", hashing.check_encode_fields,
             "typed, length-prefixed encoding", "07"),
    Exercise("1b", "ex1_chained_hash", "chained_block_hash", hashing.check_chained_hash,
             "chained, domain-separated block hash", "07", ("encode_fields",)),
    Exercise("2a", "ex2_tenant_keys", "derive_tenant_key", tenant_keys.check_tenant_key_derivation,
             "server-side per-tenant keys (HMAC)", "07"),
    Exercise("2b", "ex2_tenant_keys", "TenantKeyedHasher", tenant_keys.check_tenant_keyed_hasher,
             "tenant-keyed block hasher", "07"),
    Exercise("2c", "ex2_tenant_keys", "block_keys", tenant_keys.check_block_keys,
             "tenant key in every block (plumbing)", "07"),
    Exercise("3a", "ex3_scrubbing", "zero_blocks", scrubbing.check_zero_blocks,
             "zero blocks: all layers, K and V", "08"),
    Exercise("3b", "ex3_scrubbing", "ScrubOnAlloc", scrubbing.check_scrubber,
             "scrubber in the block lifecycle", "08"),
    Exercise("4a", "ex4_isolation_audit", "audit_verdict", isolation.check_audit_verdict,
             "two-directional verdict", "08"),
    Exercise("4b", "ex4_isolation_audit", "isolation_audit", isolation.check_isolation_audit,
             "concurrent isolation audit", "08"),
    Exercise("5a", "ex5_timing_stats", "ks_test", stats.check_ks_test,
             "one-sided KS test", "07"),
    Exercise("5b", "ex5_timing_stats", "roc_auc", stats.check_roc_auc,
             "ROC AUC of 'faster => hit'", "07"),
]


def select(ids: list[str] | None) -> list[Exercise]:
    """Exercises whose id equals or starts with one of ``ids`` ("2" selects 2a, 2b, 2c)."""
    if not ids:
        return list(EXERCISES)
    chosen = [e for e in EXERCISES if any(e.id == i or e.id.startswith(i) for i in ids)]
    if not chosen:
        raise SystemExit(f"no exercise matches {' '.join(ids)}; ids: {', '.join(e.id for e in EXERCISES)}")
    return chosen


def grade_one(ex: Exercise, package: str, quiet: bool = False) -> tuple[bool, str]:
    """Run one grader on ``package``'s implementation; return (passed, printed message)."""
    buf = io.StringIO()
    with redirect_stdout(buf):
        try:
            target = ex.target(package)
            kwargs = {k: getattr(importlib.import_module(f"{package}.{ex.module}"), k) for k in ex.extra}
        except Exception as exc:  # noqa: BLE001 -- a syntax error in one file must not stop the others
            print(f"❌ {ex.check.__name__}: cannot import {package}.{ex.module}.{ex.name}: "
                  f"{type(exc).__name__}: {exc}")
            ok = False
        else:
            ok = ex.check(target, **kwargs)
    text = buf.getvalue()
    if not quiet:
        print(text, end="")
    return ok, text


def grade(package: str = "exercises", ids: list[str] | None = None, quiet: bool = False) -> dict[str, bool]:
    """Grade ``package``; returns ``{exercise id: passed}`` and (unless quiet) prints a table."""
    results: dict[str, bool] = {}
    for ex in select(ids):
        results[ex.id], _ = grade_one(ex, package, quiet)
    if not quiet:
        print()
        print(summary_table(results))
    return results


def summary_table(results: dict[str, bool]) -> str:
    by_id = {e.id: e for e in EXERCISES}
    lines = [f"{'ex':<4}{'lesson':<8}{'implement':<22}{'what':<40}result", "-" * 80]
    for ex_id, ok in results.items():
        e = by_id[ex_id]
        lines.append(f"{e.id:<4}{e.lesson:<8}{e.name:<22}{e.title:<40}{'✅ pass' if ok else '❌ FAIL'}")
    n_ok = sum(results.values())
    lines.append("-" * 80)
    lines.append(f"{n_ok}/{len(results)} exercises pass" + ("" if n_ok == len(results) else
                 " -- scroll up for what failed and a hint for each"))
    return "\n".join(lines)


def main(package: str = "exercises", argv: list[str] | None = None) -> int:
    """Entry point of ``python -m <package>.grade [ids...]``: 0 when all pass, 1 otherwise."""
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning, module="minikv")
    print(f"grading {package}/ ...\n")
    results = grade(package, list(argv or []) or None)
    return 0 if all(results.values()) else 1
