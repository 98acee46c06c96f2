"""The block manager: which physical KV block holds which tokens, for whom.

It is torch-free on purpose: who may hit which cached block, when a freed block is reused and
when its old contents must be scrubbed are decided here, by bookkeeping alone (the tensors live in
:class:`~minikv.engine.kv_pool.KVPool`).  It holds the *physical* side -- free list, reference
counts, allocation, release, eviction, ``commit`` after a model step -- and owns a
:class:`~minikv.engine.prefix_cache.PrefixCache` (``prefix_cache``), which it asks which
registered block already holds a request's tokens, and which cached block should go first.

Every physical block is in exactly one of the states of :mod:`~minikv.engine.lifecycle`:

* **used**   -- ``ref_count > 0``: in the block table of one or more running sequences;
* **cached** -- ``ref_count == 0`` but registered in ``hash_table``: kept so that a later request
  with the same prefix (in the same isolation domain) can *hit* it; the *evictable* blocks, in
  the prefix cache's LRU order (``cached``), evicted lazily when the free list is empty;
* **free**   -- ``ref_count == 0`` and unregistered: on ``free_ids``, contents meaningless.

Every bookkeeping path is linear (a block is hashed once, a hit verifies one block, ``commit``
visits only the blocks the last step filled); ``work`` counts the tokens each touched, so tests
check the scaling by counting, not timing.  Each state change is announced to ``listeners`` as
``(transition, block_ids, seq)`` (a :class:`~minikv.engine.lifecycle.Transition`); an ``evict``
names the sequence that caused it, and only an operator's ``evict_cached`` passes None.
"""
from __future__ import annotations

from collections import Counter, deque
from typing import Callable

from .invariants import check_block_manager
from .kv_connector import NoConnector
from .lifecycle import Block, BlockIdentity, Transition, VerifyHits
from .prefix_cache import PrefixCache
from .sequence import Sequence

ALL_TENANTS = object()  # "no tenant filter" (None is a real tenant: the anonymous one)


def _from_prefix_cache(name: str) -> property:
    return property(lambda self: getattr(self.prefix_cache, name), doc=f"``prefix_cache.{name}``")


class BlockManager:
    """Free list and reference counts for a pool of ``num_blocks`` blocks, and its prefix cache."""

    # The prefix cache's state and its block_hash, read here by snapshots, tests and lessons.
    hash_table, cached, hasher, block_hash = (_from_prefix_cache(n) for n in
                                              ("hash_table", "cached", "hasher", "block_hash"))
    enable_caching, chain_hashes = _from_prefix_cache("enable_caching"), _from_prefix_cache("chain_hashes")
    max_cached_per_tenant = _from_prefix_cache("max_cached_per_tenant")
    num_hits, num_rejected_hits = _from_prefix_cache("num_hits"), _from_prefix_cache("num_rejected_hits")

    def __init__(self, num_blocks: int, block_size: int, *, hasher: Callable | None = None,
                 enable_caching: bool = False, chain_hashes: bool = True,
                 verify_hits: VerifyHits | bool | str = True, max_cached_per_tenant: int | None = None):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        # Tokens touched: "hashed" (block_hash), "verified" (hit checks), "committed" (commit).
        self.work: Counter = Counter()
        self.prefix_cache = PrefixCache(self.blocks, block_size, self.work, hasher=hasher,
                                        enable_caching=enable_caching, chain_hashes=chain_hashes,
                                        verify_hits=verify_hits, max_cached_per_tenant=max_cached_per_tenant)
        self.listeners: list[Callable] = []
        self.kv_connector = NoConnector()  # below the pool: offload on evict, fetch on a miss
        self.num_deduplicated = 0  # duplicate blocks freed by commit (their twin was adopted)

    # ---------------------------------------------------------------- bookkeeping helpers
    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_available(self) -> int:
        """Blocks an allocation could take now: free + cached (evictable)."""
        return len(self.free_ids) + len(self.cached)

    def emit(self, transition: Transition, ids: list[int], seq: Sequence | None) -> None:
        """Announce a transition of blocks ``ids`` (caused by ``seq``) to every listener."""
        if ids:
            for listener in self.listeners:
                listener(transition, ids, seq)

    # ---------------------------------------------------------------- allocation
    def can_allocate(self, num_new: int, hits: list[int] = ()) -> bool:
        reclaimed = sum(1 for b in hits if b in self.cached)
        return num_new <= self.num_available - reclaimed

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting ``seq`` the blocks for all its tokens, reusing prefix hits.
        Returns False (and changes nothing) when the pool cannot hold it."""
        # The pool is asked first, the connector only once admission is certain: onloading for a
        # request that is then refused would move blocks nobody uses (and move them again on its
        # retry).  Checking first changes no decision: an onload spends one available block and
        # leaves one fewer to allocate (_onload), so it never turns a refusal into an admission.
        hits: list[int] = []
        pool_miss = self.prefix_cache.match(seq, hits)
        num_needed = -(-seq.num_tokens // self.block_size)
        if not self.can_allocate(num_needed - len(hits), hits):
            return False
        if pool_miss:
            self.prefix_cache.match(seq, hits, fill=self._onload, resume=True)
        for bid in hits:
            self._hold(self.blocks[bid], seq)
        self.emit(Transition.HIT, hits, seq)
        seq.block_table = list(hits)
        seq.num_computed_tokens = seq.num_committed_tokens = len(hits) * self.block_size
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = seq.num_computed_tokens
        self._allocate_fresh(seq, num_needed - len(hits))
        return True

    def append_slot(self, seq: Sequence) -> bool:
        """Make room for ``seq``'s newest token (decode).  False when the pool is exhausted:
        the scheduler then preempts someone."""
        if seq.num_tokens <= len(seq.block_table) * self.block_size:
            return True
        if self.num_available < 1:
            return False
        self._allocate_fresh(seq, 1)
        return True

    def _allocate_fresh(self, seq: Sequence, n: int) -> None:
        fresh = [self._take_free_block(seq) for _ in range(n)]
        for bid in fresh:
            block = self.blocks[bid]
            block.generation += 1
            block.writer_request, block.writer_tenant = seq.request_id, seq.tenant
            block.public = False
            block.num_tokens = 0
            self._hold(block, seq)
        seq.block_table.extend(fresh)
        self.emit(Transition.ALLOCATE, fresh, seq)

    def _hold(self, block: Block, seq: Sequence) -> None:
        if block.ref_count == 0:
            self.cached.pop(block.block_id)
        block.ref_count += 1

    def _take_free_block(self, seq: Sequence) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        # The event names ``seq``, the request whose allocation forced the eviction, so the
        # audit trail can tell who keeps evicting whom (the block itself names its writer).
        self._evict(self.prefix_cache.victim(seq.tenant), seq)
        return self.free_ids.pop()

    # ---------------------------------------------------------------- after a model step
    def commit(self, seq: Sequence) -> None:
        """Record K/V written by the last step; register the blocks it filled.

        Only the blocks the step wrote are visited (from ``seq.num_committed_tokens``, where the
        last commit stopped, to ``seq.num_computed_tokens``), so a long decode stays linear.

        A newly full block whose hash is already registered is a *duplicate*: typically two
        requests with the same prefix admitted in the same step, both computing it.  When the
        registered twin has exactly this block's identity (tokens, parent, domain), the sequence
        *adopts* the twin and frees its copy, so its later blocks chain onto the twin and a later
        request can hit all of them (a private copy would fail every later parent check).  A twin
        with another identity is a hash collision: the copy stays private, as it must.  An
        ``adopt`` is not a ``hit`` (the tokens were computed, not cached), yet it reads a block
        another request wrote, so isolation checks watch both (``lifecycle.REUSES``)."""
        bs, start, end = self.block_size, seq.num_committed_tokens, seq.num_computed_tokens
        for i in range(start // bs, -(-end // bs)):
            block = self.blocks[seq.block_table[i]]
            block.num_tokens = max(block.num_tokens, min(bs, end - i * bs))
            self.work["committed"] += bs
        seq.num_committed_tokens = max(start, end)
        if not (self.prefix_cache.enable_caching and seq.cacheable):
            return
        stored, adopted, released = [], [], []
        try:
            for i in range(start // bs, end // bs):
                if self.blocks[seq.block_table[i]].hash is None:  # else a hit: registered already
                    self._store_or_adopt(seq, i, stored, adopted, released)
        finally:  # a hasher that raises fails this sequence; what happened before is still announced
            self.num_deduplicated += len(released)
            self.emit(Transition.ADOPT, adopted, seq)
            self.emit(Transition.FREE, released, seq)
            self.emit(Transition.STORE, stored, seq)
        if stored:  # a tenant's cached count grows only here; free() re-checks when blocks idle
            self._enforce_quota(seq.tenant, seq)

    def _store_or_adopt(self, seq: Sequence, i: int, stored: list, adopted: list, released: list) -> None:
        """Register ``seq``'s newly full block ``i``, or swap it for its registered twin."""
        block, cache = self.blocks[seq.block_table[i]], self.prefix_cache
        h = cache.block_hash(seq, i)
        identity = cache.identity(seq, i, self.blocks[seq.block_table[i - 1]].ref if i else None)
        twin = self.blocks[cache.hash_table[h]] if h in cache.hash_table else None
        if twin is None:
            cache.register(block, h, identity, seq.block_is_public(i, self.block_size))
            stored.append(block.block_id)
        elif twin.identity == identity and block.ref_count == 1:  # strict, whatever verify_hits says
            self._hold(twin, seq)
            seq.block_table[i] = twin.block_id
            block.ref_count = 0  # unregistered, so it was this sequence's alone
            self.free_ids.append(block.block_id)
            adopted.append(twin.block_id)
            released.append(block.block_id)

    def free(self, seq: Sequence) -> None:
        """Let go of ``seq``'s blocks (finish, abort or preemption).  A block whose last holder
        this was is *cached* if registered, else *freed*.  Tail blocks go first, so the LRU
        evicts the ends of prompts before the shared beginnings."""
        cached, freed = [], []
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.hash is not None:
                    self.cached.add(bid, block.writer_tenant)  # most recently used goes last
                    cached.append(bid)
                else:
                    self.free_ids.append(bid)
                    freed.append(bid)
        seq.block_table = []
        seq.num_computed_tokens = seq.num_committed_tokens = 0
        self.emit(Transition.FREE, freed, seq)
        self.emit(Transition.CACHE, cached, seq)
        self._enforce_quota(seq.tenant, seq)

    # ---------------------------------------------------------------- eviction
    def _evict(self, bid: int, seq: Sequence | None) -> None:
        """Drop a cached block from the prefix cache onto the free list (transition ``evict``)."""
        block = self.blocks[bid]
        self.cached.pop(bid, None)
        # An eviction a request caused (LRU, quota) may keep the K/V below the pool; an operator's reset does not.
        if seq is not None and self.kv_connector.offload(block, seq):
            self.emit(Transition.OFFLOAD, [bid], seq)  # then on_offload scrubs the pool's copy
        self.emit(Transition.EVICT, [bid], seq)  # listeners still see the hash being dropped
        self.prefix_cache.unregister(block)
        self.free_ids.append(bid)

    def evict_cached(self, tenant=ALL_TENANTS) -> int:
        """Evict every cached block (only ``tenant``'s, if given); return how many."""
        ids = list(self.cached) if tenant is ALL_TENANTS else self.cached.of(tenant)
        for bid in ids:
            self._evict(bid, None)
        return len(ids)

    def _enforce_quota(self, tenant: str | None, seq: Sequence | None) -> None:
        """Evict ``tenant``'s oldest cached blocks while it is over its quota.  O(blocks evicted)."""
        while (victim := self.prefix_cache.over_quota(tenant)) is not None:
            self._evict(victim, seq)

    def rekey(self, bid: int, new_hash: bytes, identity: BlockIdentity, public: bool,
              transition: Transition, seq: Sequence | None) -> bool:
        """Move registered block ``bid`` into another isolation domain under ``new_hash``: same
        K/V, holders, writer and state (selective sharing's ``promote`` and ``isolate``,
        :mod:`~minikv.sharing`).  False, changing nothing, when ``new_hash`` is taken."""
        if not self.prefix_cache.rekey(self.blocks[bid], new_hash, identity, public):
            return False
        self.emit(transition, [bid], seq)
        return True

    # ---------------------------------------------------------------- below the pool
    def _onload(self, seq: Sequence, i: int, hits: list[int]) -> int | None:
        """On a pool miss of ``seq``'s block ``i``: bring it in from the connector into a free
        block, registered and cached as if computed here (the ``onload`` transition); None if the
        connector has nothing, or no block can take it without evicting one of ``hits``.  Allocation
        stays feasible exactly when it was: one available block is spent, one fewer is needed."""
        found = self.kv_connector.fetch(seq, i)
        if found is None:
            return None
        bid = self._onload_slot(seq, hits)
        if bid is None:
            return None
        block = self.blocks[bid]
        block.generation += 1
        block.writer_request, block.writer_tenant = seq.request_id, found.writer_tenant
        block.num_tokens = self.block_size
        self.kv_connector.load(bid, found)  # every slot overwritten: nothing of the last owner is left
        parent, cache = self.blocks[hits[-1]].ref if hits else None, self.prefix_cache
        cache.register(block, cache.block_hash(seq, i), cache.identity(seq, i, parent),
                       seq.block_is_public(i, self.block_size))
        self.cached.add(bid, block.writer_tenant)
        seq.num_tier_blocks += 1
        self.emit(Transition.ONLOAD, [bid], seq)
        return bid

    def _onload_slot(self, seq: Sequence, hits: list[int]) -> int | None:
        """A free block for an onload: the free list first, else the oldest cached block that is
        not one of this lookup's hits (evicted, so offloaded in its turn)."""
        if self.free_ids:
            return self.free_ids.popleft()
        keep = set(hits)
        victim = next((b for b in self.cached if b not in keep), None)
        if victim is None:
            return None
        self._evict(victim, seq)
        return self.free_ids.pop()

    # ---------------------------------------------------------------- inspection
    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests); the checks
        live in :mod:`~minikv.engine.invariants`."""
        check_block_manager(self, seqs)
