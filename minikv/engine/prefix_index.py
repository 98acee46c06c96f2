"""The prefix-cache index: which registered blocks exist, who may reuse them, and which go first.

The block manager (:mod:`~minikv.engine.block_manager`) answers "who holds which physical
block"; this half answers "which block already holds these tokens".  It is torch-free too, and
it is where isolation is decided: a block is found by its *hash*, which the hasher computes from
the block's tokens, its parent block's hash (chained, so one block names its whole prefix) and
the sequence's *domain key* (the tenant key, under tenant isolation).  A request of another
domain computes another hash for the same tokens and never finds the block.

A hash match is not yet a hit.  Hashes can collide (weak or unchained ones easily, lesson 06), so
``lookup`` also compares the block's :class:`~minikv.engine.lifecycle.BlockIdentity` -- tokens,
parent block, domain -- with the one the request needs, as much as ``verify_hits`` asks.

Registered blocks nobody holds are *cached*: kept, in LRU order (``cached``, a
:class:`~minikv.engine.lru.CachedLRU`), until a request needs a block and the free list is
empty.  Eviction is lazy, least recently used first (vLLM and SGLang do the same: an idle cache
is free capacity).  With a per-tenant quota (``max_cached_per_tenant``) a tenant keeps at most
that many registered blocks (its oldest cached ones go first when it stores more), and a tenant
that needs a block recycles its own cached blocks before the LRU takes anyone else's, so one
tenant's load cannot flush a neighbour's cache: prime-and-probe (lesson 10).

:class:`PrefixIndex` is a mixin of :class:`~minikv.engine.block_manager.BlockManager`, not a
separate object: both halves work on the same blocks, and every name (``hash_table``,
``cached``, ``lookup``, ...) stays where tests, snapshots and lessons read it.  It uses the
block manager's ``blocks``, ``block_size``, ``free_ids``, ``work`` and ``emit``.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable

from .lifecycle import BlockIdentity, Transition, VerifyHits
from .lru import CachedLRU
from .sequence import Sequence

ALL_TENANTS = object()  # "no tenant filter" (None is a real tenant: the anonymous one)


class PrefixIndex:
    """Hash table, identity checks, LRU of cached blocks, eviction and per-tenant quota."""

    def _init_index(self, hasher: Callable | None, enable_caching: bool, chain_hashes: bool,
                    verify_hits: VerifyHits | bool | str, max_cached_per_tenant: int | None) -> None:
        self.cached = CachedLRU()  # the evictable blocks, LRU order, oldest first, indexed by tenant
        self.hash_table: dict[bytes, int] = {}
        self.hasher = hasher
        self.enable_caching = enable_caching and hasher is not None
        self.chain_hashes = chain_hashes
        self.verify_hits = VerifyHits.of(verify_hits)
        self.max_cached_per_tenant = max_cached_per_tenant
        self._registered: Counter = Counter()  # writer tenant -> its blocks in the hash table (quota)
        self.num_hits = self.num_lookups = self.num_rejected_hits = 0

    # ---------------------------------------------------------------- what a block is
    def block_hash(self, seq: Sequence, i: int) -> bytes:
        """Hash of ``seq``'s logical block ``i`` (computed once, then remembered)."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if (j > 0 and self.chain_hashes) else None
            self.work["hashed"] += self.block_size
            seq.block_hashes.append(self.hasher(parent, seq.block_tokens(j, self.block_size),
                                                (), seq.domain_key(j, self.block_size)))
        return seq.block_hashes[i]

    def identity(self, seq: Sequence, i: int, parent: tuple[int, int] | None) -> BlockIdentity:
        """What ``seq``'s logical block ``i`` is, after the block ``parent``: written into a block
        when it is stored (``commit``), compared with a cached block's on a hit (``lookup``)."""
        return BlockIdentity(seq.block_tokens(i, self.block_size), parent, seq.domain_key(i, self.block_size))

    # ---------------------------------------------------------------- prefix lookup
    def lookup(self, seq: Sequence) -> list[int]:
        """Longest run of cached blocks matching ``seq``'s first full blocks (a pool miss may be
        onloaded from below the pool: ``BlockManager._onload``).

        The hit is capped so that at least one prompt token is computed: the model must run on
        the last token to produce logits for the first output token.
        """
        hits: list[int] = []
        self._match(seq, hits, onload=True)
        return hits

    def _match(self, seq: Sequence, hits: list[int], *, onload: bool, resume: bool = False) -> bool:
        """Extend ``hits`` (in place) with the blocks that match ``seq`` after them; onload pool
        misses from the connector only if ``onload``.  ``resume``: ``hits`` came from a pool-only match
        that stopped at a pool miss, so that block is not looked up (nor counted) again.  Returns
        True when it stopped at a pool miss the connector might fill (``BlockManager.allocate``)."""
        if not (self.enable_caching and seq.cacheable):
            return False
        start, max_hit = len(hits), (seq.num_tokens - 1) // self.block_size
        parent = self.blocks[hits[-1]].ref if hits else None
        missed = False
        for i in range(start, max_hit):
            bid = None
            if not (resume and i == start):
                self.num_lookups += 1
                bid = self.hash_table.get(self.block_hash(seq, i))
            if bid is None and onload:  # a pool miss the connector below the pool may still fill
                bid = self._onload(seq, i, hits)
            if bid is None:
                missed = True
                break
            block = self.blocks[bid]
            self.work["verified"] += self.block_size
            if not block.identity.admits(self.identity(seq, i, parent), self.verify_hits):
                self.num_rejected_hits += 1  # a hash match alone is no proof: hashes collide (lesson 06)
                break
            hits.append(bid)
            parent = block.ref
        self.num_hits += len(hits) - start
        return missed

    # ---------------------------------------------------------------- registration
    def _register(self, block, h: bytes, identity: BlockIdentity, public: bool) -> None:
        """Enter ``block`` in the hash table under ``h`` (the ``store`` transition's bookkeeping)."""
        block.hash, block.identity, block.public = h, identity, public
        self.hash_table[h] = block.block_id
        self._count_registered(block.writer_tenant, +1)

    def rekey(self, bid: int, new_hash: bytes, identity: BlockIdentity, public: bool,
              transition: Transition, seq: Sequence | None) -> bool:
        """Move registered block ``bid`` into another isolation domain under ``new_hash``: same
        K/V, holders, writer and state (selective sharing's ``promote`` and ``isolate``,
        :mod:`~minikv.sharing`).  False, changing nothing, when ``new_hash`` is taken."""
        block = self.blocks[bid]
        if block.hash is None or new_hash in self.hash_table:
            return False
        del self.hash_table[block.hash]
        block.hash, block.identity, block.public = new_hash, identity, public
        self.hash_table[new_hash] = bid
        self.emit(transition, [bid], seq)
        return True

    def _count_registered(self, tenant: str | None, delta: int) -> None:
        self._registered[tenant] += delta
        if not self._registered[tenant]:
            del self._registered[tenant]  # tenants come and go; keep no zero entries

    # ---------------------------------------------------------------- eviction
    def _victim(self, tenant: str | None) -> int:
        """The cached block to evict when ``tenant`` needs one and the free list is empty."""
        victim = self.cached.oldest()
        if self.max_cached_per_tenant is not None:
            # With quotas on, a tenant recycles its own cache before anyone else's, so its
            # load cannot flush a neighbour's blocks (the prime-and-probe side channel).
            own = self.cached.oldest_of(tenant)
            victim = own if own is not None else victim
        return victim

    def _evict(self, bid: int, seq: Sequence | None) -> None:
        """Drop a cached block from the hash table onto the free list (transition ``evict``)."""
        block = self.blocks[bid]
        self.cached.pop(bid, None)
        # An eviction a request caused (LRU, quota) may keep the K/V below the pool; an operator's reset does not.
        if seq is not None and self.kv_connector.offload(block, seq):
            self.emit(Transition.OFFLOAD, [bid], seq)  # then on_offload scrubs the pool's copy
        self.emit(Transition.EVICT, [bid], seq)  # listeners still see the hash being dropped
        del self.hash_table[block.hash]
        self._count_registered(block.writer_tenant, -1)
        block.hash = block.identity = None
        self.free_ids.append(bid)

    def evict_cached(self, tenant=ALL_TENANTS) -> int:
        """Evict every cached block (only ``tenant``'s, if given); return how many."""
        ids = list(self.cached) if tenant is ALL_TENANTS else self.cached.of(tenant)
        for bid in ids:
            self._evict(bid, None)
        return len(ids)

    def _enforce_quota(self, tenant: str | None, seq: Sequence | None) -> None:
        """Evict ``tenant``'s oldest cached blocks while it has more registered than its quota
        (its used blocks count, but only cached ones can go).  O(blocks evicted)."""
        if self.max_cached_per_tenant is None:
            return
        while self._registered[tenant] > self.max_cached_per_tenant:
            victim = self.cached.oldest_of(tenant)
            if victim is None:
                break
            self._evict(victim, seq)
