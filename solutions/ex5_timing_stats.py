"""Exercise 5 (lesson 07): the statistics of a timing audit.

From outside, a cache hit shows up as a faster response.  Given latencies of requests that
*would* hit a shared cache ("hit" arm) and of requests that certainly miss ("miss" arm), a
timing audit (Gu et al., "Auditing Prompt Caching in Language Model APIs", ICML 2025) asks two
questions:

* 5a ``ks_test`` -- are hit times significantly *smaller*?  A **one-sided** two-sample
  Kolmogorov-Smirnov test: non-parametric (latencies are heavy-tailed and multi-modal), and
  one-sided because only faster "hits" are evidence of caching; Gu et al. reject at
  alpha = 1e-8;
* 5b ``roc_auc`` -- how usable is the side channel?  The area under the ROC curve of the
  classifier "smaller latency => hit": 0.5 is useless, 1.0 separates every hit from every miss.

You may use numpy and scipy.  The grader compares your results with the engine's reference,
``minikv.audit.stats``, on the same inputs (and on Gu et al.'s released measurements when
``minikv.audit.gu`` can find them).
"""
from __future__ import annotations

import numpy as np
from scipy import stats


def ks_test(hit, miss) -> tuple[float, float]:
    """One-sided two-sample KS test of "hit times tend to be smaller than miss times".

    Returns ``(statistic, pvalue)`` where ``statistic = max_t (F_hit(t) - F_miss(t))`` (the
    empirical CDFs): 1.0 when every hit is faster than every miss, 0.0 when no hit is ever ahead.

    Contract:

    * compute the **statistic yourself** from the two empirical CDFs (numpy; no ``ks_2samp`` for
      it) -- it is the number the test is about, and its direction is the whole point;
    * the p-value may come from scipy (``ks_2samp`` with the matching alternative) or from the
      asymptotic formula: an exact and an asymptotic p-value are both accepted, a two-sided one
      is not (slower "hits" must never look like evidence of a cache);
    * ``ValueError`` for an empty sample or a non-finite latency, naming which;
    * return plain floats.

    Stuck?  ``make hint EX=5a`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    h, m = np.sort(np.asarray(hit, dtype=float)), np.sort(np.asarray(miss, dtype=float))
    for name, x in (("hit", h), ("miss", m)):
        if x.size == 0:
            raise ValueError(f"the {name} sample is empty")
        if not np.all(np.isfinite(x)):
            raise ValueError(f"the {name} sample holds a non-finite latency: {x[~np.isfinite(x)][0]!r}")
    grid = np.concatenate([h, m])  # the ECDFs only change at sample values: evaluate them there
    f_hit = np.searchsorted(h, grid, side="right") / h.size
    f_miss = np.searchsorted(m, grid, side="right") / m.size
    statistic = max(0.0, float(np.max(f_hit - f_miss)))  # one-sided: only hits AHEAD of misses count
    # "greater": the CDF of x (hits) lies above that of y (misses), i.e. hits tend to be smaller.
    pvalue = float(stats.ks_2samp(h, m, alternative="greater").pvalue)
    return statistic, pvalue
    # END SOLUTION


def roc_auc(hit, miss) -> float:
    """AUC of "smaller latency => hit" = P(hit < miss) + 0.5 * P(hit == miss) over all pairs.

    Stuck?  ``make hint EX=5b`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    h = np.asarray(hit, dtype=float)[:, None]
    m = np.asarray(miss, dtype=float)[None, :]
    return float(((h < m).sum() + 0.5 * (h == m).sum()) / (h.size * m.size))
    # END SOLUTION
