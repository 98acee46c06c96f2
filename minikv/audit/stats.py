"""Reference statistics for prompt-cache timing audits.

A timing audit collects two samples of response times: requests that *should* hit a shared cache
if one exists ("hit" candidates) and requests that certainly miss ("miss").  The question "is the
cache shared?" becomes the statistical question "are hit times stochastically smaller than miss
times?".  We follow Gu et al., "Auditing Prompt Caching in Language Model APIs" (ICML 2025):

* the test is the **one-sided two-sample Kolmogorov-Smirnov test**.  It is non-parametric, so it
  makes no assumption about the (heavy-tailed, multi-modal) shape of API latencies, and one-sided
  because only *faster* hits are evidence of caching; a slower "hit" arm is noise, not a finding.
* the significance level is **alpha = 1e-8**.  The paper audits many providers and configurations;
  a tiny alpha keeps the chance of falsely accusing any one of them negligible even before any
  multiple-testing correction, and with hundreds of samples real caches clear it by many orders of
  magnitude.
* the **ROC AUC** of the classifier "smaller time => hit" reports the effect size: how well a
  single request's latency reveals a hit.  A p-value alone says "different", AUC says "how usable
  the side channel is" (0.5 = useless, 1.0 = every hit is faster than every miss).

Every function validates its inputs: a NaN latency would silently poison both statistics.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Iterable

import numpy as np
from scipy import stats as _st

#: Significance level used by Gu et al. (and by every verdict in minikv unless told otherwise).
GU_ALPHA = 1e-8


def _as_samples(values: Iterable[float], name: str) -> np.ndarray:
    """Return ``values`` as a 1-D float array, or raise ValueError naming the problem."""
    try:
        arr = np.asarray(list(values) if not isinstance(values, np.ndarray) else values, dtype=float)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} samples must be numbers: {exc}") from None
    if arr.ndim != 1:
        raise ValueError(f"{name} samples must be a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} samples are empty: need at least one timing per arm")
    bad = ~np.isfinite(arr)
    if bad.any():
        raise ValueError(
            f"{name} samples contain {int(bad.sum())} non-finite value(s) (NaN/inf), "
            f"first at index {int(np.flatnonzero(bad)[0])}"
        )
    return arr


def _check_alpha(alpha: float) -> float:
    alpha = float(alpha)
    if not (0.0 < alpha < 1.0):
        raise ValueError(f"alpha must be in (0, 1), got {alpha}")
    return alpha


def ks_test(hit: Iterable[float], miss: Iterable[float]) -> tuple[float, float]:
    """One-sided two-sample KS test of "hits are faster than misses"; returns (statistic, pvalue).

    scipy's convention is easy to get backwards.  ``ks_2samp(x, y, alternative="greater")`` has the
    alternative hypothesis "the CDF of x lies *above* the CDF of y" somewhere.  A CDF that rises
    earlier belongs to the sample with *smaller* values, so with ``x = hit`` the alternative reads
    "hit times tend to be smaller", exactly the cache-hit signature.  The statistic is
    ``max(F_hit(t) - F_miss(t))``: 1.0 when every hit is faster than every miss, 0.0 when no hit
    is ever "ahead".  ``tests/test_audit_stats.py`` pins this orientation with synthetic data.
    """
    h = _as_samples(hit, "hit")
    m = _as_samples(miss, "miss")
    res = _st.ks_2samp(h, m, alternative="greater")
    return float(res.statistic), float(res.pvalue)


def roc_auc(hit: Iterable[float], miss: Iterable[float]) -> float:
    """AUC of the classifier "smaller latency => hit" = P(hit < miss) + 0.5 * P(hit == miss).

    The Mann-Whitney U statistic of ``mannwhitneyu(x, y)`` counts the pairs with ``x > y`` (ties
    count one half).  With ``x = miss, y = hit`` that is the number of (hit, miss) pairs in which
    the hit is faster, so dividing by ``n_hit * n_miss`` gives the AUC directly: this is the
    classic identity between the U statistic and the area under the ROC curve.
    """
    h = _as_samples(hit, "hit")
    m = _as_samples(miss, "miss")
    u = _st.mannwhitneyu(m, h, alternative="two-sided").statistic
    return float(u) / (h.size * m.size)


@dataclass(frozen=True)
class AuditResult:
    """Outcome of one hit-vs-miss comparison (one audit configuration)."""

    n_hit: int
    n_miss: int
    ks_stat: float
    p_value: float
    auc: float
    alpha: float
    detected: bool  # p_value < alpha: hits are significantly faster
    median_hit: float
    median_miss: float

    @property
    def medians(self) -> tuple[float, float]:
        """(median hit time, median miss time)."""
        return self.median_hit, self.median_miss

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """One line, e.g. ``DETECTED p=3.1e-12 AUC=0.97 (n=25/25, median 5.1 ms vs 24.9 ms)``."""
        word = "DETECTED" if self.detected else "not detected"
        return (
            f"{word} p={self.p_value:.3g} AUC={self.auc:.3f} (n={self.n_hit}/{self.n_miss}, "
            f"median {self.median_hit * 1e3:.1f} ms vs {self.median_miss * 1e3:.1f} ms)"
        )


def audit_samples(hit: Iterable[float], miss: Iterable[float], alpha: float = GU_ALPHA) -> AuditResult:
    """Run the full reference analysis on two latency samples (seconds, or any common unit)."""
    alpha = _check_alpha(alpha)
    h = _as_samples(hit, "hit")
    m = _as_samples(miss, "miss")
    stat, p = ks_test(h, m)
    return AuditResult(
        n_hit=int(h.size),
        n_miss=int(m.size),
        ks_stat=stat,
        p_value=p,
        auc=roc_auc(h, m),
        alpha=alpha,
        detected=bool(p < alpha),
        median_hit=float(np.median(h)),
        median_miss=float(np.median(m)),
    )


def perfect_separation_pvalue(n: int) -> float:
    """Exact one-sided KS p-value when n hits are all faster than n misses.

    Under the null hypothesis every interleaving of the 2n pooled, sorted times is equally likely;
    there are C(2n, n) of them and exactly one ("all hits first") reaches the maximal statistic
    D = 1.  So the p-value is 1 / C(2n, n): the best any audit with n samples per arm can do.
    """
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 1.0 / math.comb(2 * n, n)


def min_samples_for(alpha: float = GU_ALPHA) -> int:
    """Smallest n per arm for which perfect separation can reach p < alpha.

    This is a floor, not a recommendation: real latencies overlap, so an audit needs several
    times more.  For alpha = 1e-8 the answer is 15 (1/C(30,15) = 6.4e-9, while
    1/C(28,14) = 2.5e-8); Gu et al. used 250 per arm.  Fewer than this and the audit cannot
    detect anything, whatever the server does, so the CLI warns about it.
    """
    alpha = _check_alpha(alpha)
    n = 1
    while perfect_separation_pvalue(n) >= alpha:
        n += 1
    return n
