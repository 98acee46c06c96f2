"""How many bytes of audit trail one request costs, at each level (for ``python -m minikv.bench``).

An operator sizes retention from this number: at 100 requests/s, 1 KB/request is 8.6 GB a day
before compression.  The workload is fixed so the figure is comparable between runs and
commits: ``num_requests`` requests from ``num_tenants`` tenants, each request a tenant's
64-token system prompt plus a question of 8-120 random tokens, 4 output tokens, prefix caching
on, tenant isolation, a 128-block pool (so some requests evict cached blocks, as on a busy
server).  Bytes are counted in the uncompressed JSONL, i.e. what the live file grows by.
"""
from __future__ import annotations

import random
import tempfile
from pathlib import Path

from .trail import LEVELS

SYSTEM_TOKENS, QUESTION_TOKENS, OUTPUT_TOKENS, POOL_BLOCKS, BATCH = 64, (8, 120), 4, 128, 16


def trail_bytes_per_request(weights=None, *, levels=LEVELS, num_requests: int = 200, num_tenants: int = 4,
                            seed: int = 0) -> dict[str, float]:
    """``{level: trail bytes per request}`` on the fixed workload above.

    ``weights``: an ``LLM`` or ``LLMEngine`` whose loaded model is reused (each level runs on a
    fork of it, with block size 16); None loads ``tiny-random``.  Model and device do not change
    the byte count, only the time it takes."""
    from ..engine.sampling import SamplingParams
    from ..llm import LLM

    if weights is None:
        weights = LLM("tiny-random", device="cpu")
    engine = getattr(weights, "engine", weights)
    rng = random.Random(seed)
    vocab = engine.model.shape.vocab_size
    toks = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    systems = [toks(SYSTEM_TOKENS) for _ in range(num_tenants)]
    workload = []
    for _ in range(num_requests):
        t = rng.randrange(num_tenants)
        workload.append((f"tenant-{t}", systems[t] + toks(rng.randint(*QUESTION_TOKENS))))
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    out = {}
    with tempfile.TemporaryDirectory(prefix="minikv-trail-size-") as tmp:
        for level in levels:
            path = Path(tmp) / f"{level}.jsonl"
            eng = engine.fork(enable_prefix_caching=True, cache_isolation="tenant", block_size=16,
                              num_blocks=POOL_BLOCKS, audit_log=str(path), audit_level=level)
            for start in range(0, num_requests, BATCH):  # a few requests in flight, as when serving
                for tenant, prompt in workload[start:start + BATCH]:
                    eng.add_request(eng.new_request_id(), prompt, params, tenant=tenant)
                while eng.has_unfinished_requests():
                    eng.step()
            eng.audit.close()
            out[level] = path.stat().st_size / num_requests
    return out


if __name__ == "__main__":
    for lvl, size in trail_bytes_per_request().items():
        print(f"{lvl:>8}: {size:,.0f} bytes/request")
