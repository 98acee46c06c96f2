"""The ``isolation`` section: what minikv's isolation measures cost on this machine.

* keyed hashing: the time to hash every block of a 1,008-token prompt, per algorithm, as a
  fraction of that prompt's prefill (the hash runs on every admission, the prefill on a miss);
* scrubbing: the engine's own scrub time (``stats["scrub_s"]``) as a fraction of end-to-end time
  on the throughput workload, per policy, on a resident pool (a server that has been up a while)
  and on a fresh one, where the first writer of each page also pays its page fault;
* hit rate: N tenants sharing one system prompt, with and without ``shared_prefixes``
  (:func:`minikv.bench.base.hit_rate_vs_tenants`): what tenant keying gives up, and wins back.
"""
from __future__ import annotations

import statistics
import time

from ..engine import SamplingParams
from ..llm import LLM
from .base import completed, hit_rate_vs_tenants, random_prompts, resident

TARGETS = {"hash_over_prefill": "<= 0.01", "scrub_over_e2e": "<= 0.02"}


def bench_isolation(llm: LLM, tenants=(1, 4, 16, 64), seed=0) -> dict:
    from ..security.hashing import make_hasher

    eng = resident(llm).engine  # the prefill that hashing is measured against pays no page faults
    vocab = eng.model.shape.vocab_size
    prompt = random_prompts(vocab, 1, 1008, 1008, seed)[0]
    bs = eng.block_size
    blocks = [tuple(prompt[i:i + bs]) for i in range(0, len(prompt), bs)]
    out = {}
    # Prefill time of this prompt (no cache) vs the time to hash all its blocks, per algorithm.
    p1 = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([prompt[:64]], p1)
    prefill = statistics.median(completed(llm.generate([prompt], p1))[0].metrics.ttft_s for _ in range(3))
    key = b"t" * 32
    for algo in ("sha256", "hmac-sha256", "blake2b-keyed"):
        h = make_hasher(algo, b"s" * 32)
        t0 = time.perf_counter()
        for _ in range(20):
            parent = None
            for blk in blocks:
                parent = h(parent, blk, (), key)
        out[f"hash_over_prefill[{algo}]"] = (time.perf_counter() - t0) / 20 / prefill
    out["hash_over_prefill"] = max(v for k, v in out.items() if k.startswith("hash_over_prefill["))
    # Scrub time vs end-to-end time on the throughput workload (scrub calls timed by the engine),
    # on a pool whose pages are all resident (a server that has been up a while: the target's
    # figure) and on a fresh pool, where the first write of each page pays its page fault and the
    # on_alloc scrub, the first writer of a fresh block, pays them (host_memory.populate).
    prompts = random_prompts(vocab, 16, 32, 512, seed)
    for policy in ("on_alloc", "on_free"):
        out[f"scrub_over_e2e[{policy}]"] = _scrub_share(llm.fork(scrub=policy), prompts, prefault=True)
        out[f"scrub_over_e2e_fresh_pool[{policy}]"] = _scrub_share(llm.fork(scrub=policy), prompts, prefault=False)
    out["scrub_over_e2e"] = max(v for k, v in out.items() if k.startswith("scrub_over_e2e["))  # resident pool
    out["hit_rate"] = hit_rate_vs_tenants(llm, tenants, seed)
    return out


def _scrub_share(sllm: LLM, prompts, prefault: bool) -> float:
    """The engine's scrub time over end-to-end time of the workload, run twice (the second run
    reuses freed blocks)."""
    if prefault:
        resident(sllm)
    sllm.generate(prompts[:2], SamplingParams(max_tokens=2, temperature=0.0))
    sllm.engine.stats["scrub_s"] = 0.0
    t0 = time.perf_counter()
    for _ in range(2):
        sllm.generate(prompts, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    return sllm.engine.stats["scrub_s"] / (time.perf_counter() - t0)


def format_isolation(report: dict) -> list[str]:
    """The section's report lines: each fraction beside its target, then the hit-rate table."""
    lines = []
    for k, v in report.items():
        if isinstance(v, float):
            target = TARGETS.get(k, "")
            lines.append(f"  {k:<36} {v:10.4f}   {('target ' + target) if target else ''}")
    lines.append("  hit rate, N tenants sharing one system prompt:")
    for label, by_n in report["hit_rate"].items():
        lines.append(f"    {label:<26} " + "  ".join(f"N={n}: {r:5.1%}" for n, r in by_n.items()))
    return lines
