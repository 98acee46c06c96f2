"""Where a prefix hit's time to first token goes, against a miss's: one command, two profilers.

    .venv/bin/python scripts/profile_ttft.py [--device cuda] [--model PATH] [--dtype float32]

``python -m minikv.bench`` measures TTFT (a 1,000-token system prompt, then a 20-token question:
the *hit* finds the system prompt's blocks cached, the *miss* finds nothing) and counts the ops
each dispatches.  On an H200 the hit came out *slower* than the miss (17.1 against 14.1 ms, a
random model of SmolLM2's shapes in fp32; docs/BENCHMARKS.md), though it dispatched fewer ops.  Counting says
"how many"; this script says "where": for one more hit and one more miss it prints

1. the TTFT of each, timed without a profiler;
2. Python's ``cProfile``, by time spent in each function itself: host work (scheduling, hashing,
   the plan, each op's dispatch), which is what a launch-bound step is made of;
3. ``torch.profiler``'s operator table by host time and, on CUDA, by device time.

With no ``--model`` it builds the random SmolLM2-shaped model ``make gpu-check`` uses (no network,
no checkpoint), so it runs on an offline GPU box; on a 2-core CPU it takes about a minute.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _by_own_time(prof: cProfile.Profile, rows: int) -> list[str]:
    """The ``rows`` functions with the most time in themselves, in milliseconds to 3 decimals
    (pstats prints seconds to 3 decimals, which rounds a GPU request's functions to 0.000)."""
    stats = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    top = sorted(stats.items(), key=lambda kv: -kv[1][2])[:rows]
    lines = ["   own ms    cum ms   calls  function"]
    for (file, line, name), (_, calls, own, cum, _) in top:
        where = f"{Path(file).name}:{line}({name})" if file != "~" else name
        lines.append(f"{own * 1e3:9.3f} {cum * 1e3:9.3f} {calls:7d}  {where}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", help="cpu, cuda, cuda:N (default: cuda when there is one)")
    ap.add_argument("--model", help="a checkpoint directory or minikv model name (default: random SmolLM2 shapes)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--system-tokens", type=int, default=1000)
    ap.add_argument("--rows", type=int, default=22, help="rows of each cProfile listing")
    args = ap.parse_args(argv)
    if args.system_tokens < 16:
        ap.error(f"--system-tokens must be at least 16 (one block), got {args.system_tokens}")
    import torch

    sys.path.insert(0, str(ROOT))
    from minikv import LLM, SamplingParams
    from minikv.bench.base import random_prompts, sync

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(args.device)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            sys.path.insert(0, str(ROOT / "scripts"))
            from gpu_check import build_random_smollm2

            model = str(build_random_smollm2(Path(tmp) / "random-smollm2-shape"))
        llm = LLM(model, device=args.device, dtype=args.dtype, enable_prefix_caching=True)
        vocab = llm.engine.model.shape.vocab_size
        system = random_prompts(vocab, 1, args.system_tokens, args.system_tokens, 0)[0]
        fresh = [t ^ 1 for t in system]  # as long, never cached
        questions = iter(random_prompts(vocab, 16, 20, 20, 1))
        one = SamplingParams(max_tokens=1, temperature=0.0)

        def request(side: str, check: bool = True):
            """One more hit (the system prompt cached) or miss (its own tenant: nothing to find)."""
            q = next(questions)
            prompt, tenant = (system + q, None) if side == "hit" else (fresh + q, f"miss-{q[0]}")
            out = llm.generate([prompt], one, tenant=tenant)[0]
            sync(device)
            want = len(system) // llm.engine.block_size * llm.engine.block_size if side == "hit" else 0
            if out.outputs[0].finish_reason == "error" or (check and out.num_cached_tokens != want):
                raise RuntimeError(f"the {side} was not one: {out.num_cached_tokens} tokens cached "
                                   f"(expected {want}), finish_reason {out.outputs[0].finish_reason!r}")
            return out

        request("hit", check=False)  # the first request caches the system prompt; then both paths warm up
        for _ in range(2):
            request("hit"), request("miss")
        for side in ("hit", "miss"):
            t0 = time.perf_counter()
            out = request(side)
            print(f"== {side}: {out.num_cached_tokens} tokens cached, TTFT {1000 * out.metrics.ttft_s:.2f} ms "
                  f"(request {1000 * (time.perf_counter() - t0):.2f} ms)", flush=True)
        for side in ("hit", "miss"):
            prof = cProfile.Profile()
            prof.runcall(request, side)
            print(f"== cProfile, {side}, by time in the function itself\n" + "\n".join(_by_own_time(prof, args.rows)))
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        for side in ("hit", "miss"):
            with profile(activities=activities) as prof:
                request(side)
            table = prof.key_averages()
            print(f"== torch.profiler, {side}, by host time\n"
                  + table.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=44))
            if device.type == "cuda":
                print(f"== torch.profiler, {side}, by device time\n"
                      + table.table(sort_by="self_device_time_total", row_limit=10, max_name_column_width=44))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
