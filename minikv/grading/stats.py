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
from ._report import CheckFailed, call_safely, expect, grader


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


def _same_p(a: float, b: float) -> bool:
    """p-values compared relatively (1e-20 and 2e-20 differ: that factor 2 is the two-sided mistake)."""
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-300)


def accepted_pvalues(hit, miss) -> dict[str, float]:
    """The one-sided p-values a correct ``ks_test`` may return: methods differ, meaning does not.
    (A negative control: exact and asymptotic p-values must both be accepted.)"""
    from scipy import stats as st

    h, m = np.asarray(hit, float), np.asarray(miss, float)
    d = ref.ks_test(hit, miss)[0]
    n = len(h) * len(m) / (len(h) + len(m))
    return {"reference": ref.ks_test(hit, miss)[1],
            "exact": float(st.ks_2samp(h, m, alternative="greater", method="exact").pvalue),
            "asymptotic": float(st.ks_2samp(h, m, alternative="greater", method="asymp").pvalue),
            "textbook asymptotic": float(min(1.0, math.exp(-2.0 * n * d * d)))}


def _two_sided(hit, miss) -> tuple[float, set[float]]:
    from scipy import stats as st

    h, m = np.asarray(hit, float), np.asarray(miss, float)
    res = [st.ks_2samp(h, m, method=meth) for meth in ("exact", "asymp")]
    return float(res[0].statistic), {float(r.pvalue) for r in res}


#: (hit, miss, the sample at fault, what is wrong): input the contract refuses with ValueError
BAD_SAMPLES = [([], [0.02, 0.03], "hit", "an empty hit sample"), ([0.01, 0.02], [], "miss", "an empty miss sample"),
               ([0.01, float("nan")], [0.02, 0.03], "hit", "a NaN latency among the hits"),
               ([0.01, 0.02], [0.02, float("inf")], "miss", "an infinite latency among the misses")]


def check_ks_input(ks_test) -> None:
    """The contract's refusals: ValueError for an empty sample or a non-finite latency, naming which
    sample.  A NaN sorts anywhere and an empty sample has no CDF: a number computed from them is noise."""
    for hit, miss, which, what in BAD_SAMPLES:
        _, exc = call_safely(ks_test, hit, miss)
        expect(isinstance(exc, ValueError), f"ks_test accepted {what} "
               f"({'returned a result' if exc is None else 'raised ' + type(exc).__name__}); the contract says "
               "ValueError (bug class: input not validated -- a statistic of an empty or non-finite sample is noise)",
               "check both samples before computing anything: non-empty, every latency finite.")
        expect(which in str(exc).lower(), f"ks_test raised ValueError for {what}, but its message {str(exc)!r} does "
               f"not say which sample (bug class: an error that does not name the bad input)",
               "name the sample ('hit' or 'miss') in the message: the caller must know which list to fix.")


@grader("the statistic is how far the hits' empirical CDF rises ABOVE the misses' (hits faster); the p-value must "
        "belong to that same one-sided alternative.")
def check_ks_test(ks_test) -> str:
    """Exercise 5a: the statistic equals minikv.audit.stats.ks_test's; the p-value is one of the
    accepted one-sided methods (exact or asymptotic), never a two-sided one."""
    sets = datasets()
    methods_seen = set()
    for name, hit, miss in sets:
        for convert in (list, np.asarray):
            got = ks_test(convert(hit), convert(miss))
            expect(isinstance(got, tuple) and len(got) == 2, f"ks_test returned {got!r}; expected (statistic, pvalue)")
            stat, p = float(got[0]), float(got[1])
            want_stat = ref.ks_test(hit, miss)[0]
            two_stat, two_ps = _two_sided(hit, miss)
            if not _close(stat, want_stat):
                if _close(stat, ref.ks_test(miss, hit)[0]):
                    raise CheckFailed(f"on '{name}' your statistic {stat:.6g} is the OTHER direction's (hits slower; "
                                      f"the right one is {want_stat:.6g}) (bug class: wrong alternative)",
                                      "max(F_hit - F_miss), not max(F_miss - F_hit): hits rise earlier when faster.")
                if _close(stat, two_stat):
                    raise CheckFailed(f"on '{name}' your statistic {stat:.6g} is the two-sided one (the one-sided is "
                                      f"{want_stat:.6g}) (bug class: two-sided test)",
                                      "a two-sided test also fires when hits are SLOWER; only faster hits are evidence.")
                raise CheckFailed(f"on '{name}' (n={len(hit)}/{len(miss)}) your statistic is {stat:.6g}; the one-sided "
                                  f"KS statistic is {want_stat:.6g}",
                                  "evaluate both empirical CDFs at every pooled sample value (side='right').")
            ok = {k for k, v in accepted_pvalues(hit, miss).items() if _same_p(p, v)}
            if ok:
                methods_seen |= ok
                continue
            if any(_same_p(p, q) for q in two_ps):
                raise CheckFailed(f"on '{name}' your p-value {p:.3g} is a TWO-SIDED test's (bug class: two-sided test "
                                  "instead of one-sided)", "a two-sided test also fires when hits are slower, and its "
                                  "p-value is about twice the one-sided one: use the one-sided alternative.")
            if name == "hits slower" and p < 1e-3:
                raise CheckFailed(f"on '{name}' your p-value is {p:.2e}: you report slower 'hits' as evidence of a "
                                  "cache (bug class: wrong alternative)",
                                  "check the `alternative` argument, and which sample is x.")
            if name == "hits faster" and p > 1e-3:
                raise CheckFailed(f"on '{name}' your p-value is {p:.2e}: the test misses a clear cache signal (bug "
                                  "class: wrong alternative)", "'greater' means the CDF of x lies ABOVE the CDF of y.")
            raise CheckFailed(f"on '{name}' (n={len(hit)}/{len(miss)}) your p-value {p:.6g} is none of the one-sided "
                              "KS p-values (exact or asymptotic)", "take the p-value of the same one-sided test.")
    check_ks_input(ks_test)
    return ("one-sided statistic equal to minikv.audit.stats.ks_test on every dataset; p-values accepted as "
            f"{' / '.join(sorted(methods_seen))}")


@grader("the AUC is the share of (hit, miss) pairs that 'smaller latency => hit' orders correctly.")
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
                raise CheckFailed(f"on '{name}' your AUC is {got:.4f}, the reference {want:.4f}: exactly 1 - AUC "
                                  "(bug class: flipped orientation)",
                                  "the classifier says 'hit' for SMALLER latencies: count pairs with hit < miss.")
            h, m = np.asarray(hit, float)[:, None], np.asarray(miss, float)[None, :]
            ties = float((h == m).mean())
            if ties and (math.isclose(got, want - 0.5 * ties, abs_tol=1e-9) or math.isclose(got, want + 0.5 * ties,
                                                                                              abs_tol=1e-9)):
                raise CheckFailed(f"on '{name}' your AUC is {got:.6f}, the reference {want:.6f}: off by exactly half "
                                  "the tied pairs (bug class: ties not counted one half)",
                                  "a tie (hit == miss) is a coin flip for the classifier: it counts one half.")
            paired = [(a < b) + 0.5 * (a == b) for a, b in zip(hit, miss)]
            if math.isclose(got, sum(paired) / len(paired), abs_tol=1e-9):
                raise CheckFailed(f"on '{name}' (n={len(hit)}/{len(miss)}) your AUC is {got:.6f}, the reference "
                                  f"{want:.6f}: you compared hit i with miss i only (bug class: not every (hit, miss) "
                                  "pair compared)", "the AUC is over ALL len(hit) * len(miss) pairs.")
            raise CheckFailed(f"on '{name}' (n={len(hit)}/{len(miss)}) your AUC is {got:.6f}, the reference "
                              f"{want:.6f}", "count the (hit, miss) pairs the classifier orders correctly.")
    return "equals minikv.audit.stats.roc_auc on every dataset; ties count one half"
