"""The prefix cache on its own: the block manager owns one (``BlockManager.prefix_cache``), and it
works without it -- hashing, matching with the identity check, registration, what to evict.

These drive :class:`~minikv.engine.prefix_cache.PrefixCache` over a bare list of blocks, the way
the block manager does, so a bug in it shows here and not only through a whole engine.
"""
from __future__ import annotations

from collections import Counter

from minikv.engine.block_manager import BlockManager
from minikv.engine.lifecycle import Block
from minikv.engine.prefix_cache import PrefixCache
from minikv.engine.sequence import Sequence
from minikv.security.hashing import make_hasher

BS = 4
KEY_A, KEY_B = b"a" * 32, b"b" * 32


def _cache(quota=None, blocks=6) -> PrefixCache:
    return PrefixCache([Block(i) for i in range(blocks)], BS, Counter(), hasher=make_hasher("sha256", b"s" * 32),
                       enable_caching=True, chain_hashes=True, verify_hits=True, max_cached_per_tenant=quota)


def _seq(tokens, key=KEY_A, tenant="a") -> Sequence:
    return Sequence(f"r{len(tokens)}{tenant}", list(tokens), None, tenant=tenant, tenant_key=key)


def _store(cache: PrefixCache, seq: Sequence, block_ids: list[int]) -> None:
    """Register ``seq``'s first full blocks in ``block_ids``, chained, as the block manager's commit does."""
    parent = None
    for i, bid in enumerate(block_ids):
        block = cache.blocks[bid]
        block.writer_tenant = seq.tenant
        cache.register(block, cache.block_hash(seq, i), cache.identity(seq, i, parent), False)
        parent = block.ref


def test_a_stored_prefix_is_matched_in_its_domain_and_not_in_another():
    cache = _cache()
    _store(cache, _seq(range(12)), [3, 1])
    hits: list[int] = []
    assert not cache.match(_seq(range(9)), hits) and hits == [3, 1]  # both full blocks, in order
    other: list[int] = []
    assert cache.match(_seq(range(9), key=KEY_B, tenant="b"), other) and other == []  # a miss at block 0
    capped: list[int] = []
    cache.match(_seq(range(8)), capped)
    assert capped == [3]  # the last prompt token is always computed: 8 tokens hit one block, not two
    assert (cache.num_hits, cache.num_rejected_hits) == (3, 0)


def test_a_hash_match_with_another_identity_is_rejected():
    cache = _cache()
    _store(cache, _seq(range(12)), [0, 1])
    seq = _seq(range(13))
    hits: list[int] = []
    cache.match(seq, hits)
    assert hits == [0, 1] and cache.num_rejected_hits == 0
    cache.blocks[0].generation += 1  # block 0 recycled since block 1 chained onto it: another parent
    hits = []
    cache.match(seq, hits)
    assert hits == [0] and cache.num_rejected_hits == 1  # the hash still matches; the identity does not


def test_victims_are_the_oldest_cached_and_a_tenant_over_quota_loses_its_own():
    cache = _cache(quota=1)
    _store(cache, _seq(range(12)), [0, 1])
    _store(cache, _seq(range(100, 104), key=KEY_B, tenant="b"), [2])
    for bid, tenant in ((0, "a"), (2, "b"), (1, "a")):  # LRU order: 0 is the oldest
        cache.cached.add(bid, tenant)
    assert cache.over_quota("a") == 0 and cache.over_quota("b") is None  # "a" holds 2 registered, quota 1
    assert cache.victim("b") == 2 and cache.victim("c") == 0  # its own oldest first; else the oldest overall
    cache.cached.pop(0)
    cache.unregister(cache.blocks[0])
    assert cache.over_quota("a") is None and cache.registered == Counter(a=1, b=1)
    assert cache.blocks[0].hash is None and len(cache.hash_table) == 2


def test_the_block_manager_reads_its_prefix_cache_through():
    bm = BlockManager(4, BS, hasher=make_hasher("sha256", b"s" * 32), enable_caching=True)
    seq = _seq(range(9))
    assert bm.allocate(seq)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq)
    assert bm.hash_table is bm.prefix_cache.hash_table and len(bm.hash_table) == 2
    assert bm.block_hash(seq, 1) == bm.prefix_cache.block_hash(seq, 1) == seq.block_hashes[1]
    bm.free(seq)
    assert list(bm.cached) == list(bm.prefix_cache.cached) and len(bm.cached) == 2 and bm.num_available == 4
