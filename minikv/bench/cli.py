"""Benchmarks: minikv against transformers, side by side, in one process.

    python -m minikv.bench [--device cpu|cuda] [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
                           [--only throughput,ttft,prefill,ops,isolation]
    python -m minikv.bench --only fairness   # a tenant's rejected-anyway flood vs another's tokens (minutes)
    python -m minikv.bench --only trail      # audit-trail bytes per request at each audit level
    python -m minikv.bench --only sharing    # selective sharing: hit rates and attacks per policy
    python -m minikv.bench --only tiers      # KV tiers (host, Redis): hit rates, TTFT per tier, sealing cost

Machines are shared and noisy, so every speed figure is a *ratio* of two measurements taken in the
same run, on the same prompts, with the same thread count, after a warm-up -- and printed beside
the absolute figures it divides, so that a ratio moved by load or versions shows as such
(:mod:`minikv.bench_engine` says why the 4.46x of issue 2 cannot be reproduced):

Every engine timed has its KV pool made resident first (``bench_base.resident``: the steady
state of a server that has been up a while, with no first-touch page faults in any figure).

* throughput, per dtype: generated tokens/s of minikv, of its reference backend and of one padded
  transformers batch (sdpa) on 16 requests of seeded random lengths 32-512 tokens,
  ``max_tokens=64`` with ``ignore_eos``; the median of interleaved runs;
* TTFT on a shared 1,000-token system prompt, with a prefix-cache hit vs a miss (milliseconds
  and the ratio of their medians over 5 alternating pairs);
* prefill, per dtype: useful prefill FLOP/s against the FLOP/s ``torch.matmul`` reaches here on
  the model's own matmul shapes, the two alternating over 3 rounds (the median round printed,
  with every round's figures and that round's matmul passes: :mod:`minikv.bench_prefill`);
* ops: aten ops dispatched per decode step at batch 16 (and CUDA kernels on a GPU), per backend;
* isolation costs: keyed hashing time as a fraction of prefill time, scrubbing time as a
  fraction of end-to-end time, and the hit-rate loss when N tenants share a system prompt,
  with and without ``shared_prefixes``;
* fairness (:mod:`minikv.bench_fairness`, not in the default set: about 4 minutes on SmolLM2 with
  2 cores): a victim's gap between streamed tokens, alone and against 1, 4 and 16 connections
  of an abusive tenant, as ratios to the alone figure, with the default limits and the rate
  limit off;
* trail: bytes of audit trail per request at each ``audit_level``
  (:mod:`minikv.audit.trail_size`; tiny-random whatever ``--model`` says: the trail's size
  depends on blocks and requests, not on weights).  An operator keeps a trail on only if it
  can afford the disk.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

from .bench_base import completed, hit_rate_vs_tenants, random_prompts, resident
from .bench_engine import count_ops, decode_ops, format_engine, format_machine, machine_info, op_totals, throughput
from .bench_prefill import prefill_efficiency, weight_pass_s
from .engine import SamplingParams
from .backends.host_memory import give_back_freed_memory
from .llm import LLM
from .models.hub import resolve_model

TARGETS = {"ttft_hit_over_miss": "<= 0.05 (fp32)",
           "hash_over_prefill": "<= 0.01", "scrub_over_e2e": "<= 0.02"}
SECTIONS = {"throughput", "ttft", "prefill", "ops", "isolation", "fairness", "trail", "sharing", "tiers"}


def _release() -> None:
    """Between sections: the last section's engines and models are garbage now, and the heap keeps
    what they freed (host_memory.keep_freed_memory), so hand it back before the next one builds its
    own (the gpu-check dry run's four sections peaked at 8.7 GB resident in one process)."""
    gc.collect()
    give_back_freed_memory()


def bench_throughput(model: str, device, dtypes: list[str], n=16, max_tokens=64, **engine) -> dict:
    """minikv vs transformers' padded ``generate`` in each dtype (:func:`minikv.bench_engine.throughput`):
    tokens/s of minikv, of its reference backend and of transformers, and the ratios."""
    path = resolve_model(model)
    out = {}
    for d in dtypes:   # one dtype's engines and transformers model are gone before the next is built
        out[d] = throughput(LLM(model, device=device, dtype=d, **engine), path, n=n, max_tokens=max_tokens)
        _release()
    return out


def bench_prefill(model: str, device, dtypes: list[str], n=16, **engine) -> dict:
    """Prefill FLOP/s of ``n`` prompts against the matmul peak measured here, per dtype
    (:mod:`minikv.bench_prefill`)."""
    out = {}
    for d in dtypes:
        out[d] = prefill_efficiency(LLM(model, device=device, dtype=d, **engine), n=n)
        _release()
    return out


def bench_ttft(model: str, device, dtype, repeats=5, seed=0, **engine) -> dict:
    # A resident pool (bench_base.resident): on a young one each miss writes never-written blocks
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


def bench_isolation(llm: LLM, tenants=(1, 4, 16, 64), seed=0) -> dict:
    from .security.hashing import make_hasher

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


def bench_trail() -> dict:
    """Audit-trail bytes per request at each ``audit_level``, measured by
    :func:`minikv.audit.trail_size.trail_bytes_per_request` on its fixed workload (tiny-random,
    200 requests from 4 tenants, prefix caching on, a 128-block pool that fills and evicts)."""
    from .audit.trail_size import trail_bytes_per_request

    return {"bytes_per_request": trail_bytes_per_request(), "model": "tiny-random",
            "workload": "minikv.audit.trail_size: 200 requests, 4 tenants, prefix caching on, 128 blocks"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minikv.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="dtypes of the throughput and prefill sections (comma-separated)")
    ap.add_argument("--requests", type=int, default=16, help="requests of the throughput and prefill workloads")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request of the throughput workload")
    ap.add_argument("--only", default="throughput,ttft,prefill,ops,isolation",
                    help="comma-separated sections: " + ", ".join(sorted(SECTIONS)))
    ap.add_argument("--fairness-rounds", type=int, default=1, help="repeat the fairness sweep (gaps pooled)")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0,
                    help="KV pool of every engine the bench builds (GiB; the engine's default 1). Pools are made "
                         "resident before timing, so this is their memory: the CPU dry run of make gpu-check uses 0.25")
    args = ap.parse_args(argv)
    if not args.kv_cache_gb > 0:
        ap.error(f"--kv-cache-gb must be > 0, got {args.kv_cache_gb}")
    engine = {"kv_cache_memory_gb": args.kv_cache_gb}
    for flag, value in (("--requests", args.requests), ("--max-tokens", args.max_tokens)):
        if value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    sections = set(args.only.split(","))
    if sections - SECTIONS:
        ap.error(f"unknown section(s) {', '.join(sorted(sections - SECTIONS))}; choose from {', '.join(sorted(SECTIONS))}")
    llm = LLM(args.model, device=args.device, dtype=args.dtype, **engine)
    dtypes = args.dtypes.split(",")
    device, dtype = llm.engine.device, llm.engine.dtype
    report = {"model": args.model, "device": str(device), "dtype": str(dtype).replace("torch.", ""),
              "threads": torch.get_num_threads(), "machine": machine_info(device),
              "kv_pools": "resident"}  # every timed engine's, before its clock starts (bench_base.resident)
    if "throughput" in sections:
        report["throughput_by_dtype"] = bench_throughput(args.model, args.device, dtypes, args.requests, args.max_tokens, **engine)
        _release()
    if "ttft" in sections:
        report["ttft"] = bench_ttft(args.model, args.device, args.dtype, **engine)
        _release()
    if "prefill" in sections:
        report["prefill_by_dtype"] = bench_prefill(args.model, args.device, dtypes, args.requests, **engine)
        _release()
    if "ops" in sections:
        report["ops"] = decode_ops(llm)
        _release()
    if "isolation" in sections:
        report["isolation"] = bench_isolation(llm)
        _release()
    if "fairness" in sections:
        from .bench_fairness import bench_fairness
        report["fairness"] = bench_fairness(llm, rounds=args.fairness_rounds)
        _release()
    if "trail" in sections:
        report["trail"] = bench_trail()
        _release()
    if "sharing" in sections:  # selective sharing: cost and leak per policy (minikv.bench_sharing)
        from .bench_sharing import bench_sharing
        report["sharing"] = bench_sharing(llm)
        _release()
    if "tiers" in sections:  # KV tiers below the pool (minikv.bench_tiers; Redis rows need `make redis`)
        from .bench_tiers import bench_tiers
        report["tiers"] = bench_tiers(llm)
        _release()
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def format_report(report: dict) -> str:
    lines = [f"minikv benchmark: {report['model']} on {report['device']} ({report['dtype']}, "
             f"{report['threads']} threads) -- every ratio beside its absolutes, all from this run"]
    if "machine" in report:
        lines.append(format_machine(report["machine"]))
    if "kv_pools" in report:
        lines.append(f"  KV pools: {report['kv_pools']} before timing (no first-touch page faults in the figures)")
    lines += format_engine(report)
    flat = {}
    for section in ("isolation",):
        for k, v in report.get(section, {}).items():
            if isinstance(v, float):
                flat[k] = v
    for k, v in flat.items():
        target = TARGETS.get(k, "")
        lines.append(f"  {k:<36} {v:10.4f}   {('target ' + target) if target else ''}")
    if "isolation" in report:
        lines.append("  hit rate, N tenants sharing one system prompt:")
        for label, by_n in report["isolation"]["hit_rate"].items():
            lines.append(f"    {label:<26} " + "  ".join(f"N={n}: {r:5.1%}" for n, r in by_n.items()))
    if "fairness" in report:
        from .bench_fairness import format_fairness
        lines += format_fairness(report["fairness"])
    if "sharing" in report:
        from .bench_sharing import format_sharing
        lines += format_sharing(report["sharing"])
    if "tiers" in report:
        from .bench_tiers import format_tiers
        lines += format_tiers(report["tiers"])
    if "trail" in report:
        lines.append("  audit trail, bytes per request (tiny-random, 200 requests, 4 tenants, prefix caching on):")
        for level, size in report["trail"]["bytes_per_request"].items():
            lines.append(f"    audit_level={level:<8} {size:9,.0f} bytes/request")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
