"""The ``ttft`` section: time to first token of a prefix-cache hit against a miss.

One engine with prefix caching; a 1,000-token system prompt is cached, then hits (the system
prompt plus a fresh 20-token question) alternate with misses (a never-cached prompt of the same
length, each from its own tenant) over ``repeats`` pairs.  Each TTFT is the engine's own
(``RequestOutput.metrics.ttft_s``) and every request is checked to have hit or missed as named.
After the clock, one more hit and one more miss are counted in dispatched ops (the profiler slows
what it watches, so it never runs under the clock).  The hit's floor printed beside it: one row
through every weight (:func:`minikv.bench.prefill.weight_pass_s`), since a hit still reads them all.

:mod:`minikv.bench.ttft_scan` asks the same question over several prompt lengths with a test
of significance (``make gpu-check``).
"""
from __future__ import annotations

import statistics

from ..engine import SamplingParams
from ..llm import LLM
from .base import completed, random_prompts, resident
from .prefill import weight_pass_s
from .speed import count_ops, op_totals


def bench_ttft(model: str, device, dtype, repeats=5, seed=0, **engine) -> dict:
    """TTFT of ``repeats`` hits and misses, their medians and ratio, and each side's op count."""
    # A resident pool (base.resident): on a young one each miss writes never-written blocks
    # and pays their page faults, which a hit (two new blocks) does not, flattering the ratio.
    llm = resident(LLM(model, device=device, dtype=dtype, enable_prefix_caching=True, **engine))
    vocab = llm.engine.model.shape.vocab_size
    system = random_prompts(vocab, 1, 1000, 1000, seed)[0]
    questions = random_prompts(vocab, 2 * repeats + 4, 20, 20, seed + 1)  # hits, misses, 2 warm-ups, 2 for the ops
    p1 = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([system + questions[2 * repeats]], p1)  # warm-up and prime the cache
    # a warm-up hit: on CUDA it captures the hits' prefill graph (prefill_graphs.py) before the clock,
    # as the miss above captured the misses' (same lengths, same buckets)
    llm.generate([system + questions[2 * repeats + 1]], p1)
    hits, misses = [], []
    fresh = [t ^ 1 for t in system]  # same length, never cached
    for i in range(repeats):
        hit = completed(llm.generate([system + questions[i]], p1, tenant=None))[0]
        assert hit.num_cached_tokens >= 992, hit.num_cached_tokens
        hits.append(hit.metrics.ttft_s)
        miss = completed(llm.generate([fresh + questions[repeats + i]], p1, tenant=f"miss-{i}"))[0]
        assert miss.num_cached_tokens == 0
        misses.append(miss.metrics.ttft_s)
    # After the clock: what one more hit and one more miss dispatch (the profiler slows what it watches)
    ops, cached = {}, {}
    for side, prompt, tenant in (("hit", system + questions[-2], None), ("miss", fresh + questions[-1], "miss-ops")):
        def request(prompt=prompt, tenant=tenant, side=side):
            cached[side] = completed(llm.generate([prompt], p1, tenant=tenant))[0].num_cached_tokens
        ops[side] = op_totals(count_ops(request, llm.engine.device))
    assert cached["hit"] >= 992 and cached["miss"] == 0, cached
    return {"ttft_hit_over_miss": statistics.median(hits) / statistics.median(misses), "repeats": repeats,
            "hit_ms": 1000 * statistics.median(hits), "miss_ms": 1000 * statistics.median(misses),
            "system_prompt_tokens": len(system), "weight_pass_ms": 1000 * weight_pass_s(llm.engine.model),
            "hit_ops": ops["hit"], "miss_ops": ops["miss"]}
