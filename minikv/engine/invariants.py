"""The block manager's invariants, checked by tests after every step.

Each physical block is in exactly one lifecycle state (used, cached, free); reference counts
equal the number of block tables holding the block; the hash table indexes exactly the
registered blocks; per-tenant counts and the per-tenant LRU agree with the blocks themselves.
A bookkeeping bug that breaks one of these is how a block ends up in two tenants' tables, so the
property tests (``tests/test_engine_properties.py``) call this after every engine step.
"""
from __future__ import annotations

from collections import Counter


def check_block_manager(bm, seqs) -> None:
    """Raise AssertionError naming the first inconsistency between ``bm`` (a
    :class:`~minikv.engine.block_manager.BlockManager`) and the running sequences ``seqs``."""
    held: dict[int, int] = {}
    for s in seqs:
        assert len(set(s.block_table)) == len(s.block_table), f"{s.request_id} holds a block twice"
        for bid in s.block_table:
            held[bid] = held.get(bid, 0) + 1
    free, cached = set(bm.free_ids), set(bm.cached)
    assert len(free) == len(bm.free_ids), "a block is on the free list twice"
    for b in bm.blocks:
        assert b.ref_count == held.get(b.block_id, 0), f"block {b.block_id} ref_count mismatch"
        states = (b.ref_count > 0) + (b.block_id in free) + (b.block_id in cached)
        assert states == 1, f"block {b.block_id} is in {states} states"
        assert (b.block_id in cached) <= (b.hash is not None), f"cached block {b.block_id} has no hash"
        if b.hash is not None:
            assert bm.hash_table.get(b.hash) == b.block_id, f"block {b.block_id} hash not indexed"
    assert len(bm.hash_table) == sum(b.hash is not None for b in bm.blocks)
    registered = Counter(b.writer_tenant for b in bm.blocks if b.hash is not None)
    assert bm.prefix_cache.registered == registered, f"registered counts {bm.prefix_cache.registered} != {registered}"
    bm.cached.check()
    for bid in bm.cached:
        assert bm.cached.tenant_of(bid) == bm.blocks[bid].writer_tenant, f"block {bid} filed under another tenant"
