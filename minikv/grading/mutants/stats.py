"""Wrong answers to exercise 5: statistics that test the wrong direction or miscount ties.

A timing side channel says "cache hits are FASTER"; the test must be one-sided in that
direction, and the AUC must read "smaller latency => hit" with ties worth one half (latencies
are quantised, so ties are common).  These mutants give plausible numbers with the wrong meaning.
"""
from __future__ import annotations

import numpy as np
from scipy import stats

from ._table import entries


def _validated(hit, miss):
    """The contract's input checks (every correct ks_test has them, so the negative controls do too)."""
    for name, x in (("hit", hit), ("miss", miss)):
        x = np.asarray(x, float)
        if x.size == 0 or not np.all(np.isfinite(x)):
            raise ValueError(f"the {name} sample is empty or holds a non-finite latency")
    return np.asarray(hit, float), np.asarray(miss, float)


def ks_unvalidated(hit, miss):
    """The right one-sided statistic and p-value, but no input checks: a NaN latency gives a number, and an
    empty sample fails deep inside numpy with a message that names neither sample."""
    h, m = np.sort(np.asarray(hit, float)), np.sort(np.asarray(miss, float))
    grid = np.concatenate([h, m])
    d = max(0.0, float(np.max(np.searchsorted(h, grid, side="right") / h.size
                              - np.searchsorted(m, grid, side="right") / m.size)))
    return d, float(stats.ks_2samp(h, m, alternative="greater").pvalue)


def ks_wrong_alternative(hit, miss):
    """alternative='less': tests 'hits are SLOWER'."""
    r = stats.ks_2samp(np.asarray(hit, float), np.asarray(miss, float), alternative="less")
    return float(r.statistic), float(r.pvalue)


def ks_two_sided(hit, miss):
    """Two-sided: also 'detects' a cache when hits are slower, and halves the evidence."""
    r = stats.ks_2samp(np.asarray(hit, float), np.asarray(miss, float))
    return float(r.statistic), float(r.pvalue)


def ks_miss_grid(hit, miss):
    """Hand-written statistic with both ECDFs evaluated at the MISS times only: the gap peaks just after
    a hit, between miss times, so the statistic comes out too small."""
    h, m = np.sort(np.asarray(hit, float)), np.sort(np.asarray(miss, float))
    grid = m
    d = float(np.max(np.searchsorted(h, grid, side="right") / h.size - np.searchsorted(m, grid, side="right") / m.size))
    return max(0.0, d), float(stats.ks_2samp(h, m, alternative="greater").pvalue)


def ks_asymptotic(hit, miss):
    """NEGATIVE CONTROL (correct): the asymptotic p-value instead of the exact one -- a different method,
    the same meaning; the grader must ACCEPT it."""
    r = stats.ks_2samp(*_validated(hit, miss), alternative="greater", method="asymp")
    return float(r.statistic), float(r.pvalue)


def ks_textbook(hit, miss):
    """NEGATIVE CONTROL (correct): one-sided statistic by hand, p = exp(-2 nm/(n+m) D^2), the textbook
    asymptotic formula; the grader must ACCEPT it."""
    h, m = map(np.sort, _validated(hit, miss))
    grid = np.concatenate([h, m])
    d = max(0.0, float(np.max(np.searchsorted(h, grid, side="right") / h.size
                              - np.searchsorted(m, grid, side="right") / m.size)))
    return d, float(min(1.0, np.exp(-2.0 * h.size * m.size / (h.size + m.size) * d * d)))


def auc_paired(hit, miss):
    """Compares hit i with miss i only (zip), not every (hit, miss) pair: a noisy, truncated estimate."""
    pairs = list(zip(hit, miss))
    return float(sum((h < m) + 0.5 * (h == m) for h, m in pairs) / len(pairs))


def auc_flipped(hit, miss):
    """P(hit > miss): the classifier 'larger latency => hit'."""
    h, m = np.asarray(hit, float)[:, None], np.asarray(miss, float)[None, :]
    return float(((h > m).sum() + 0.5 * (h == m).sum()) / (h.size * m.size))


def auc_ignores_ties(hit, miss):
    """Strict comparison only: ties count 0 instead of one half."""
    h, m = np.asarray(hit, float)[:, None], np.asarray(miss, float)[None, :]
    return float((h < m).sum() / (h.size * m.size))


MUTANTS = {
    "5a": entries(("wrong-alternative", ks_wrong_alternative), ("two-sided", ks_two_sided),
                  ("miss-grid", ks_miss_grid), ("unvalidated", ks_unvalidated)),
    "5b": entries(("flipped", auc_flipped), ("ignores-ties", auc_ignores_ties), ("paired", auc_paired)),
}

#: correct implementations that differ only in method: the graders must ACCEPT them
NEGATIVE_CONTROLS = {"5a": entries(("asymptotic-p", ks_asymptotic), ("textbook-p", ks_textbook))}

DIAGNOSES = {
    ("5a", "wrong-alternative"): "wrong alternative", ("5a", "two-sided"): "two-sided test",
    ("5a", "miss-grid"): "one-sided KS statistic is", ("5a", "unvalidated"): "input not validated",
    ("5b", "flipped"): "flipped orientation", ("5b", "ignores-ties"): "ties not counted one half",
    ("5b", "paired"): "not every (hit, miss) pair",
}
