"""The life of one KV block: its states, the transitions between them, and what each one triggers.

This module is the vocabulary the rest of minikv uses.  The block manager *performs* transitions
and announces each one to its listeners: first the engine's (``LLMEngine._on_block_event``), which
runs the scrub hook the row of :data:`LIFECYCLE` names, then the audit trail's, which writes the
row's record (``AuditTrail.attach``).

States (``BlockView.state`` in snapshots uses the same words):

* ``free``   -- ref count 0, not in the hash table: on the free list; its bytes are whatever
  the last owner left there;
* ``used``   -- held by one or more running sequences (ref count > 0);
* ``cached`` -- ref count 0 but in the prefix-cache hash table: a later request of the same
  domain may hit it.  Cached blocks are the *evictable* ones; free + cached blocks are the
  *available* ones (what an allocation can take).

A block *registered* in the hash table is cached or used: ``Block.hash`` is set from ``store``
to ``evict``.

::

    free --ALLOCATE--> used --FREE--> free        (never stored: back to the free list)
                       used --CACHE--> cached     (stored: the cache keeps it)
                       used --STORE--> used       (now registered: others may hit it)
    cached --HIT--> used, used --HIT--> used      (another request reuses the K/V)
    cached/used --ADOPT--> used                   (the same, found at commit: see below)
    cached --EVICT--> free                        (LRU or quota: dropped from the hash table)
    used/cached --PROMOTE/ISOLATE--> same state   (selective sharing: a new key, the same K/V)
    cached --OFFLOAD--> cached --EVICT--> free    (KV tiers: sealed into a tier, then scrubbed, dropped)
    free --ONLOAD--> cached --HIT--> used         (KV tiers: a pool miss found in a tier, verified)

``hit`` is found at admission (``BlockManager.allocate``): the request never computes the block.
``adopt`` is found at commit: two requests with one prefix admitted in the same step both compute
it, the first registers its copy, and the second swaps its own copy for that registered *twin*
(and frees the copy).  Both hand a block another request wrote to a new reader, so an isolation
check must watch both (:data:`REUSES`); the audit trail keeps them apart, so its ``hit`` records
are exactly the admission-time hits that ``num_cached_tokens`` counts.

Every transition except ``cache`` puts a block's contents within someone else's reach
(:attr:`Edge.reach` says whose).  Each row names the scrubber hook that runs on it
(``minikv.security.scrub``): ``on_alloc`` on the way out of the free list and ``on_free`` on
both ways into it are the two every scrubber has; ``on_hit`` (a hit or an adoption: to the
K/V they are the same reuse), ``on_store`` and ``on_cache`` are optional (minikv's scrubbers have none: a hit, a store or a cached block is never scrubbed --
reuse is the point).  What guards a hit is isolation (the domain key in the block hash) and
verification (:class:`BlockIdentity`, :class:`VerifyHits`).
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, StrEnum
from typing import Iterable

from .checks import show


class State(StrEnum):
    FREE = "free"
    USED = "used"
    CACHED = "cached"


class Transition(StrEnum):
    """What happened to a block.  A ``str``: listeners may compare it with ``"hit"``."""

    ALLOCATE = "allocate"  # handed to a sequence without a hit (a fresh block)
    HIT = "hit"  # a cached (or used) block joins another sequence's block table at admission
    ADOPT = "adopt"  # at commit: a sequence swaps its same-step duplicate for the registered twin
    STORE = "store"  # a full block is registered in the hash table
    CACHE = "cache"  # its last holder let go; it stays in the hash table
    FREE = "free"  # its last holder let go; never stored, so it goes to the free list
    EVICT = "evict"  # dropped from the hash table onto the free list
    PROMOTE = "promote"  # selective sharing: re-keyed from its writer's domain into the public one
    ISOLATE = "isolate"  # selective sharing: re-keyed from the shared domain into its writer's
    OFFLOAD = "offload"  # KV tiers: sealed and written to a host tier just before it is evicted
    ONLOAD = "onload"  # KV tiers: a pool miss found it in a tier; copied into a free block, cached


@dataclass(frozen=True)
class Edge:
    """One row of the lifecycle table."""

    source: tuple[State, ...]
    target: State | None  # None: the block keeps its state (a re-key: promote, isolate)
    hook: str  # the Scrubber method that runs (on_alloc and on_free are required, others optional)
    record: str  # the audit-trail record kind (schema v2: both CACHE and FREE are "free")
    reach: str | None  # who can read the block's contents afterwards (None: nobody new)


F, U, C = State.FREE, State.USED, State.CACHED
LIFECYCLE: dict[Transition, Edge] = {
    Transition.ALLOCATE: Edge((F,), U, "on_alloc", "allocate", "the new owner, in the slots it has not written"),
    Transition.HIT: Edge((C, U), U, "on_hit", "hit", "the hitting request: the point of the cache"),
    Transition.ADOPT: Edge((C, U), U, "on_hit", "adopt", "the adopting request: a hit found after the fact"),
    Transition.STORE: Edge((U,), U, "on_store", "store", "every later request of the same domain"),
    Transition.CACHE: Edge((U,), C, "on_cache", "free", None),
    Transition.FREE: Edge((U,), F, "on_free", "free", "whoever allocates the block next"),
    Transition.EVICT: Edge((C,), F, "on_free", "evict", "whoever allocates the block next"),
    # Selective sharing (minikv.sharing) changes a registered block's key, never its K/V:
    Transition.PROMOTE: Edge((U, C), None, "on_promote", "promote", "every later request of every tenant"),
    Transition.ISOLATE: Edge((U, C), None, "on_isolate", "isolate", "its writer's later requests only"),
    # KV tiers (minikv.tiers): the K/V leave the pool sealed, and come back verified.
    Transition.OFFLOAD: Edge((C,), C, "on_offload", "offload", "the tier's readers, sealed: MAC + the domain's AEAD key"),
    Transition.ONLOAD: Edge((F,), C, "on_onload", "onload", "later requests of its domain, as a stored block"),
}
del F, U, C

#: The transitions that hand a block someone else wrote to another request: what isolation checks
#: watch.  An adoption crosses tenants exactly as a hit would (a shared cache adopts another
#: tenant's twin), so a check that looked at ``hit`` alone would miss it.
REUSES = (Transition.HIT, Transition.ADOPT)
#: Their audit-trail record kinds (what a reader of the JSONL trail filters on).
REUSE_RECORDS = tuple(LIFECYCLE[t].record for t in REUSES)


def crosses_tenants(tenants: Iterable[str | None], public: bool) -> bool:
    """Do ``tenants`` -- a block's writer and a reader, or all its holders -- span more than one
    tenant on a private block?  That is what isolation forbids; a block inside an
    operator-declared public prefix is meant to be shared.  (The anonymous tenant, None, is one
    tenant like the others.)"""
    return not public and len(set(tenants)) > 1


# ---------------------------------------------------------------- what a hit must match
class VerifyHits(Enum):
    """How much of a cached block's :class:`BlockIdentity` a hit must match before its K/V are
    reused.  A hash match alone is not proof: weak or unchained hashes collide (lesson 06).
    Values are the ``verify_hits`` spellings of ``EngineConfig`` (``True``, ``"tokens"``,
    ``False``); ``str()`` gives that spelling back."""

    IDENTITY = True  # tokens, parent block and isolation domain (default)
    TOKENS = "tokens"  # UNSAFE: tokens only (nano-vllm's check): blind to the context before
    NOTHING = False  # UNSAFE: trust the hash

    @classmethod
    def of(cls, value) -> "VerifyHits":
        """The member for a ``verify_hits`` setting (a member, True, False or "tokens")."""
        if isinstance(value, cls):
            return value
        if isinstance(value, bool) or value == "tokens":  # 1 or 1.0 == True: refused
            return cls(value)
        raise ValueError(f"verify_hits must be True, False or 'tokens', got {show(value)}")

    def __str__(self) -> str:
        return str(self.value)

    __format__ = object.__format__


@dataclass(frozen=True)
class BlockIdentity:
    """What a block's K/V were computed from, and so what a hit must match: its tokens, the
    block before it (``(block_id, generation)``: a recycled parent is a new block), and its
    isolation domain key (None inside a public prefix)."""

    tokens: tuple[int, ...]
    parent: tuple[int, int] | None
    domain: bytes | None

    def admits(self, wanted: "BlockIdentity", verify: VerifyHits) -> bool:
        """May a sequence that needs ``wanted`` reuse this cached block?"""
        if verify is VerifyHits.NOTHING:
            return True
        if verify is VerifyHits.TOKENS:
            return self.tokens == wanted.tokens
        return self == wanted


@dataclass(eq=False)
class Block:
    """One physical KV block's bookkeeping (the block manager keeps one per pool block)."""
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
