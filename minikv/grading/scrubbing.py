"""Graders for exercise 3: zeroing blocks, and a scrubber in the engine's block lifecycle.

``check_zero_blocks`` calls the learner's function on a pool-like object filled with random
numbers and checks every element: the given blocks are zero in every layer, K and V, and not
one other element changed.  ``check_scrubber`` does the same through the ``Scrubber`` hooks on a
real ``KVPool``, then runs it inside a real engine whose pool is too small for the workload, so
blocks are evicted and reused constantly.  A listener that runs right after the engine's own
hook inspects every block the moment it is handed to a new request: it must be all zeros.
Finally the engine's outputs (logits of every step) and cache hits must equal those of an
engine using minikv's own ``scrub="on_alloc"``: a scrubber must never destroy data that a
running request or a cache hit still needs.
"""
from __future__ import annotations

import functools

import torch

from ..engine.kv_pool import KVPool
from ..engine.sampling import SamplingParams
from ._report import CheckFailed, expect, grader, single_thread
from .engines import tiny_llm

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 5, 9, 4, 2, 3
NUM_BLOCKS = 16  # engine pool: two or three requests at a time, so blocks are evicted and reused constantly


class FakePool:
    """Just the tensors of a pool, filled with nonzero random numbers (no ``zero_blocks``), so
    "zeroed" and "untouched" cannot be confused; tests/test_security_scrub.py uses it too."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        shape = (LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM)
        self.k_cache = torch.rand(shape, generator=g) + 0.5
        self.v_cache = torch.rand(shape, generator=g) + 0.5
        self.num_layers, self.num_blocks, self.block_size = LAYERS, BLOCKS, BLOCK_SIZE
        self.num_kv_heads, self.head_dim = HEADS, DIM
        self.dtype, self.device = self.k_cache.dtype, self.k_cache.device


def _random_pool(seed: int = 0) -> KVPool:
    pool = KVPool(LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM, torch.float32, "cpu")
    g = torch.Generator().manual_seed(seed)
    pool.k_cache.copy_(torch.rand(pool.k_cache.shape, generator=g) + 0.5)
    pool.v_cache.copy_(torch.rand(pool.v_cache.shape, generator=g) + 0.5)
    return pool


def _diff_report(pool, before_k, before_v, ids: list[int], call: str, must_zero: bool = True) -> None:
    """Fail with a precise message unless exactly ``ids`` are zero (when ``must_zero``) and
    every other block is unchanged."""
    layers = pool.k_cache.shape[0]
    if must_zero:
        for b in ids:
            dirty = {name: [layer for layer in range(layers) if cache[layer, b].abs().sum() > 0]
                     for name, cache in (("K", pool.k_cache), ("V", pool.v_cache))}
            if len(dirty["K"]) == len(dirty["V"]) == layers:
                raise CheckFailed(f"after {call}, block {b} was not zeroed at all (K and V intact in every layer)",
                                  "zero every block you are given, right away: the new owner receives it as soon "
                                  "as the call returns (not later, not in a batch, not only the first block).")
            for name, nonzero in dirty.items():
                if nonzero:
                    hint = ("zero both k_cache and v_cache." if len(nonzero) == layers else
                            "the block dimension is dim 1; index [:, ids] so that every layer (dim 0) is zeroed.")
                    raise CheckFailed(f"after {call}, block {b} still holds {name} data in layer(s) {nonzero}", hint)
    for name, now, before in (("K", pool.k_cache, before_k), ("V", pool.v_cache, before_v)):
        for b in range(now.shape[1]):
            if b not in ids:
                changed = [layer for layer in range(now.shape[0]) if not torch.equal(now[layer, b], before[layer, b])]
                if changed:
                    raise CheckFailed(
                        f"after {call}, block {b} (not in the list) changed in {name}, layer(s) {changed}: that "
                        "block may hold another request's live K/V or a cached prefix",
                        "index the block dimension (dim 1) with exactly the given ids; pool.k_cache[ids] = 0 "
                        "indexes dim 0, the layers.")


@grader("idx = torch.as_tensor(ids, dtype=torch.long); pool.k_cache.index_fill_(1, idx, 0); same for v_cache.")
def check_zero_blocks(zero_blocks) -> str:
    """Exercise 3a: exactly the given blocks, every layer, K and V, in place."""
    for seed, ids in enumerate(([3], [1, 4, 7], [8, 0], [], [2, 2])):
        pool = FakePool(seed)
        k, v = pool.k_cache, pool.v_cache
        before_k, before_v = k.clone(), v.clone()
        try:
            zero_blocks(pool, list(ids))
        except AttributeError as exc:
            if "zero_blocks" in str(exc):
                raise CheckFailed("your zero_blocks called pool.zero_blocks, which this pool does not have",
                                  "write the zeroing yourself on pool.k_cache and pool.v_cache.") from None
            raise
        expect(pool.k_cache is k and pool.v_cache is v,
               "zero_blocks replaced pool.k_cache / pool.v_cache with new tensors instead of zeroing them in place",
               "use an in-place operation (index_fill_, or indexed assignment): a copy costs as much memory as "
               "the whole pool, and other code holds the original tensors.")
        _diff_report(pool, before_k, before_v, list(ids), f"zero_blocks(pool, {list(ids)})")
    return "zeroes exactly the given blocks, in every layer, K and V, in place; [] is a no-op"


def _workload(llm) -> tuple[list, list[int]]:
    """Requests of 6 tenants, alone and in batches, with repeats (cache hits) and evictions.

    Returns (per-step logits, cached tokens per request)."""
    eng = llm.engine
    eng.logit_trace = []
    texts = [f"t{i} note {i * 7919 % 1000:03d}: code {i}{i}{i}." for i in range(6)]  # 23 tokens: 6 blocks
    cached = []
    plan = [[0], [0], [1, 2], [3], [4, 5, 1], [2], [3, 0]]  # indexes into texts, one generate() per entry
    for group in plan:
        outs = llm.generate([texts[i] for i in group], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True),
                            tenant=[f"t{i}" for i in group])
        cached += [o.num_cached_tokens for o in outs]
    return eng.logit_trace, cached


@functools.lru_cache(maxsize=1)
def _reference():
    """The workload on minikv's own ``scrub="on_alloc"`` (deterministic, so computed once)."""
    with single_thread():
        return _workload(tiny_llm(enable_prefix_caching=True, num_blocks=NUM_BLOCKS, scrub="on_alloc"))


@single_thread()
def engine_stage(scrubber_cls) -> tuple[list[int], int]:
    """Run ``scrubber_cls()`` inside an engine that reuses blocks all the time; raise
    :class:`CheckFailed` if a new request ever receives a dirty block or any output differs from
    minikv's ``scrub="on_alloc"``.  Returns (cached tokens per request, engine steps)."""
    llm = tiny_llm(enable_prefix_caching=True, num_blocks=NUM_BLOCKS, scrubber=scrubber_cls())
    eng = llm.engine
    dirty: list[str] = []

    def on_event(event, ids, seq):  # runs right after the engine's scrub hook
        if event == "allocate":
            idx = torch.tensor(ids)
            for name, cache in (("K", eng.pool.k_cache), ("V", eng.pool.v_cache)):
                for bid, blk in zip(ids, cache[:, idx].transpose(0, 1)):
                    if blk.abs().sum() > 0:
                        layers = [i for i in range(blk.shape[0]) if blk[i].abs().sum() > 0]
                        dirty.append(f"block {bid} ({name}, layers {layers}) to request of tenant {seq.tenant!r}")

    eng.block_manager.listeners.append(on_event)
    trace, cached = _workload(llm)
    expect(not dirty, f"the engine handed {len(dirty)} block(s) still holding old data to new requests, e.g. "
           f"{dirty[0] if dirty else ''}",
           "zero every block passed to on_alloc, all layers, K and V, right away (not later, not only the first "
           "one): the new owner gets it at once.")
    ref_trace, ref_cached = _reference()
    expect(cached == ref_cached, f"cached tokens per request {cached} differ from the reference {ref_cached}",
           "never zero a block that is still cached or in use.")
    same = len(trace) == len(ref_trace) and all(
        a.keys() == b.keys() and all(torch.allclose(a[r], b[r], atol=1e-5) for r in a) for a, b in zip(trace, ref_trace))
    expect(same, "the model's outputs differ from an engine with minikv's scrub='on_alloc': your scrubber destroyed "
           "K/V that a running request (or a cache hit) still needed",
           "scrub only the blocks you are given, and only before their new owner writes them.")
    return cached, eng.stats["steps"]


@grader("scrub in on_alloc (before the new owner writes), exactly the blocks you are given; never later.")
def check_scrubber(scrubber_cls) -> str:
    """Exercise 3b: on a real pool, then inside an engine that reuses blocks all the time."""
    scrubber = scrubber_cls()
    expect(callable(getattr(scrubber, "on_free", None)) and callable(getattr(scrubber, "on_alloc", None)),
           "the scrubber needs on_free(pool, ids) and on_alloc(pool, ids) methods")
    pool = _random_pool()
    before_k, before_v = pool.k_cache.clone(), pool.v_cache.clone()
    scrubber.on_alloc(pool, [2, 5])
    _diff_report(pool, before_k, before_v, [2, 5], "on_alloc(pool, [2, 5])")
    pool = _random_pool(1)
    before_k, before_v = pool.k_cache.clone(), pool.v_cache.clone()
    scrubber.on_free(pool, [1, 3])
    _diff_report(pool, before_k, before_v, [1, 3], "on_free(pool, [1, 3])", must_zero=False)

    cached, steps = engine_stage(scrubber_cls)
    return (f"zeroes exactly the given blocks; in the engine {len(cached)} requests over {steps} steps never "
            "got stale data, and outputs equal the reference")
