"""``make bench-peers``: minikv against vLLM's offline ``LLM``, same workload, same checkpoint.

    .venv/bin/python scripts/bench_peers.py [--model smollm2-135m-instruct] [--dtypes float32,bfloat16]
                                            [--requests 16] [--max-tokens 64] [--rounds 3] [--json PATH]

The workload is ``python -m minikv.bench``'s throughput workload (16 seeded random prompts of
32-512 token ids, 64 new tokens each, greedy, ``ignore_eos``) and its TTFT workload (a 1,000-token
system prompt; a prefix hit vs a miss, one output token), run on the converted checkpoint minikv
itself loads (``minikv.models.hub``), in each dtype, with prefix caching on for both engines.

The two engines live in two environments (vLLM pins its own transformers): this script runs
minikv in ``.venv`` and starts *itself* under ``.venv-vllm/bin/python`` (made by ``make vllm``)
as a long-lived vLLM worker that takes one command per line on stdin and answers one JSON line
on stdout; the prompts travel in a JSON file, so both sides see the same token ids.  vLLM's
offline ``LLM`` starts worker processes, hence the ``__main__`` guard below.

**The engines alternate**: both are built and warmed up first, then each of ``--rounds`` rounds
runs minikv's round and vLLM's round back to back, and every figure is the median over rounds.
A round is one throughput run from an empty prefix cache (both engines' ``reset_prefix_cache``:
every prompt is prefilled), the system prompt primed again, one prefix hit and one miss (a system
prompt never seen before).  So a slow minute of this shared machine lands on both sides instead
of on whichever engine ran in it: earlier versions timed all of minikv, then all of vLLM, and
vLLM's own bf16 figure moved between 80 and 125 tokens/s from one run to the next.  Every ratio
is printed beside both absolutes and the per-round figures; run it on a quiet machine (the load
average is printed).  vLLM's CPU build needs AVX512-BF16 for bf16; where it cannot run a dtype,
that dtype's line says why and the exit status is 1.
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


class Side:
    """One engine's rounds.  ``generate(prompts, max_tokens) -> generated token count``;
    ``reset()`` empties its prefix cache."""

    def __init__(self, generate, reset, work: dict):
        self.generate, self.reset, self.work = generate, reset, work
        generate(work["prompts"][:2], 4)  # warm-up

    def round(self, r: int) -> dict:
        """Round ``r``: seconds of one throughput run, one prefix hit and one miss."""
        w = self.work
        self.reset()
        throughput_s = _timed(lambda: self.generate(w["prompts"], w["max_tokens"]))
        system, questions = w["system"], w["questions"]
        self.generate([system + questions[0]], 1)  # primes the cache with the system prompt
        hit_s = _timed(lambda: self.generate([system + questions[1 + r]], 1))
        # a system prompt never seen before (ids flipped by a per-round mask, still in the
        # vocabulary: random_prompts keeps 1,000 ids clear of both ends)
        miss_s = _timed(lambda: self.generate([[t ^ (r + 1) for t in system] + questions[-1 - r]], 1))
        return {"throughput_s": throughput_s, "hit_s": hit_s, "miss_s": miss_s}


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summarize(rounds: list[dict], work: dict) -> dict:
    """Medians over rounds, in the units the report prints, and the rounds themselves."""
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    total = len(work["prompts"]) * work["max_tokens"]
    return {"tokens_per_s": total / med["throughput_s"], "ttft_hit_ms": 1000 * med["hit_s"],
            "ttft_miss_ms": 1000 * med["miss_s"], "ttft_hit_over_miss": med["hit_s"] / med["miss_s"],
            "rounds_tokens_per_s": [total / r["throughput_s"] for r in rounds]}


def vllm_worker(model: str, dtype: str, work_path: str) -> None:
    """Runs under .venv-vllm: vLLM's offline engine, one round per ``round R`` line on stdin,
    one JSON line per answer on stdout (``ready`` first).  vLLM and its worker processes print to
    stdout too, so the answers keep the original stdout and everything else is sent to stderr."""
    answers = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    from vllm import LLM, SamplingParams

    work = json.loads(Path(work_path).read_text())
    llm = LLM(model=model, dtype=dtype, enable_prefix_caching=True, seed=0, max_model_len=2048)

    def generate(prompts, max_tokens):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    side = Side(generate, llm.reset_prefix_cache, work)
    print(json.dumps({"ready": True}), file=answers, flush=True)
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd != "round":
            break
        print(json.dumps(side.round(int(arg))), file=answers, flush=True)


class VLLMWorker:
    """The vLLM side from minikv's process: a child under .venv-vllm's python, spoken to by line."""

    def __init__(self, model_path: str, dtype: str, work_path: Path, log_path: Path):
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("MINIKV_VLLM_KV_GIB", "2"),
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen([str(VLLM_PY), __file__, "--vllm-worker", model_path, dtype, str(work_path)],
                                     cwd=work_path.parent, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env)
        self._answer()  # {"ready": true} once vLLM is built and warmed up

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(timeout=60)
            self.log.flush()
            log = self.log_path.read_text()
            why = [ln for ln in log.splitlines() if "Error" in ln or "error" in ln]
            raise RuntimeError(f"vLLM worker exited ({self.proc.returncode}): " + (" | ".join(why[-4:]) or log[-1500:]))
        return json.loads(line)

    def round(self, r: int) -> dict:
        self.proc.stdin.write(f"round {r}\n")
        self.proc.stdin.flush()
        return self._answer()

    def close(self) -> None:
        """Ends the worker by its own process id (and the processes vLLM started, with it)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("quit\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def minikv_side(model_name: str, dtype: str, work: dict) -> tuple[Side, str]:
    sys.path.insert(0, str(ROOT))
    from minikv import LLM, SamplingParams

    llm = LLM(model_name, device="cpu", dtype=dtype, enable_prefix_caching=True)

    def generate(prompts, max_tokens):
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return Side(generate, llm.engine.reset_prefix_cache, work), llm.engine.attention_backend


def compare(model: str, model_path: str, dtype: str, work: dict, work_path: Path, rounds: int) -> dict:
    """Both engines in ``dtype``, rounds alternating minikv then vLLM."""
    mk_side, backend = minikv_side(model, dtype, work)
    worker = VLLMWorker(model_path, dtype, work_path, work_path.parent / f"vllm-{dtype}.log")
    mk_rounds, vl_rounds = [], []
    try:
        for r in range(rounds):
            mk_rounds.append(mk_side.round(r))
            vl_rounds.append(worker.round(r))
    finally:
        worker.close()
    mk, vl = summarize(mk_rounds, work), summarize(vl_rounds, work)
    mk["backend"] = backend
    return {"minikv": mk, "vllm": vl, "throughput_ratio": mk["tokens_per_s"] / vl["tokens_per_s"], "rounds": rounds}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds per dtype (medians are reported)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--vllm-worker", nargs=3, metavar=("MODEL", "DTYPE", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.vllm_worker:
        vllm_worker(*args.vllm_worker)
        return 0
    if not VLLM_PY.exists():
        print("no .venv-vllm: run `make vllm` first (vLLM's CPU build in its own environment)")
        return 2
    sys.path.insert(0, str(ROOT))
    import torch

    from minikv.bench.base import random_prompts
    from minikv.bench.speed import format_machine, machine_info
    from minikv.models.hub import resolve_model

    path = str(resolve_model(args.model))
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(path).vocab_size
    work = {"prompts": random_prompts(vocab, args.requests, 32, 512, 0), "max_tokens": args.max_tokens,
            "system": random_prompts(vocab, 1, 1000, 1000, 0)[0], "questions": random_prompts(vocab, 2 * args.rounds + 2, 20, 20, 1)}
    print(f"bench-peers: {args.model} ({path}), {args.requests} requests x {args.max_tokens} tokens; "
          f"load average {os.getloadavg()[0]:.2f}", flush=True)
    print(format_machine(machine_info(torch.device("cpu"))), flush=True)
    results, failed = {}, False
    with tempfile.TemporaryDirectory() as tmp:
        work_path = Path(tmp) / "work.json"
        work_path.write_text(json.dumps(work))
        for dtype in args.dtypes.split(","):
            try:
                res = compare(args.model, path, dtype, work, work_path, args.rounds)
            except RuntimeError as e:
                print(f"  {dtype:<9} vLLM failed: {e}")
                failed = True
                continue
            results[dtype] = res
            mk, vl = res["minikv"], res["vllm"]
            per_round = "   rounds: " + ", ".join(f"{a:.1f} vs {b:.1f}" for a, b in zip(mk["rounds_tokens_per_s"], vl["rounds_tokens_per_s"]))
            print(f"  {dtype:<9} throughput minikv[{mk['backend']}] {mk['tokens_per_s']:8.1f} tok/s   vLLM "
                  f"{vl['tokens_per_s']:8.1f} tok/s   minikv/vLLM {res['throughput_ratio']:.2f} (target >= 1.0; "
                  f"median of {args.rounds} alternating rounds)" + per_round)
            print(f"  {dtype:<9} TTFT hit/miss minikv {mk['ttft_hit_ms']:.1f}/{mk['ttft_miss_ms']:.1f} ms = "
                  f"{mk['ttft_hit_over_miss']:.3f}   vLLM {vl['ttft_hit_ms']:.1f}/{vl['ttft_miss_ms']:.1f} ms = "
                  f"{vl['ttft_hit_over_miss']:.3f}", flush=True)
    print(f"  load average at the end {os.getloadavg()[0]:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 1 if failed else 0


if __name__ == "__main__":  # vLLM's offline LLM spawns worker processes that re-import this file
    raise SystemExit(main())
