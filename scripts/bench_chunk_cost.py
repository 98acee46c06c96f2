"""What chunked prefill costs a tenant alone: one long prompt's time to first token at several step budgets.

    .venv/bin/python scripts/bench_chunk_cost.py [--tokens 1000] [--repeats 7] [--budgets 4096,512,32]

Each round sends one fresh random prompt of ``--tokens`` tokens (``max_tokens`` 1, prefix caching
off) to one engine per budget, forks of one model, in an order reversed every other round so that a
slow minute lands on every budget; it prints each budget's quartiles and the ratio of its median to
the first budget's, with the load average.  docs/BENCHMARKS.md (availability) quotes it.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import time

from minikv import LLM, SamplingParams


def first_token_s(engine, ids: list[int]) -> float:
    rid, t0 = engine.new_request_id(), time.perf_counter()
    engine.add_request(rid, ids, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), tenant="a")
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--budgets", default="4096,512,32")
    args = ap.parse_args()
    budgets = [int(b) for b in args.budgets.split(",")]
    base = LLM(args.model, enable_prefix_caching=False, max_num_batched_tokens=budgets[0]).engine
    engines = [(b, base if i == 0 else base.fork(max_num_batched_tokens=b)) for i, b in enumerate(budgets)]
    rng, times = random.Random(0), {b: [] for b in budgets}
    vocab = base.model.shape.vocab_size
    print(f"load before: {os.getloadavg()[0]:.2f}")
    for r in range(args.repeats):
        ids = [rng.randrange(100, vocab) for _ in range(args.tokens)]
        for b, eng in (engines if r % 2 == 0 else engines[::-1]):
            times[b].append(first_token_s(eng, ids))
    ref = statistics.median(times[budgets[0]])
    for b in budgets:
        q = statistics.quantiles(times[b], n=4)
        print(f"budget {b:>5}: quartiles {q[0]:.2f} / {q[1]:.2f} / {q[2]:.2f} s, "
              f"median / budget {budgets[0]}'s: {statistics.median(times[b]) / ref:.2f}")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
