"""Reference statistics: sidedness, AUC orientation, validation and the 15-samples floor."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.stats import ks_2samp

from minikv.audit.stats import (GU_ALPHA, audit_samples, ks_test, min_samples_for,
                                perfect_separation_pvalue, roc_auc)


def _samples(seed=0, n=200, hit_ms=5.0, miss_ms=25.0):
    rng = np.random.default_rng(seed)
    return rng.normal(hit_ms, 1.0, n) / 1e3, rng.normal(miss_ms, 3.0, n) / 1e3


def test_ks_one_sided_detects_faster_hits_only():
    hit, miss = _samples()
    stat, p = ks_test(hit, miss)
    assert stat == pytest.approx(1.0) and p < 1e-50
    # Reversed: "hits" slower than misses is not evidence of caching.
    stat_r, p_r = ks_test(miss, hit)
    assert stat_r == pytest.approx(0.0) and p_r == pytest.approx(1.0)


def test_ks_same_distribution_not_significant():
    rng = np.random.default_rng(1)
    x, y = rng.exponential(1.0, 300), rng.exponential(1.0, 300)
    assert ks_test(x, y)[1] > 1e-3


def test_auc_orientation_and_ties():
    assert roc_auc([1, 2, 3], [4, 5, 6]) == 1.0
    assert roc_auc([4, 5, 6], [1, 2, 3]) == 0.0
    assert roc_auc([1, 1], [1, 1]) == 0.5
    # P(hit < miss) + 0.5 P(tie): pairs (1,1) tie, (1,2) win, (3,1) lose, (3,2) lose -> 1.5/4
    assert roc_auc([1, 3], [1, 2]) == pytest.approx(0.375)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=15), st.lists(st.integers(0, 20), min_size=1, max_size=15))
def test_auc_matches_brute_force(hit, miss):
    wins = sum((h < m) + 0.5 * (h == m) for h in hit for m in miss)
    assert roc_auc(hit, miss) == pytest.approx(wins / (len(hit) * len(miss)))


def test_audit_samples_fields_and_verdict():
    hit, miss = _samples()
    r = audit_samples(hit, miss)
    assert r.detected and r.alpha == GU_ALPHA and r.auc == pytest.approx(1.0)
    assert (r.n_hit, r.n_miss) == (200, 200)
    assert r.medians == (pytest.approx(np.median(hit)), pytest.approx(np.median(miss)))
    assert r.p_value == pytest.approx(ks_2samp(hit, miss, alternative="greater").pvalue)
    assert not audit_samples(miss, hit).detected
    assert "DETECTED" in r.summary() and set(r.to_dict()) >= {"p_value", "auc", "detected"}


@pytest.mark.parametrize("hit, miss, word", [
    ([], [1.0], "hit samples are empty"),
    ([1.0], [], "miss samples are empty"),
    ([1.0, float("nan")], [1.0], "non-finite"),
    ([1.0], [float("inf")], "miss samples contain 1 non-finite"),
    ([[1.0, 2.0]], [1.0], "flat"),
    (["a"], [1.0], "must be numbers"),
])
def test_validation_names_the_issue(hit, miss, word):
    with pytest.raises(ValueError, match=word):
        audit_samples(hit, miss)


def test_alpha_validated():
    with pytest.raises(ValueError, match="alpha"):
        audit_samples([1.0], [2.0], alpha=0)


def test_min_samples_for_gu_alpha_is_15():
    """The issue's claim: perfect separation needs >= 15 per arm for p < 1e-8 -- checked with scipy."""
    assert min_samples_for(1e-8) == 15
    for n, below in ((14, False), (15, True)):
        hit, miss = np.arange(n) * 1.0, 100.0 + np.arange(n)
        p = ks_2samp(hit, miss, alternative="greater", method="exact").pvalue
        assert p == pytest.approx(perfect_separation_pvalue(n)) == pytest.approx(1 / math.comb(2 * n, n))
        assert bool(p < 1e-8) is below
        assert audit_samples(hit, miss).detected is below


def test_min_samples_monotone_in_alpha():
    assert min_samples_for(0.05) < min_samples_for(1e-3) < min_samples_for(1e-8) < min_samples_for(1e-12)


def test_package_exports_resolve_lazily():
    import minikv.audit as audit
    from minikv.audit import stats

    assert audit.audit_samples is stats.audit_samples and "detect" in audit.__all__
    with pytest.raises(AttributeError):
        audit.no_such_name  # noqa: B018
