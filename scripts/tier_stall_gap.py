#!/usr/bin/env python3
"""What a stalled Redis tier costs *another* tenant: bob's token gaps while alice's fresh prompts use the tier.

    python scripts/tier_stall_gap.py [--model smollm2-135m-instruct] [--port 6453] [--deadline-ms 100]

Starts a private Redis on loopback ``--port`` (scripts/redis_server.py), builds one engine with
``kv_tiers=["redis://127.0.0.1:PORT/0?deadline_ms=D"]``, and steps it while bob decodes one long
stream (no tier use of his own after admission) and alice sends a fresh prompt every few steps
(each one a tier lookup that misses, and a store of every full block).  Two phases, side by side:
Redis running, then Redis SIGSTOPped (it accepts connections and answers nothing, so a call waits
for its socket timeout).  Printed: bob's gap between tokens, p50 and max, per phase, and the
stopped phase's max over the running one's, beside the tier's deadline.  Redis is continued and
stopped by its PID at the end, whatever happens.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def phase(llm, steps: int, alice_every: int, seed: int) -> list[float]:
    """Bob's token gaps (s) over ``steps`` engine steps, alice's fresh prompts arriving meanwhile."""
    from minikv import SamplingParams
    eng = llm.engine
    vocab = eng.model.shape.vocab_size
    bob = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    eng.add_request(f"bob-{seed}", [(40 + j) % vocab for j in range(16)], bob, tenant="bob")
    eng.step()  # bob admitted; from here on every step gives him one token
    last, gaps = time.perf_counter(), []
    for i in range(steps):
        if i % alice_every == 0:
            prompt = [(seed * 7919 + i * 131 + j * 17) % vocab for j in range(64)]  # fresh: a miss, then a store
            eng.add_request(f"alice-{seed}-{i}", prompt, SamplingParams(max_tokens=1, temperature=0.0), tenant="alice")
        outs = eng.step()
        if any(o.request_id == f"bob-{seed}" for o in outs):
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
    eng.abort_request(f"bob-{seed}")
    while eng.has_unfinished_requests():
        eng.step()
    return gaps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--port", type=int, default=6453)
    ap.add_argument("--deadline-ms", type=float, default=100.0)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--alice-every", type=int, default=4)
    args = ap.parse_args()
    script = ROOT / "scripts" / "redis_server.py"
    run = subprocess.run([sys.executable, str(script), "start", "--port", str(args.port)], capture_output=True, text=True)
    if run.returncode:
        print(run.stdout + run.stderr, file=sys.stderr)
        return 1
    sys.path.insert(0, str(ROOT / "scripts"))
    import redis_server
    pid = json.loads(redis_server.files(args.port)[0].read_text())["pid"]
    try:
        from minikv import LLM
        url = f"redis://127.0.0.1:{args.port}/0?deadline_ms={args.deadline_ms:g}"
        llm = LLM(args.model, enable_prefix_caching=True, kv_tiers=[url], engine_secret=os.urandom(32))
        phase(llm, 8, args.alice_every, seed=0)  # warm-up: every shape seen once
        running = phase(llm, args.steps, args.alice_every, seed=1)
        os.kill(pid, signal.SIGSTOP)
        try:
            stopped = phase(llm, args.steps, args.alice_every, seed=2)
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        subprocess.run([sys.executable, str(script), "stop", "--port", str(args.port)], capture_output=True)
    ms = lambda v: 1000 * v  # noqa: E731
    for name, g in (("redis running", running), ("redis SIGSTOPped", stopped)):
        print(f"{name:17s} bob's token gap: p50 {ms(statistics.median(g)):7.1f} ms   max {ms(max(g)):7.1f} ms   ({len(g)} gaps)")
    extra = ms(max(stopped) - max(running))
    print(f"stalled max - running max: {extra:.1f} ms (tier deadline {args.deadline_ms:g} ms); "
          f"max ratio {max(stopped) / max(running):.2f}; within deadline: {extra <= args.deadline_ms}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
