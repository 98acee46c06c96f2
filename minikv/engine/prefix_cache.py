"""The prefix cache: which registered block already holds these tokens, and which goes first.

The block manager (:mod:`~minikv.engine.block_manager`) owns one and answers "who holds which
physical block"; this object answers "which block already holds these tokens, for this domain".
It is torch-free, and it is where isolation is decided: a block is found by its *hash*, which the
hasher computes from the block's tokens, its parent block's hash (chained, so one block names its
whole prefix) and the sequence's *domain key* (the tenant key, under tenant isolation).  A
request of another domain computes another hash for the same tokens and never finds the block.

A hash match is not yet a hit.  Hashes can collide (weak or unchained ones easily, lesson 06), so
``match`` also compares the block's :class:`~minikv.engine.lifecycle.BlockIdentity` -- tokens,
parent block, domain -- with the one the request needs, as much as ``verify_hits`` asks.

Registered blocks nobody holds are *cached*: kept, in LRU order (``cached``, a
:class:`CachedLRU`), until a request needs a block and the free list is empty.  Eviction is lazy,
least recently used first (vLLM and SGLang do the same: an idle cache is free capacity).  With a
per-tenant quota (``max_cached_per_tenant``) a tenant keeps at most that many registered blocks,
and a tenant that needs a block recycles its own cached blocks before the LRU takes anyone
else's, so one tenant's load cannot flush a neighbour's cache: prime-and-probe (lesson 10).

The prefix cache *chooses* victims; the block manager evicts them (free list, lifecycle events).
It labels the blocks it registers (``hash``, ``identity``, ``public``) and never touches their
reference counts.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Callable, Iterator

from .lifecycle import BlockIdentity, VerifyHits
from .sequence import Sequence


class PrefixCache:
    """Hash table of registered blocks, identity checks, LRU of cached blocks, per-tenant quota."""

    def __init__(self, blocks: list, block_size: int, work: Counter, *, hasher: Callable | None,
                 enable_caching: bool, chain_hashes: bool, verify_hits: VerifyHits | bool | str,
                 max_cached_per_tenant: int | None):
        self.blocks, self.block_size, self.work = blocks, block_size, work  # the block manager's
        self.cached = CachedLRU()  # the evictable blocks, LRU order, oldest first, indexed by tenant
        self.hash_table: dict[bytes, int] = {}
        self.hasher = hasher
        self.enable_caching = enable_caching and hasher is not None
        self.chain_hashes = chain_hashes
        self.verify_hits = VerifyHits.of(verify_hits)
        self.max_cached_per_tenant = max_cached_per_tenant
        self.registered: Counter = Counter()  # writer tenant -> its blocks in the hash table (quota)
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
        when it is stored, compared with a cached block's on a hit."""
        return BlockIdentity(seq.block_tokens(i, self.block_size), parent, seq.domain_key(i, self.block_size))

    # ---------------------------------------------------------------- prefix lookup
    def match(self, seq: Sequence, hits: list[int], *, fill: Callable | None = None, resume: bool = False) -> bool:
        """Extend ``hits`` (in place) with the cached blocks matching ``seq``'s next full blocks.

        The hit is capped so that at least one prompt token is computed: the model must run on the
        last token to produce logits for the first output token.  On a miss, ``fill(seq, i, hits)``
        (if given) may still supply a block from below the pool.  ``resume``: ``hits`` came from a
        match that stopped at a miss, so that block is not looked up (nor counted) again.  Returns
        True when it stopped at a miss that ``fill`` might have filled."""
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
            if bid is None and fill is not None:
                bid = fill(seq, i, hits)
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
    def register(self, block, h: bytes, identity: BlockIdentity, public: bool) -> None:
        """Enter ``block`` in the hash table under ``h`` (the ``store`` transition's bookkeeping)."""
        block.hash, block.identity, block.public = h, identity, public
        self.hash_table[h] = block.block_id
        self._count(block.writer_tenant, +1)

    def unregister(self, block) -> None:
        """Drop an evicted ``block`` from the hash table (the ``evict`` bookkeeping)."""
        del self.hash_table[block.hash]
        self._count(block.writer_tenant, -1)
        block.hash = block.identity = None

    def rekey(self, block, new_hash: bytes, identity: BlockIdentity, public: bool) -> bool:
        """File registered ``block`` under ``new_hash`` in another isolation domain (same K/V,
        holders, writer).  False, changing nothing, when ``new_hash`` is taken."""
        if block.hash is None or new_hash in self.hash_table:
            return False
        del self.hash_table[block.hash]
        block.hash, block.identity, block.public = new_hash, identity, public
        self.hash_table[new_hash] = block.block_id
        return True

    def _count(self, tenant: str | None, delta: int) -> None:
        self.registered[tenant] += delta
        if not self.registered[tenant]:
            del self.registered[tenant]  # tenants come and go; keep no zero entries

    # ---------------------------------------------------------------- what goes first
    def victim(self, tenant: str | None) -> int | None:
        """The cached block to evict when ``tenant`` needs one and the free list is empty."""
        if self.max_cached_per_tenant is not None:
            # With quotas on, a tenant recycles its own cache before anyone else's, so its
            # load cannot flush a neighbour's blocks (the prime-and-probe side channel).
            own = self.cached.oldest_of(tenant)
            if own is not None:
                return own
        return self.cached.oldest()

    def over_quota(self, tenant: str | None) -> int | None:
        """``tenant``'s oldest cached block while it has more registered than its quota (its used
        blocks count, but only cached ones can go), else None."""
        if self.max_cached_per_tenant is None or self.registered[tenant] <= self.max_cached_per_tenant:
            return None
        return self.cached.oldest_of(tenant)


class CachedLRU:
    """The cached blocks' ids in LRU order (oldest first), overall and by the tenant that wrote them.

    Both "the longest-idle block" (the LRU victim) and "this tenant's longest-idle block" (its own
    recycling, its quota) are asked on hot paths; scanning every cached block for the second would
    make each allocation cost O(cache size).  So each block sits in two ordered dicts, one for
    everyone and one for its writer's tenant, and every answer costs O(1) per block returned.
    Reads like an ``OrderedDict`` (``in``, ``len``, iteration, ``pop(bid, default)``)."""

    def __init__(self) -> None:
        self._all: OrderedDict[int, str | None] = OrderedDict()  # block id -> writer tenant
        self._by_tenant: dict[str | None, OrderedDict[int, None]] = {}

    def add(self, bid: int, tenant: str | None) -> None:
        """``bid`` became cached now: it is the most recently used (goes last)."""
        self.pop(bid)
        self._all[bid] = tenant
        self._by_tenant.setdefault(tenant, OrderedDict())[bid] = None

    def pop(self, bid: int, default=None):
        """Remove ``bid`` (it is being reused or evicted); returns its tenant, or ``default``."""
        if bid not in self._all:
            return default
        tenant = self._all.pop(bid)
        mine = self._by_tenant[tenant]
        del mine[bid]
        if not mine:
            del self._by_tenant[tenant]
        return tenant

    def oldest(self) -> int | None:
        return next(iter(self._all), None)

    def oldest_of(self, tenant: str | None) -> int | None:
        """``tenant``'s longest-idle block, or None (None is a tenant: the anonymous one)."""
        return next(iter(self._by_tenant.get(tenant, ())), None)

    def tenant_of(self, bid: int) -> str | None:
        return self._all[bid]

    def of(self, tenant: str | None) -> list[int]:
        """``tenant``'s cached blocks, oldest first."""
        return list(self._by_tenant.get(tenant, ()))

    def __contains__(self, bid: int) -> bool:
        return bid in self._all

    def __iter__(self) -> Iterator[int]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def check(self) -> None:
        """Raise AssertionError if the two indexes disagree (used by the invariant checks)."""
        assert sum(len(d) for d in self._by_tenant.values()) == len(self._all), "tenant index size"
        for tenant, ids in self._by_tenant.items():
            assert ids, f"empty index kept for tenant {tenant!r}"
            for bid in ids:
                assert self._all.get(bid, object()) == tenant, f"block {bid} indexed under {tenant!r}"
        order = {bid: k for k, bid in enumerate(self._all)}
        for ids in self._by_tenant.values():
            ranks = [order[b] for b in ids]
            assert ranks == sorted(ranks), "a tenant's blocks are out of LRU order"
