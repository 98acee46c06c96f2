"""``python -m minikv.bench``: the flags, the sections asked for, one report.

The sections (:mod:`minikv.bench` lists them) run one after another in this process, on engines
built from ``--model``; between two sections the last one's engines are released
(:func:`minikv.bench.base.release`), so that one section's memory never weighs on the next's
figures.  The report prints every ratio beside the absolutes it divides; ``--json`` keeps them.
The sections that take minutes or need a server (fairness, sharing, tiers) are imported only
when asked for.
"""
from __future__ import annotations

import argparse
import json

import torch

from ..llm import LLM
from . import isolation, prefill, speed, trail, ttft
from .base import release

SECTIONS = {"throughput", "ttft", "prefill", "ops", "isolation", "fairness", "trail", "sharing", "tiers"}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minikv.bench", 
                                 description="Benchmarks: minikv against transformers, side by side, in one process.")
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="dtypes of the throughput and prefill sections (comma-separated)")
    ap.add_argument("--requests", type=int, default=16, help="requests of the throughput and prefill workloads")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens per request of the throughput workload")
    ap.add_argument("--only", default="throughput,ttft,prefill,ops,isolation",
                    help="comma-separated sections: " + ", ".join(sorted(SECTIONS)))
    ap.add_argument("--fairness-rounds", type=int, default=1, help="repeat the rejected-requests sweep (gaps pooled)")
    ap.add_argument("--fairness-modes", default="all",
                    help="comma-separated attacker modes of the fairness section: rejected (refused bodies vs a "
                         "victim's token gaps), " + ", ".join(_availability_modes()) + "; or all")
    ap.add_argument("--fairness-seconds", type=float, default=20.0,
                    help="how long the victim sends requests, alone and under each attacker mode")
    ap.add_argument("--fairness-scale", type=float, default=1.0,
                    help="multiply each attacker mode's connection count (max_tokens_1: 64, hangups: 32, others 16)")
    ap.add_argument("--fairness-budget", type=int, default=None,
                    help="the server's step token budget while tenants compete (default: minikv serve's)")
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
              "threads": torch.get_num_threads(), "machine": speed.machine_info(device),
              "kv_pools": "resident"}  # every timed engine's, before its clock starts (base.resident)
    if "throughput" in sections:
        report["throughput_by_dtype"] = speed.bench_throughput(args.model, args.device, dtypes, args.requests, args.max_tokens, **engine)
        release()
    if "ttft" in sections:
        report["ttft"] = ttft.bench_ttft(args.model, args.device, args.dtype, **engine)
        release()
    if "prefill" in sections:
        report["prefill_by_dtype"] = prefill.bench_prefill(args.model, args.device, dtypes, args.requests, **engine)
        release()
    if "ops" in sections:
        report["ops"] = speed.decode_ops(llm)
        release()
    if "isolation" in sections:
        report["isolation"] = isolation.bench_isolation(llm)
        release()
    if "fairness" in sections:
        modes = _availability_modes() + ("rejected",) if args.fairness_modes == "all" else \
            tuple(args.fairness_modes.split(","))
        if set(modes) - set(_availability_modes() + ("rejected",)):
            ap.error(f"--fairness-modes: unknown mode(s) {', '.join(sorted(set(modes) - set(_availability_modes())))}")
        if not (args.fairness_seconds > 0 and args.fairness_scale > 0):
            ap.error("--fairness-seconds and --fairness-scale must be > 0")
        from ..serve.cli import serve_step_budget
        from .availability import bench_availability
        alone, contended = serve_step_budget(args.device)
        contended = args.fairness_budget or contended
        attacks = tuple(m for m in modes if m != "rejected")
        if attacks:
            served = llm.fork(max_num_batched_tokens=max(alone, contended), contended_num_batched_tokens=contended)
            report["availability"] = bench_availability(served, attacks, args.fairness_seconds, scale=args.fairness_scale)
            del served
        if "rejected" in modes:
            from .fairness import bench_fairness
            report["fairness"] = bench_fairness(llm, rounds=args.fairness_rounds)
        release()
    if "trail" in sections:
        report["trail"] = trail.bench_trail()
        release()
    if "sharing" in sections:  # selective sharing: cost and leak per policy (minikv.bench.sharing)
        from .sharing import bench_sharing
        report["sharing"] = bench_sharing(llm)
        release()
    if "tiers" in sections:  # KV tiers below the pool (minikv.bench.tiers; Redis rows need `make redis`)
        from .tiers import bench_tiers
        report["tiers"] = bench_tiers(llm)
        release()
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    return 0


def _availability_modes() -> tuple[str, ...]:
    from .availability import MODES
    return MODES


def format_report(report: dict) -> str:
    lines = [f"minikv benchmark: {report['model']} on {report['device']} ({report['dtype']}, "
             f"{report['threads']} threads) -- every ratio beside its absolutes, all from this run"]
    if "machine" in report:
        lines.append(speed.format_machine(report["machine"]))
    if "kv_pools" in report:
        lines.append(f"  KV pools: {report['kv_pools']} before timing (no first-touch page faults in the figures)")
    lines += speed.format_engine(report)
    if "isolation" in report:
        lines += isolation.format_isolation(report["isolation"])
    if "availability" in report:
        from .availability import format_availability
        lines += format_availability(report["availability"])
    if "fairness" in report:
        from .fairness import format_fairness
        lines += format_fairness(report["fairness"])
    if "sharing" in report:
        from .sharing import format_sharing
        lines += format_sharing(report["sharing"])
    if "tiers" in report:
        from .tiers import format_tiers
        lines += format_tiers(report["tiers"])
    if "trail" in report:
        lines += trail.format_trail(report["trail"])
    return "\n".join(lines)
