"""The cost side: what each policy saves, from the engine's cache decisions alone.

Hit rate = cached / prompt tokens; saved = prompt tokens not prefilled.  Two tables:

* the hit-rate table of ``--only isolation`` (N tenants sharing one system prompt, 2 questions
  each; :func:`minikv.bench.base.hit_rate_vs_tenants`, on ``--model``: hit rates depend on the
  tokenizer), with the selective rows added;
* the Zipf workload (:func:`bench_zipf`; the workload itself is in ``workload.py``).

Both run the engine's cache decisions without its forward pass (:func:`admit_only`): a hit rate
depends on the block manager alone.  :class:`DecisionsOnly` serves the same replay to the leak
side's count oracle, which reads nothing but the cached-token count.
"""
from __future__ import annotations

import gc
import time
from types import SimpleNamespace

from ...attacks.prefix_oracle import PROBE_PARAMS
from .workload import POOL_BLOCKS, fork_caching, policies, zipf_workload


def admit_only(llm, prompt, tenant) -> tuple[int, int]:
    """One request's cache decisions, without its forward pass: ``(cached tokens, prompt tokens)``.

    The engine's own admission (isolation domain, strategy), then what ``step`` does to the block
    manager for a one-token request: allocate (lookup and hits), commit the prefilled blocks (store,
    promotions), free, finish (the monitor's record).  Only the model is skipped, and with it the
    K/V: hit rates depend on bookkeeping alone, and 1,024 prefills per row would make the bench
    too slow to run twice.  ``tests/test_selective.py`` checks it against ``generate``."""
    eng = llm.engine
    ids, text = eng.encode_prompt(prompt)
    seq = eng._new_sequence(eng.new_request_id(), ids, text, PROBE_PARAMS, tenant)
    if not eng.block_manager.allocate(seq):
        raise RuntimeError(f"a {len(ids)}-token prompt does not fit the pool of {eng.num_blocks} blocks")
    cached = seq.num_computed_tokens
    seq.num_computed_tokens = seq.num_tokens
    eng.block_manager.commit(seq)
    eng.block_manager.free(seq)
    if eng.sharing is not None:
        eng.sharing.finish(seq)
    return cached, len(ids)


class CollectBetweenForks:
    """``admit_only`` for :func:`minikv.bench.base.hit_rate_vs_tenants`, which forks one engine per row:
    an engine and its block manager's listeners form a reference cycle, and without the model's
    allocations between requests the cyclic GC rarely runs, so the forks' KV pools (1 GiB each for
    SmolLM2 by default) would pile up.  Collect whenever a new engine shows up."""

    def __init__(self):
        self.engine = None

    def __call__(self, llm, prompt, tenant):
        if llm.engine is not self.engine:
            self.engine = llm.engine
            gc.collect()
        return admit_only(llm, prompt, tenant)


class DecisionsOnly:
    """``llm`` seen through :func:`admit_only`: ``generate`` answers ``num_cached_tokens`` -- all the
    count oracle reads -- without running the model, so an extraction costs bookkeeping only."""

    def __init__(self, llm):
        self.llm, self.engine = llm, llm.engine

    def generate(self, prompts, params=None, tenant=None):
        return [SimpleNamespace(num_cached_tokens=admit_only(self.llm, p, tenant)[0]) for p in prompts]


def bench_zipf(tiny) -> dict:
    """Hit rate and prefill tokens saved on the Zipf workload, one fresh pool per policy."""
    systems, reqs = zipf_workload(tiny.engine.model.shape.vocab_size)
    rows = {}
    for label, kw in policies(systems):
        llm = fork_caching(tiny, num_blocks=POOL_BLOCKS, **kw)
        cached = total = 0
        t0 = time.perf_counter()
        for tenant, prompt in reqs:
            c, n = admit_only(llm, prompt, tenant)
            cached, total = cached + c, total + n
        s = llm.engine.sharing
        rows[label] = dict(hit_rate=cached / total, saved_tokens=cached, prompt_tokens=total,
                           quota=llm.engine.block_manager.max_cached_per_tenant,
                           flags=getattr(s, "num_flags", None), seconds=time.perf_counter() - t0)
    gap = rows["shared (unsafe)"]["hit_rate"] - rows["tenant"]["hit_rate"]
    for r in rows.values():
        r["gap_recovered"] = (r["hit_rate"] - rows["tenant"]["hit_rate"]) / gap if gap > 0 else float("nan")
    return rows
