"""Wrong answers to exercise 3: scrubs that miss data, or destroy data that is still in use.

A recycled KV block must reach its new owner with nothing of the previous tenant in it -- in
every layer, in K and in V -- while every block still owned (cached prefixes, running requests)
keeps its contents.  Each mutant errs on one side: too little zeroed, too late, or too much.
"""
from __future__ import annotations

from ._table import entries

# ============================================================================ 3a zero_blocks


def zero_k_only(pool, block_ids):
    """Forgets the values: V keeps the previous owner's data."""
    if block_ids:
        pool.k_cache[:, list(block_ids)] = 0


def zero_layer0_only(pool, block_ids):
    """Only layer 0 ('the one that inverts to tokens'); deeper layers leak too (Shadow in the Cache)."""
    if block_ids:
        pool.k_cache[0, list(block_ids)] = 0
        pool.v_cache[0, list(block_ids)] = 0


def zero_wrong_dim(pool, block_ids):
    """Indexes dim 0 (layers) instead of dim 1 (blocks): wipes whole layers of everyone's K/V."""
    ids = [b for b in block_ids if b < pool.k_cache.shape[0]]
    if ids:
        pool.k_cache[ids] = 0
        pool.v_cache[ids] = 0


def zero_out_of_place(pool, block_ids):
    """Builds a zeroed copy of the whole pool (twice the memory) and rebinds the attributes."""
    import torch
    if block_ids:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        pool.k_cache = pool.k_cache.index_fill(1, idx, 0)
        pool.v_cache = pool.v_cache.index_fill(1, idx, 0)


# ============================================================================ 3b scrubber


def _zero(pool, ids):
    import torch
    if ids:
        idx = torch.as_tensor(list(ids), dtype=torch.long, device=pool.k_cache.device)
        pool.k_cache.index_fill_(1, idx, 0)
        pool.v_cache.index_fill_(1, idx, 0)


class ScrubNothing:
    """Both hooks do nothing: recycled blocks keep the previous tenant's K/V."""

    def on_free(self, pool, block_ids):
        pass

    def on_alloc(self, pool, block_ids):
        pass


class ScrubDeferred:
    """'Batch the scrubs for efficiency': blocks given to on_alloc are queued and zeroed at the next
    on_free -- after their new owner has received them (stale data visible) and written them
    (the owner's own K/V destroyed)."""

    def __init__(self):
        self.queue: list[int] = []

    def on_free(self, pool, block_ids):
        _zero(pool, self.queue)
        self.queue = []

    def on_alloc(self, pool, block_ids):
        self.queue += list(block_ids)


class ScrubFirstBlockOnly:
    """Assumes one block per call: only block_ids[0] is zeroed."""

    def on_free(self, pool, block_ids):
        pass

    def on_alloc(self, pool, block_ids):
        _zero(pool, list(block_ids)[:1])


class ScrubOnlyK:
    """Zeroes the keys and forgets the values."""

    def on_free(self, pool, block_ids):
        pass

    def on_alloc(self, pool, block_ids):
        zero_k_only(pool, list(block_ids))


class ScrubWholePool:
    """'Just wipe everything on allocation': destroys cached prefixes and running requests' K/V."""

    def on_free(self, pool, block_ids):
        pass

    def on_alloc(self, pool, block_ids):
        pool.k_cache.zero_()
        pool.v_cache.zero_()


MUTANTS = {
    "3a": entries(("k-only", zero_k_only), ("layer0-only", zero_layer0_only), ("wrong-dim", zero_wrong_dim),
                  ("out-of-place", zero_out_of_place)),
    "3b": entries(("nothing", ScrubNothing), ("deferred", ScrubDeferred), ("first-block-only", ScrubFirstBlockOnly),
                  ("k-only", ScrubOnlyK), ("whole-pool", ScrubWholePool)),
}
