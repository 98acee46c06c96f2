"""The block manager: which physical KV block holds which tokens, for whom.

It is torch-free on purpose.  Everything interesting about KV-cache *security* is decided
here, by bookkeeping alone: who may hit which cached block, when a freed block is reused, and
when its old contents must be scrubbed.  The tensors live in :class:`~minikv.engine.kv_pool.KVPool`.

Every physical block is in exactly one of the states of :mod:`~minikv.engine.lifecycle`:

* **used**   -- ``ref_count > 0``: in the block table of one or more running sequences;
* **cached** -- ``ref_count == 0`` but registered in ``hash_table``: its K/V are kept so that a
  later request with the same prefix (in the same isolation domain) can *hit* it; these are the
  *evictable* blocks, in LRU order in ``cached``;
* **free**   -- ``ref_count == 0`` and unregistered: on ``free_ids``, contents meaningless.

Cached blocks are evicted lazily, least recently used first, only when a request needs a block
and the free list is empty (vLLM and SGLang do the same: an idle cache is free capacity).

With a per-tenant quota (``max_cached_per_tenant``), a tenant keeps at most that many cached
blocks (its oldest go first when it stores more), and a tenant that needs a block recycles its
own cached blocks before the LRU takes anyone else's: prime-and-probe (lesson 10).

Each state change is announced to ``listeners`` as ``(transition, block_ids, seq)``, with a
:class:`~minikv.engine.lifecycle.Transition`; the engine's listener turns it into a scrub and an
audit record (``LLMEngine._on_block_event``).  An ``evict`` names the sequence that caused it
(the one allocating, or the one whose tenant went over quota); only an operator's
``evict_cached`` passes None.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from .lifecycle import BlockIdentity, Transition, VerifyHits
from .sequence import Sequence


ALL_TENANTS = object()  # "no tenant filter" (None is a real tenant: the anonymous one)


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    hash: bytes | None = None  # set while registered (store .. evict)
    identity: BlockIdentity | None = None  # what a hit on it must match; set with ``hash``
    generation: int = 0  # bumped each time the block is handed out fresh
    num_tokens: int = 0
    writer_request: str | None = None
    writer_tenant: str | None = None
    public: bool = False

    @property
    def ref(self) -> tuple[int, int]:
        """This block as a parent: a recycled block (new generation) is a different parent."""
        return (self.block_id, self.generation)


class BlockManager:
    """Free list, reference counts, hash table and LRU for a pool of ``num_blocks`` blocks."""

    def __init__(self, num_blocks: int, block_size: int, *, hasher: Callable | None = None,
                 enable_caching: bool = False, chain_hashes: bool = True,
                 verify_hits: VerifyHits | bool | str = True, max_cached_per_tenant: int | None = None):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()  # the evictable blocks, LRU order, oldest first
        self.hash_table: dict[bytes, int] = {}
        self.hasher = hasher
        self.enable_caching = enable_caching and hasher is not None
        self.chain_hashes = chain_hashes
        self.verify_hits = VerifyHits.of(verify_hits)
        self.max_cached_per_tenant = max_cached_per_tenant
        self.listeners: list[Callable] = []
        self.num_hits = self.num_lookups = self.num_rejected_hits = 0

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

    def block_hash(self, seq: Sequence, i: int) -> bytes:
        """Hash of ``seq``'s logical block ``i`` (computed once, then remembered)."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if (j > 0 and self.chain_hashes) else None
            seq.block_hashes.append(self.hasher(parent, seq.block_tokens(j, self.block_size),
                                                (), seq.domain_key(j, self.block_size)))
        return seq.block_hashes[i]

    def identity(self, seq: Sequence, i: int, parent: tuple[int, int] | None) -> BlockIdentity:
        """What ``seq``'s logical block ``i`` is, after the block ``parent``: written into a block
        when it is stored (``commit``), compared with a cached block's on a hit (``lookup``)."""
        return BlockIdentity(seq.block_tokens(i, self.block_size), parent, seq.domain_key(i, self.block_size))

    # ---------------------------------------------------------------- prefix lookup
    def lookup(self, seq: Sequence) -> list[int]:
        """Longest run of cached blocks matching ``seq``'s first full blocks.

        The hit is capped so that at least one prompt token is computed: the model must run on
        the last token to produce logits for the first output token.
        """
        if not (self.enable_caching and seq.cacheable):
            return []
        hits: list[int] = []
        max_hit = (seq.num_tokens - 1) // self.block_size
        parent = None
        for i in range(max_hit):
            self.num_lookups += 1
            bid = self.hash_table.get(self.block_hash(seq, i))
            if bid is None:
                break
            block = self.blocks[bid]
            if not block.identity.admits(self.identity(seq, i, parent), self.verify_hits):
                self.num_rejected_hits += 1  # a hash match alone is no proof: hashes collide (lesson 06)
                break
            hits.append(bid)
            parent = block.ref
        self.num_hits += len(hits)
        return hits

    # ---------------------------------------------------------------- allocation
    def can_allocate(self, num_new: int, hits: list[int] = ()) -> bool:
        reclaimed = sum(1 for b in hits if b in self.cached)
        return num_new <= self.num_available - reclaimed

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting ``seq`` the blocks for all its tokens, reusing prefix hits.
        Returns False (and changes nothing) when the pool cannot hold it."""
        hits = self.lookup(seq)
        num_needed = -(-seq.num_tokens // self.block_size)
        if not self.can_allocate(num_needed - len(hits), hits):
            return False
        for bid in hits:
            self._hold(self.blocks[bid], seq)
        self.emit(Transition.HIT, hits, seq)
        seq.block_table = list(hits)
        seq.num_computed_tokens = len(hits) * self.block_size
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
            self.cached.pop(block.block_id, None)
        block.ref_count += 1

    def _take_free_block(self, seq: Sequence) -> int:
        if self.free_ids:
            return self.free_ids.popleft()
        victim = next(iter(self.cached))
        if self.max_cached_per_tenant is not None:
            # With quotas on, a tenant recycles its own cache before anyone else's, so its
            # load cannot flush a neighbour's blocks (the prime-and-probe side channel).
            own = next((b for b in self.cached if self.blocks[b].writer_tenant == seq.tenant), None)
            victim = own if own is not None else victim
        # The event names ``seq``, the request whose allocation forced the eviction, so the
        # audit trail can tell who keeps evicting whom (the block itself names its writer).
        self._evict(victim, seq)
        return self.free_ids.pop()

    def _evict(self, bid: int, seq: Sequence | None) -> None:
        """Drop a cached block from the hash table onto the free list (transition ``evict``)."""
        block = self.blocks[bid]
        self.cached.pop(bid, None)
        self.emit(Transition.EVICT, [bid], seq)  # listeners still see the hash being dropped
        del self.hash_table[block.hash]
        block.hash = block.identity = None
        self.free_ids.append(bid)

    # ---------------------------------------------------------------- after a model step
    def commit(self, seq: Sequence) -> None:
        """Record K/V written by the last step; register newly full blocks in the hash table."""
        for i, bid in enumerate(seq.block_table):
            filled = min(self.block_size, max(0, seq.num_computed_tokens - i * self.block_size))
            self.blocks[bid].num_tokens = max(self.blocks[bid].num_tokens, filled)
        if not (self.enable_caching and seq.cacheable):
            return
        stored = []
        for i in range(seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is not None:
                continue
            h = self.block_hash(seq, i)
            if h in self.hash_table:
                continue  # an identical block is already cached; keep this one private
            block.hash = h
            block.identity = self.identity(seq, i, self.blocks[seq.block_table[i - 1]].ref if i else None)
            block.public = seq.block_is_public(i, self.block_size)
            self.hash_table[h] = block.block_id
            stored.append(block.block_id)
        self.emit(Transition.STORE, stored, seq)
        if stored:  # a tenant's cached count grows only here; free() re-checks when blocks idle
            self._enforce_quota(seq.tenant, seq)

    def evict_cached(self, tenant=ALL_TENANTS) -> int:
        """Evict every cached block (only ``tenant``'s, if given); return how many."""
        ids = [b for b in self.cached if tenant is ALL_TENANTS or self.blocks[b].writer_tenant == tenant]
        for bid in ids:
            self._evict(bid, None)
        return len(ids)

    def _enforce_quota(self, tenant: str | None, seq: Sequence | None) -> None:
        if self.max_cached_per_tenant is None:
            return
        mine = [b for b in self.hash_table.values() if self.blocks[b].writer_tenant == tenant]
        excess = len(mine) - self.max_cached_per_tenant
        for bid in [b for b in self.cached if self.blocks[b].writer_tenant == tenant][:max(0, excess)]:
            self._evict(bid, seq)

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
                    self.cached[bid] = None  # most recently used goes last
                    cached.append(bid)
                else:
                    self.free_ids.append(bid)
                    freed.append(bid)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self.emit(Transition.FREE, freed, seq)
        self.emit(Transition.CACHE, cached, seq)
        self._enforce_quota(seq.tenant, seq)

    # ---------------------------------------------------------------- inspection
    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        held: dict[int, int] = {}
        for s in seqs:
            assert len(set(s.block_table)) == len(s.block_table), f"{s.request_id} holds a block twice"
            for bid in s.block_table:
                held[bid] = held.get(bid, 0) + 1
        free, cached = set(self.free_ids), set(self.cached)
        assert len(free) == len(self.free_ids), "a block is on the free list twice"
        for b in self.blocks:
            assert b.ref_count == held.get(b.block_id, 0), f"block {b.block_id} ref_count mismatch"
            states = (b.ref_count > 0) + (b.block_id in free) + (b.block_id in cached)
            assert states == 1, f"block {b.block_id} is in {states} states"
            assert (b.block_id in cached) <= (b.hash is not None), f"cached block {b.block_id} has no hash"
            if b.hash is not None:
                assert self.hash_table.get(b.hash) == b.block_id, f"block {b.block_id} hash not indexed"
        assert len(self.hash_table) == sum(b.hash is not None for b in self.blocks)
