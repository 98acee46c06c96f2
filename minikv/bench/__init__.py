"""Benchmarks: minikv against transformers, side by side, in one process.

    python -m minikv.bench [--device cpu|cuda] [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
                           [--only throughput,ttft,prefill,ops,isolation]
    python -m minikv.bench --only fairness   # a victim's latency under each attacker mode, direct and via the gateway (minutes)
    python -m minikv.bench --only trail      # audit-trail bytes per request at each audit level
    python -m minikv.bench --only sharing    # selective sharing: hit rates and attacks per policy
    python -m minikv.bench --only tiers      # KV tiers (host, Redis): hit rates, TTFT per tier, sealing cost

Machines are shared and noisy, so every speed figure is a *ratio* of two measurements taken in the
same run, on the same prompts, with the same thread count, after a warm-up -- and printed beside
the absolute figures it divides, so that a ratio moved by load or versions shows as such
(:mod:`minikv.bench.speed` says why a ratio alone cannot be audited).  Every engine timed has its
KV pool made resident first (:func:`minikv.bench.base.resident`: the steady state of a server that
has been up a while, with no first-touch page faults in any figure).

One module per section; :mod:`~minikv.bench.cli` parses the flags, runs the sections asked for and
prints the report:

* ``throughput`` and ``ops`` (:mod:`~minikv.bench.speed`): generated tokens/s of minikv, of its
  reference backend and of one padded transformers batch, per dtype; aten ops dispatched per
  decode step, per backend;
* ``ttft`` (:mod:`~minikv.bench.ttft`): a prefix-cache hit against a miss on a shared 1,000-token
  system prompt; ``make gpu-check``'s scan over prompt lengths is :mod:`~minikv.bench.ttft_scan`;
* ``prefill`` (:mod:`~minikv.bench.prefill`): useful prefill FLOP/s against the matmul peak
  measured here;
* ``isolation`` (:mod:`~minikv.bench.isolation`): what keyed hashing and scrubbing cost, and the
  hit rate N tenants lose when they no longer share;
* ``fairness`` (not in the default set: minutes): a victim's request latency alone and under each
  attacker mode, directly and through the gateway (:mod:`~minikv.bench.availability`), and its gap
  between streamed tokens while another tenant floods the server with requests it refuses (mode
  ``rejected``, :mod:`~minikv.bench.fairness`);
* ``trail`` (:mod:`~minikv.bench.trail`): bytes of audit trail per request at each audit level;
* ``sharing`` (:mod:`~minikv.bench.sharing`): what each selective-sharing policy saves and leaks;
* ``tiers`` (:mod:`~minikv.bench.tiers`): KV tiers below the pool, hit rates, TTFT and sealing.

Every section stands on :mod:`~minikv.bench.base` (seeded prompts, resident pools, the clock) and
never on another section's internals.  docs/BENCHMARKS.md records the runs and their figures.
"""
from __future__ import annotations

from .._lazy import lazy_exports

__getattr__ = lazy_exports(__name__, {"main": "cli", "format_report": "cli", "SECTIONS": "cli"}, globals())
