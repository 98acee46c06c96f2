"""``make bench-peers``: minikv against vLLM's offline ``LLM``, same workload, same checkpoint.

    .venv/bin/python scripts/bench_peers.py [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
                                            [--requests 16] [--max-tokens 64] [--json PATH]

The workload is ``python -m minikv.bench``'s throughput workload (16 seeded random prompts of
32-512 token ids, 64 new tokens each, greedy, ``ignore_eos``) and its TTFT workload (a 1,000-token
system prompt; a prefix hit vs a miss, one output token), run on the converted checkpoint minikv
itself loads (``minikv.models.hub``), in each dtype, with prefix caching on for both engines.

The two engines live in two environments (vLLM pins its own transformers): this script runs
minikv in ``.venv`` and re-runs *itself* under ``.venv-vllm/bin/python`` (made by ``make vllm``)
as the vLLM worker, passing the prompts through a JSON file, so both sides see the same token
ids.  vLLM's offline ``LLM`` starts worker processes, hence the ``__main__`` guard below.

TTFT is measured the same way on both sides: the wall time of one request with ``max_tokens=1``
(median of 3).  Throughput: generated tokens over wall time (median of 2, after a warm-up), each run
from an empty prefix cache (both engines' ``reset_prefix_cache``), so every prompt is prefilled.
Every ratio is printed beside both absolutes; the figures are the machine's at that moment, so
run it on a quiet machine (the load average is printed).  vLLM's CPU build needs AVX512-BF16 for
bf16; where it cannot run a dtype, that dtype's line says why and the exit status is 1.
Knob: ``MINIKV_VLLM_KV_GIB`` (vLLM's KV cache in GiB, default 2, as ``scripts/vllm_server.py``).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"


def _median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(generate, reset, work: dict) -> dict:
    """``generate(prompts, max_tokens) -> generated token count``: throughput and TTFT figures.
    ``reset()`` empties the engine's prefix cache: each timed throughput run prefills every prompt
    (a repeat of the same prompts would otherwise be served from the cache, on both sides)."""
    prompts, max_tokens = work["prompts"], work["max_tokens"]
    generate(prompts[:2], 4)  # warm-up

    def run():
        reset()
        generate(prompts, max_tokens)

    total = len(prompts) * max_tokens
    seconds = _median_time(run, 2)
    system, questions = work["system"], work["questions"]
    generate([system + questions[0]], 1)  # primes the cache with the system prompt
    hit = _median_time(lambda: generate([system + questions[1]], 1), 3)
    # each miss a system prompt never seen before (ids flipped by a different small mask, still in the
    # vocabulary): one fixed flip would be cached by the first miss and hit by the next ones
    misses = iter([[t ^ (k + 1) for t in system] + q for k, q in enumerate(questions[2:5])])
    miss = _median_time(lambda: generate([next(misses)], 1), 3)
    return {"tokens_per_s": total / seconds, "ttft_hit_ms": 1000 * hit, "ttft_miss_ms": 1000 * miss,
            "ttft_hit_over_miss": hit / miss}


def vllm_worker(model: str, dtype: str, work_path: str, out_path: str) -> None:
    """Runs under .venv-vllm: vLLM's offline engine on the workload in ``work_path``."""
    from vllm import LLM, SamplingParams

    work = json.loads(Path(work_path).read_text())
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=True, seed=0, max_model_len=2048)

    def generate(prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    Path(out_path).write_text(json.dumps(measure(generate, llm.reset_prefix_cache, work)))


def minikv_side(model_name: str, dtype: str, work: dict) -> dict:
    sys.path.insert(0, str(ROOT))
    from minikv import LLM, SamplingParams

    llm = LLM(model_name, device="cpu", dtype=dtype, enable_prefix_caching=True)

    def generate(prompts, max_tokens):
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return {**measure(generate, llm.engine.reset_prefix_cache, work), "backend": llm.engine.attention_backend}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--vllm-worker", nargs=4, metavar=("MODEL", "DTYPE", "WORK", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return 0
    if not VLLM_PY.exists():
        print("no .venv-vllm: run `make vllm` first (vLLM's CPU build in its own environment)")
        return 2
    sys.path.insert(0, str(ROOT))
    import torch

    from minikv.bench_engine import format_machine, machine_info, random_prompts
    from minikv.models.hub import resolve_model

    path = str(resolve_model(args.model))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    work = {"prompts": random_prompts(vocab, args.requests, 32, 512, 0), "max_tokens": args.max_tokens,
            "system": random_prompts(vocab, 1, 1000, 1000, 0)[0], "questions": random_prompts(vocab, 8, 20, 20, 1)}
    print(f"bench-peers: {args.model} ({path}), {args.requests} requests x {args.max_tokens} tokens; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print(format_machine(machine_info(torch.device("cpu"))), flush=True)
    results, failed = {}, False
    with tempfile.TemporaryDirectory() as tmp:
        work_path = Path(tmp) / "work.json"
        work_path.write_text(json.dumps(work))
        for dtype in args.dtypes.split(","):
            mk = minikv_side(args.model, dtype, work)
            out = Path(tmp) / f"vllm-{dtype}.json"
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("MINIKV_VLLM_KV_GIB", "2"),
                       VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
            p = subprocess.run([str(VLLM_PY), __file__, "--vllm-worker", path, dtype, str(work_path), str(out)],
                               cwd=tmp, capture_output=True, text=True, env=env)
            if p.returncode != 0 or not out.exists():
                why = [ln for ln in (p.stderr + p.stdout).splitlines() if "Error" in ln or "error" in ln]
                print(f"  {dtype:<9} vLLM failed (exit {p.returncode}): " + (" | ".join(why[-4:]) or p.stderr[-1500:]))
                failed = True
                continue
            vl = json.loads(out.read_text())
            results[dtype] = {"minikv": mk, "vllm": vl, "throughput_ratio": mk["tokens_per_s"] / vl["tokens_per_s"]}
            print(f"  {dtype:<9} throughput minikv[{mk['backend']}] {mk['tokens_per_s']:8.1f} tok/s   vLLM "
                  f"{vl['tokens_per_s']:8.1f} tok/s   minikv/vLLM {results[dtype]['throughput_ratio']:.2f} (target >= 1.0)")
            print(f"  {dtype:<9} TTFT hit/miss minikv {mk['ttft_hit_ms']:.1f}/{mk['ttft_miss_ms']:.1f} ms = "
                  f"{mk['ttft_hit_over_miss']:.3f}   vLLM {vl['ttft_hit_ms']:.1f}/{vl['ttft_miss_ms']:.1f} ms = "
                  f"{vl['ttft_hit_over_miss']:.3f}", flush=True)
    print(f"  load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":  # vLLM's offline LLM spawns worker processes that re-import this file
    raise SystemExit(main())
