# GENERATED from solutions/ex5_timing_stats.py by `python -m minikv.grading.make_exercises`.
# This file is yours: replace every `raise NotImplementedError` with your implementation,
# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the
# reference solution uses.  Course maintainers: edit solutions/ex5_timing_stats.py and regenerate; never
# edit this file by hand.
# minikv-stub: 48b3629b016e2e4c
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
    raise NotImplementedError("ks_test: not implemented yet (read the docstring, then write your code here)")


def roc_auc(hit, miss) -> float:
    """AUC of "smaller latency => hit" = P(hit < miss) + 0.5 * P(hit == miss) over all pairs.

    Stuck?  ``make hint EX=5b`` (three levels, one per call).
    """
    raise NotImplementedError("roc_auc: not implemented yet (read the docstring, then write your code here)")
