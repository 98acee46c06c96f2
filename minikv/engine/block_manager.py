"""The block manager: which physical KV block holds which tokens, for whom.

It is torch-free on purpose.  Everything interesting about KV-cache *security* is decided
here, by bookkeeping alone: who may hit which cached block, when a freed block is reused, and
when its old contents must be scrubbed.  The tensors live in :class:`~minikv.engine.kv_pool.KVPool`.

Two halves, one object.  This module holds the *physical* side: free list, reference counts,
allocation, release, and ``commit`` after a model step.  The prefix-cache index -- hashing,
lookup and its identity check, the hash table, the LRU of cached blocks, eviction and the
per-tenant quota -- is :class:`~minikv.engine.prefix_index.PrefixIndex`, mixed in.

Every physical block is in exactly one of the states of :mod:`~minikv.engine.lifecycle`:

* **used**   -- ``ref_count > 0``: in the block table of one or more running sequences;
* **cached** -- ``ref_count == 0`` but registered in ``hash_table``: its K/V are kept so that a
  later request with the same prefix (in the same isolation domain) can *hit* it; these are the
  *evictable* blocks, in LRU order in ``cached`` (a :class:`~minikv.engine.lru.CachedLRU`);
* **free**   -- ``ref_count == 0`` and unregistered: on ``free_ids``, contents meaningless.

Cached blocks are evicted lazily, only when a request needs a block and the free list is empty
(the order, and the per-tenant quota: :mod:`~minikv.engine.prefix_index`).

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
from typing import Callable, NamedTuple

from .invariants import check_block_manager
from .lifecycle import BlockIdentity, Transition, VerifyHits
from .prefix_index import ALL_TENANTS, PrefixIndex
from .sequence import Sequence

__all__ = ["ALL_TENANTS", "Block", "BlockManager", "Found", "NoConnector"]  # ALL_TENANTS: prefix_index's


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


class Found(NamedTuple):
    """What a connector found for a pool miss: ``data`` (its own, handed back to its ``load``) and
    the tenant who wrote the block, as this engine should record it (the trail's writer)."""
    data: object
    writer_tenant: str | None


class NoConnector:
    """The KV connector of a pool that is the whole cache: below it there is nothing.

    A connector (vLLM's name for what moves KV blocks between the pool and elsewhere: host memory,
    a shared store) is the block manager's one hook below the pool.  ``offload`` runs just before
    a request's need evicts a cached block (True: its K/V were kept below, the ``offload``
    transition); ``fetch`` is asked on a pool miss at admission (a :class:`Found`, or None);
    ``load`` then copies what it found into the free block chosen for it, every slot.  KV tiers
    (:mod:`minikv.tiers`) are one; the composition root attaches it."""

    def offload(self, block: Block, seq: Sequence) -> bool:
        return False

    def fetch(self, seq: Sequence, i: int) -> Found | None:
        return None

    def load(self, block_id: int, found: Found) -> None:
        raise AssertionError("NoConnector.fetch finds nothing, so nothing is ever loaded")


class BlockManager(PrefixIndex):
    """Free list and reference counts for a pool of ``num_blocks`` blocks; the hash table, LRU and
    quota come from :class:`~minikv.engine.prefix_index.PrefixIndex`."""

    def __init__(self, num_blocks: int, block_size: int, *, hasher: Callable | None = None,
                 enable_caching: bool = False, chain_hashes: bool = True,
                 verify_hits: VerifyHits | bool | str = True, max_cached_per_tenant: int | None = None):
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))
        self._init_index(hasher, enable_caching, chain_hashes, verify_hits, max_cached_per_tenant)
        self.listeners: list[Callable] = []
        self.kv_connector = NoConnector()  # below the pool: offload on evict, fetch on a miss
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

    # ---------------------------------------------------------------- allocation
    def can_allocate(self, num_new: int, hits: list[int] = ()) -> bool:
        reclaimed = sum(1 for b in hits if b in self.cached)
        return num_new <= self.num_available - reclaimed

    def allocate(self, seq: Sequence) -> bool:
        """Give a waiting ``seq`` the blocks for all its tokens, reusing prefix hits.
        Returns False (and changes nothing) when the pool cannot hold it."""
        # The pool is asked first, the connector only once admission is certain.  Onloading
        # before the check (as lookup() does) would move blocks for a request that is then
        # refused; a retry, after running decodes evicted them again, would onload them twice,
        # and the trail would count onloads nobody used.  Checking first changes no decision: an
        # onload spends one available block and leaves one fewer to allocate (_onload), so it
        # never turns a refusal into an admission (nor the reverse); a refused request moves and
        # counts nothing, and each onload is a block the admitted request uses, counted once.
        hits: list[int] = []
        pool_miss = self._match(seq, hits, onload=False)
        num_needed = -(-seq.num_tokens // self.block_size)
        if not self.can_allocate(num_needed - len(hits), hits):
            return False
        if pool_miss:
            self._match(seq, hits, onload=True, resume=True)
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
        self._evict(self._victim(seq.tenant), seq)
        return self.free_ids.pop()

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
            self._register(block, h, identity, seq.block_is_public(i, self.block_size))
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
        parent = self.blocks[hits[-1]].ref if hits else None
        self._register(block, self.block_hash(seq, i), self.identity(seq, i, parent),
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
