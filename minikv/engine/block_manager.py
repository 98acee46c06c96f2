"""The block manager: which physical KV block holds which tokens, for whom.

It is torch-free on purpose.  Everything interesting about KV-cache *security* is decided
here, by bookkeeping alone: who may hit which cached block, when a freed block is reused, and
when its old contents must be scrubbed.  The tensors live in :class:`~minikv.engine.kv_pool.KVPool`.

Every physical block is in exactly one of the states of :mod:`~minikv.engine.lifecycle`:

* **used**   -- ``ref_count > 0``: in the block table of one or more running sequences;
* **cached** -- ``ref_count == 0`` but registered in ``hash_table``: its K/V are kept so that a
  later request with the same prefix (in the same isolation domain) can *hit* it; these are the
  *evictable* blocks, in LRU order in ``cached`` (a :class:`~minikv.engine.lru.CachedLRU`);
* **free**   -- ``ref_count == 0`` and unregistered: on ``free_ids``, contents meaningless.

Cached blocks are evicted lazily, least recently used first, only when a request needs a block
and the free list is empty (vLLM and SGLang do the same: an idle cache is free capacity).

With a per-tenant quota (``max_cached_per_tenant``), a tenant keeps at most that many cached
blocks (its oldest go first when it stores more), and a tenant that needs a block recycles its
own cached blocks before the LRU takes anyone else's: prime-and-probe (lesson 10).

Two requests with the same prefix admitted in one step both compute it; ``commit`` keeps one
copy and frees the other, the second request *adopting* the first's (see its docstring), so a
repeat of the batch hits every shared block.

Every bookkeeping path is linear: a block is hashed once, a hit verifies one block's tokens, and
``commit`` visits only the blocks the last step filled.  ``work`` counts the tokens each of them
touched, so tests can check the scaling by counting, not timing.

Each state change is announced to ``listeners`` as ``(transition, block_ids, seq)``, with a
:class:`~minikv.engine.lifecycle.Transition`; the engine's listener turns it into a scrub and an
audit record (``LLMEngine._on_block_event``).  An ``evict`` names the sequence that caused it
(the one allocating, or the one whose tenant went over quota); only an operator's
``evict_cached`` passes None.
"""
from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass
from typing import Callable

from .lifecycle import BlockIdentity, Transition, VerifyHits
from .invariants import check_block_manager
from .lru import CachedLRU
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
        self.cached = CachedLRU()  # the evictable blocks, LRU order, oldest first, indexed by tenant
        self.hash_table: dict[bytes, int] = {}
        self.hasher = hasher
        self.enable_caching = enable_caching and hasher is not None
        self.chain_hashes = chain_hashes
        self.verify_hits = VerifyHits.of(verify_hits)
        self.max_cached_per_tenant = max_cached_per_tenant
        self.listeners: list[Callable] = []
        self._registered: Counter = Counter()  # writer tenant -> its blocks in the hash table (quota)
        self.num_hits = self.num_lookups = self.num_rejected_hits = 0
        self.num_deduplicated = 0  # duplicate blocks freed by commit (their twin was adopted)
        # Tokens touched: "hashed" (block_hash), "verified" (hit checks), "committed" (commit).
        self.work: Counter = Counter()

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
            self.work["verified"] += self.block_size
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
        victim = self.cached.oldest()
        if self.max_cached_per_tenant is not None:
            # With quotas on, a tenant recycles its own cache before anyone else's, so its
            # load cannot flush a neighbour's blocks (the prime-and-probe side channel).
            own = self.cached.oldest_of(seq.tenant)
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
        self._count_registered(block.writer_tenant, -1)
        block.hash = block.identity = None
        self.free_ids.append(bid)

    # ---------------------------------------------------------------- after a model step
    def commit(self, seq: Sequence) -> None:
        """Record K/V written by the last step; register the blocks it filled.

        Only the blocks the step wrote are visited -- from ``seq.num_committed_tokens`` (where
        the last commit stopped) to ``seq.num_computed_tokens`` -- so a step costs O(new blocks);
        visiting the whole block table would make a long decode quadratic.

        A newly full block whose hash is already registered is a *duplicate*: typically two
        requests with the same prefix admitted in the same step, both computing it.  When the
        registered twin has exactly this block's identity (tokens, parent block, domain), the
        sequence adopts the twin (an ``adopt``) and frees its own copy, so its later blocks chain
        onto the twin and a later request with this prefix can hit all of them.  Keeping the
        copy private instead would leave every later block with a parent nobody else holds:
        each later lookup would fail the parent check (a "rejected hit" without any attack).
        A twin with another identity is a hash collision: the copy stays private, as it must.

        An adoption is announced as ``adopt``, not ``hit``: the sequence computed the block itself,
        so it is not a cached token of the request (``num_cached_tokens`` was fixed at admission),
        yet it now reads a block another request wrote -- another tenant's, in a shared cache --
        which is why isolation checks watch both (``lifecycle.REUSES``)."""
        bs, start, end = self.block_size, seq.num_committed_tokens, seq.num_computed_tokens
        for i in range(start // bs, -(-end // bs)):
            block = self.blocks[seq.block_table[i]]
            block.num_tokens = max(block.num_tokens, min(bs, end - i * bs))
            self.work["committed"] += bs
        seq.num_committed_tokens = max(start, end)
        if not (self.enable_caching and seq.cacheable):
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
        block = self.blocks[seq.block_table[i]]
        h = self.block_hash(seq, i)
        identity = self.identity(seq, i, self.blocks[seq.block_table[i - 1]].ref if i else None)
        twin = self.blocks[self.hash_table[h]] if h in self.hash_table else None
        if twin is None:
            block.hash, block.identity = h, identity
            block.public = seq.block_is_public(i, self.block_size)
            self.hash_table[h] = block.block_id
            self._count_registered(block.writer_tenant, +1)
            stored.append(block.block_id)
        elif twin.identity == identity and block.ref_count == 1:  # strict, whatever verify_hits says
            self._hold(twin, seq)
            seq.block_table[i] = twin.block_id
            block.ref_count = 0  # unregistered, so it was this sequence's alone
            self.free_ids.append(block.block_id)
            adopted.append(twin.block_id)
            released.append(block.block_id)

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

    def _count_registered(self, tenant: str | None, delta: int) -> None:
        self._registered[tenant] += delta
        if not self._registered[tenant]:
            del self._registered[tenant]  # tenants come and go; keep no zero entries

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

    def rekey(self, bid: int, new_hash: bytes, identity: BlockIdentity, public: bool,
              transition: Transition, seq: Sequence | None) -> bool:
        """Move registered block ``bid`` into another isolation domain under ``new_hash``: same
        K/V, holders, writer and state (selective sharing's ``promote`` and ``isolate``,
        :mod:`~minikv.engine.sharing`).  False, changing nothing, when ``new_hash`` is taken."""
        block = self.blocks[bid]
        if block.hash is None or new_hash in self.hash_table:
            return False
        del self.hash_table[block.hash]
        block.hash, block.identity, block.public = new_hash, identity, public
        self.hash_table[new_hash] = bid
        self.emit(transition, [bid], seq)
        return True

    # ---------------------------------------------------------------- inspection
    def check_invariants(self, seqs: list[Sequence]) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests); the checks
        live in :mod:`~minikv.engine.invariants`."""
        check_block_manager(self, seqs)
