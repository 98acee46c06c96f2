"""Exercise 3d's mutants: budget scrubbers (``plan(transition, block_ids)``) that are unsafe or over budget.

Each is a design someone would defend in a review: minikv's own two safe scrubbers (both over the
budget, each for its own reason), lazy designs that remember too little, and an eager one that
wipes what the cache still serves.
"""
from __future__ import annotations

from ._table import entries


class _Ledger:
    """The bookkeeping four of these designs share: a set of blocks that may hold old K/V, and the
    lazy half of the job, zeroing the marked blocks of an allocation (and only those)."""

    def __init__(self):
        self.dirty: set[int] = set()

    def take(self, block_ids) -> list[int]:
        out = [b for b in block_ids if b in self.dirty]
        self.dirty.difference_update(block_ids)
        return out


class BudgetEagerOnFree:
    """minikv's ``ScrubOnFree`` as a planner: zero every block on its way into the free list (freed
    or evicted).  Safe, but it pays for blocks that nobody allocates again."""

    def plan(self, transition, block_ids):
        return list(block_ids) if transition in ("free", "evict") else []


class BudgetEveryAlloc:
    """minikv's ``ScrubOnAlloc`` as a planner: zero every block handed out.  Safe, but a fresh pool is
    already zero: its first handover of each block is a wasted write."""

    def plan(self, transition, block_ids):
        return list(block_ids) if transition == "allocate" else []


class BudgetCachedOnly(_Ledger):
    """Lazy, remembering only blocks released into the prefix cache ("only the cache keeps old data
    around"): a block freed without being cached -- a finished request's partial block, any block
    with caching off, a preempted or aborted request's -- is handed out again unscrubbed."""

    def plan(self, transition, block_ids):
        if transition == "cache":
            self.dirty.update(block_ids)
        return self.take(block_ids) if transition == "allocate" else []


class BudgetWipeOnCache:
    """Lazy on allocation, plus "a finished request's data is dead": zero blocks released INTO the
    cache.  The next same-tenant request hits them and reads zeros: its outputs change."""

    def __init__(self):
        self.used: set[int] = set()

    def plan(self, transition, block_ids):
        if transition == "cache":
            return list(block_ids)
        if transition == "allocate":
            out = [b for b in block_ids if b in self.used]
            self.used.update(block_ids)
            return out
        return []


class BudgetZeroEachEviction(_Ledger):
    """Exact bytes by a different road: an evicted block is zeroed the moment it is evicted (an
    LRU eviction happens only because an allocation needs the block, so it is reused at once), a
    freed one on allocation.  But evictions come one block at a time: a write per evicted block."""

    def plan(self, transition, block_ids):
        if transition == "evict":
            self.dirty.difference_update(block_ids)
            return list(block_ids)
        if transition == "free":
            self.dirty.update(block_ids)
        return self.take(block_ids) if transition == "allocate" else []


class BudgetMarkOnRelease(_Ledger):
    """CORRECT, by another road than the reference: remember a block as dirty when it goes back to
    the free list (freed or evicted), zero the dirty ones when they are handed out.  Every block
    that can hold old K/V reaches the free list through one of those two rows, so it is as exact."""

    def plan(self, transition, block_ids):
        if transition in ("free", "evict"):
            self.dirty.update(block_ids)
        return self.take(block_ids) if transition == "allocate" else []


MUTANTS = {
    "3d": entries(("eager-on-free", BudgetEagerOnFree), ("every-alloc", BudgetEveryAlloc),
                  ("cached-only", BudgetCachedOnly), ("wipe-on-cache", BudgetWipeOnCache),
                  ("zero-each-eviction", BudgetZeroEachEviction)),
}

#: mutant -> the words its grader's verdict must contain (the bug class it names)
DIAGNOSES = {
    ("3d", "eager-on-free"): "zeroes blocks nobody reuses", ("3d", "every-alloc"): "zeroes never-used blocks",
    ("3d", "cached-only"): "not scrubbed when a request finishes", ("3d", "wipe-on-cache"): "destroys live data",
    ("3d", "zero-each-eviction"): "too many writes",
}

#: correct designs that differ from the reference only in method: the grader must ACCEPT them
NEGATIVE_CONTROLS = {"3d": entries(("mark-on-release", BudgetMarkOnRelease))}
