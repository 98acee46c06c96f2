"""Wrong answers to exercise 5: statistics that test the wrong direction or miscount ties.

A timing side channel says "cache hits are FASTER"; the test must be one-sided in that
direction, and the AUC must read "smaller latency => hit" with ties worth one half (latencies
are quantised, so ties are common).  These mutants give plausible numbers with the wrong meaning.
"""
from __future__ import annotations

import numpy as np
from scipy import stats

from ._table import entries


def ks_wrong_alternative(hit, miss):
    """alternative='less': tests 'hits are SLOWER'."""
    r = stats.ks_2samp(np.asarray(hit, float), np.asarray(miss, float), alternative="less")
    return float(r.statistic), float(r.pvalue)


def ks_two_sided(hit, miss):
    """Two-sided: also 'detects' a cache when hits are slower, and halves the evidence."""
    r = stats.ks_2samp(np.asarray(hit, float), np.asarray(miss, float))
    return float(r.statistic), float(r.pvalue)


def auc_flipped(hit, miss):
    """P(hit > miss): the classifier 'larger latency => hit'."""
    h, m = np.asarray(hit, float)[:, None], np.asarray(miss, float)[None, :]
    return float(((h > m).sum() + 0.5 * (h == m).sum()) / (h.size * m.size))


def auc_ignores_ties(hit, miss):
    """Strict comparison only: ties count 0 instead of one half."""
    h, m = np.asarray(hit, float)[:, None], np.asarray(miss, float)[None, :]
    return float((h < m).sum() / (h.size * m.size))


MUTANTS = {
    "5a": entries(("wrong-alternative", ks_wrong_alternative), ("two-sided", ks_two_sided)),
    "5b": entries(("flipped", auc_flipped), ("ignores-ties", auc_ignores_ties)),
}
