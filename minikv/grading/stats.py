"""Graders for exercise 5: the timing audit's one-sided KS test and ROC AUC.

Both are compared with the engine's reference, :mod:`minikv.audit.stats`, on the same inputs:
synthetic latency samples built to expose the classic mistakes (hits faster, hits *slower*,
no difference, ties from millisecond rounding, tiny and unequal samples), and -- when
:mod:`minikv.audit.gu` can find it -- a deterministic selection of the raw client times
released by Gu et al. (ICML 2025).
"""
from __future__ import annotations

import functools
import math

import numpy as np

from ..audit import stats as ref
from ._report import CheckFailed, expect, grader


@functools.lru_cache(maxsize=1)
def datasets() -> tuple[tuple[str, tuple, tuple], ...]:
    """(name, hit, miss) samples, synthetic first, then Gu et al.'s if available."""
    rng = np.random.default_rng(2025)
    fast = rng.lognormal(np.log(0.020), 0.25, 60)
    slow = rng.lognormal(np.log(0.045), 0.25, 50)
    same_a, same_b = rng.lognormal(np.log(0.03), 0.3, 80), rng.lognormal(np.log(0.03), 0.3, 70)
    near_a, near_b = rng.normal(0.030, 0.004, 40), rng.normal(0.033, 0.004, 45)
    ties_hit = rng.integers(10, 20, 40).astype(float)    # whole milliseconds: many ties
    ties_miss = rng.integers(13, 23, 35).astype(float)
    out = [
        ("hits faster", fast, slow),
        ("hits slower", slow, fast),
        ("no difference", same_a, same_b),
        ("small overlap", near_a, near_b),
        ("ties (whole ms)", ties_hit, ties_miss),
        ("perfect separation, n=15", np.arange(1.0, 16.0), np.arange(20.0, 35.0)),
        ("tiny samples", np.array([3.0, 1.0, 2.0]), np.array([2.5, 4.0, 5.0, 6.0])),
        ("all tied", np.full(5, 7.0), np.full(6, 7.0)),
    ]
    out = [(n, tuple(map(float, h)), tuple(map(float, m))) for n, h, m in out]
    return tuple(out + _gu_datasets())


def _gu_datasets(limit: int = 8) -> list:
    try:
        from ..audit.gu import find_gu_zip, load_gu_runs
        path = find_gu_zip()
        if path is None:
            return []
        runs = load_gu_runs(path)
    except Exception:  # noqa: BLE001 -- the released data is optional
        return []
    step = max(1, len(runs) // limit)
    return [(f"Gu et al. {r.provider}/{r.level}/pf={r.prefix_fraction}/v={r.n_victim}", r.hit, r.miss)
            for r in runs[::step][:limit]]


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12)


@grader("scipy.stats.ks_2samp(hit, miss, alternative=...) -- which alternative means 'hits are faster'?")
def check_ks_test(ks_test) -> str:
    """Exercise 5a: (statistic, p-value) equal to minikv.audit.stats.ks_test on every dataset."""
    sets = datasets()
    for name, hit, miss in sets:
        for convert in (list, np.asarray):
            got = ks_test(convert(hit), convert(miss))
            expect(isinstance(got, tuple) and len(got) == 2, f"ks_test returned {got!r}; expected (statistic, pvalue)")
            stat, p = float(got[0]), float(got[1])
            want_stat, want_p = ref.ks_test(hit, miss)
            if _close(stat, want_stat) and _close(p, want_p):
                continue
            two_sided = _close(stat, max(want_stat, ref.ks_test(miss, hit)[0]))
            if name == "hits slower" and p < 1e-3:
                raise CheckFailed(f"on '{name}' your p-value is {p:.2e}: you report slower 'hits' as evidence of a "
                                  "cache", "a one-sided test for 'hit times are smaller': slower hits must give "
                                  "p close to 1.  Check the `alternative` argument (and which sample is x).")
            if name == "hits faster" and p > 1e-3:
                raise CheckFailed(f"on '{name}' your p-value is {p:.2e}: the test misses a clear cache signal",
                                  "you test the opposite direction: 'greater' means the CDF of x lies above the "
                                  "CDF of y, i.e. x tends to be SMALLER.")
            hint = ("a two-sided test doubles (roughly) the one-sided p-value and also fires when hits are slower; "
                    "use a one-sided alternative." if two_sided else
                    "compare your numbers with minikv.audit.stats.ks_test(hit, miss).")
            raise CheckFailed(f"on '{name}' (n={len(hit)}/{len(miss)}) you returned statistic={stat:.6g}, "
                              f"p={p:.6g}; the reference gives statistic={want_stat:.6g}, p={want_p:.6g}", hint)
    return ("equals minikv.audit.stats.ks_test on every dataset (synthetic, plus Gu et al.'s released runs when "
            "minikv.audit.gu finds them)")


@grader("AUC = mean over all (hit, miss) pairs of [hit < miss] + 0.5 * [hit == miss].")
def check_roc_auc(roc_auc) -> str:
    """Exercise 5b: equal to minikv.audit.stats.roc_auc on every dataset."""
    sets = datasets()
    for name, hit, miss in sets:
        for convert in (list, np.asarray):
            got = float(roc_auc(convert(hit), convert(miss)))
            want = ref.roc_auc(hit, miss)
            if math.isclose(got, want, abs_tol=1e-9):
                continue
            if math.isclose(got, 1.0 - want, abs_tol=1e-9):
                raise CheckFailed(f"on '{name}' your AUC is {got:.4f}, the reference {want:.4f}: exactly 1 - AUC",
                                  "the classifier says 'hit' for SMALLER latencies: count pairs with hit < miss.")
            raise CheckFailed(f"on '{name}' (n={len(hit)}/{len(miss)}) your AUC is {got:.6f}, the reference "
                              f"{want:.6f}", "ties (hit == miss) count one half." if "tie" in name else
                              "compare with minikv.audit.stats.roc_auc(hit, miss).")
    return "equals minikv.audit.stats.roc_auc on every dataset; ties count one half"
