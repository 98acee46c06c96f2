"""Selective sharing, both sides in one run: what each cache policy saves, and what it leaks.

    python -m minikv.bench --only sharing [--model smollm2-135m-instruct]

Three parts, one concept each:

* ``workload.py`` -- what is run: the policies compared (UNSAFE ``shared``, ``tenant`` with and
  without ``shared_prefixes``, the selective strategies) and the fixed requests (the Zipf
  workload :data:`ZIPF`, the leak side's victims);
* ``cost.py`` -- what each policy saves: hit rates on the 2-question table of ``--only isolation``
  and on the Zipf workload, from the engine's cache decisions without its forward pass
  (:func:`admit_only`);
* ``leak.py`` -- what each policy leaks: the count oracle (with k-1 Sybil accounts under
  ``k_tenants``), the TTFT oracle, the timing audit and prime-and-probe, the course's own attacks.

This file runs them together (:func:`bench_sharing`) and prints the report (:func:`format_sharing`).
Every name the course, the tests and ``minikv.bench`` import from ``minikv.bench.sharing`` is
re-exported here.
"""
from __future__ import annotations

from ..base import hit_rate_vs_tenants
from .cost import CollectBetweenForks, DecisionsOnly, admit_only, bench_zipf
from .leak import MAX_PROBES, SybilOracle, bench_leaks, count_oracle, timing_audit, ttft_oracle
from .workload import MONITOR, POOL_BLOCKS, SELECTIVE, ZIPF, policies, secrets, zipf_workload

__all__ = ["CollectBetweenForks", "DecisionsOnly", "admit_only", "bench_zipf", "MAX_PROBES", "SybilOracle",
           "bench_leaks", "count_oracle", "timing_audit", "ttft_oracle", "MONITOR", "POOL_BLOCKS", "SELECTIVE",
           "ZIPF", "policies", "secrets", "zipf_workload", "GOAL", "bench_sharing", "format_sharing"]

GOAL = "Zipf: selective recovers >= 70% of the tenant->shared gap; 0 tokens with < k-1 accounts"


def bench_sharing(llm, tiny=None) -> dict:
    """Everything above.  ``llm``: the bench's model (the 2-question table); ``tiny``: tiny-random."""
    from ...llm import LLM

    tiny = tiny if tiny is not None else LLM("tiny-random", device=str(llm.engine.device))
    return {"hit_rate": hit_rate_vs_tenants(llm, extra_policies=SELECTIVE, measure=CollectBetweenForks()),
            "zipf": bench_zipf(tiny), "leaks": bench_leaks(tiny), "zipf_workload": ZIPF,
            "zipf_pool_blocks": POOL_BLOCKS}


def format_sharing(rep: dict) -> list[str]:
    lines = ["  selective sharing -- cost (quota: the engine default, max_cached_blocks_per_tenant=None):"]
    lines.append("    hit rate, N tenants sharing one system prompt, 2 questions each:")
    for label, by_n in rep["hit_rate"].items():
        lines.append(f"      {label:<36} " + "  ".join(f"N={n}: {r:5.1%}" for n, r in by_n.items()))
    lines.append(f"    Zipf workload {rep['zipf_workload']}, pool {rep['zipf_pool_blocks']} blocks, tiny-random:")
    for label, r in rep["zipf"].items():
        flags = f"  flags {r['flags']}" if r["flags"] is not None else ""
        lines.append(f"      {label:<36} hit {r['hit_rate']:6.1%}  saved {r['saved_tokens']:7,d} of "
                     f"{r['prompt_tokens']:,} prompt tokens  gap recovered {r['gap_recovered']:6.1%}  "
                     f"quota {r['quota']}{flags}  ({r['seconds']:.1f} s)")
    lines.append("  selective sharing -- leak (tiny-random; attacks of lessons 04, 09, 10):")
    for label, row in rep["leaks"].items():
        lines.append(f"    {label}:")
        for name, r in row.items():
            if name == "ttft":
                lines.append(f"      TTFT oracle: repeats needed {r['repeats_needed']} ({r['rounds']} rounds, "
                             f"{r['candidates']} candidates)")
            elif name == "timing_audit":
                lines.append(f"      timing audit: p={r['p']:.3g} AUC={r['auc']:.3f} detected={r['detected']} "
                             f"(median {r['median_hit_ms']:.2f} ms vs {r['median_miss_ms']:.2f} ms, n={r['n']}/arm)")
            elif name == "prime_and_probe":
                lines.append(f"      prime-and-probe: attacker's cached tokens {r[0]} (no victim) vs {r[6]} (6 victim requests)")
            else:
                flags = f", flags {r['flags']}" if r["flags"] is not None else ""
                lines.append(f"      count oracle [{name}]: {r['recovered']}/{r['of']} secret tokens recovered, "
                             f"{r['probes']} probes = {r['requests']} requests, {r['accounts']} account(s){flags}")
    lines.append(f"  goal: {GOAL}")
    return lines
