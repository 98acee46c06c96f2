"""Exercise 3 (lesson 08): scrubbing KV blocks, at the right moment of their life.

A freed KV block keeps its previous owner's keys and values until something overwrites them,
and layer-0 K/V invert straight back to tokens (lessons 01 and 05).  A scrubber zeroes blocks
so that no request can ever be handed another request's leftovers.

* 3a ``zero_blocks`` -- zero exactly the given blocks, in every layer, K and V, with one
  indexed write per tensor (no Python loop over blocks: on a GPU, one kernel launch);
* 3b ``scrub_action`` -- *scrub placement*: for each block-lifecycle transition (the vocabulary
  of ``minikv.engine.lifecycle``: allocate, hit, adopt, store, cache, free, evict, promote,
  isolate),
  decide whether the engine must zero the blocks (``ZERO``) or keep them (``KEEP``).  The engine
  reaches those transitions on many paths -- a request that finishes, is preempted or aborted, an
  LRU or quota eviction, an operator's ``reset_prefix_cache`` -- and your decision must be right on
  all of them.  ``PlacedScrubber`` (given, ``minikv.grading.harness``) plugs your decision into
  the engine's ``Scrubber`` seam, so it runs inside the real engine;
* 3c ``sneaky_zero_blocks_a`` and ``_b`` -- *write the mutant*: two wrong ``zero_blocks`` that a
  colleague's quick test passes and 3a's grader catches, each for a different reason;
* 3d ``BudgetScrubber`` -- *an open design*: a scrubber that passes every stale-read check of 3b
  and meets a cost budget: it zeroes no more bytes than the workload requires, in no more writes
  than needed.  ``PlannedScrubber`` (given) asks it which blocks to zero on each event.

The pool tensors are ``pool.k_cache`` and ``pool.v_cache``, both shaped
``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.

Run it with ``scrubbed_llm("tiny-random", ...)`` (an ``LLM`` whose scrubber follows your
decision), 3d with ``budget_llm("tiny-random", ...)``.  Grade with ``check_zero_blocks``,
``check_scrub_placement``, ``check_written_mutants``, ``check_scrub_budget``, or ``make grade``.

The reference scrubbers live in ``minikv.security.scrub``: do not import them (the grader refuses
a file that does).
"""
from __future__ import annotations

import torch

from minikv.engine.lifecycle import LIFECYCLE, Transition  # the vocabulary: read its table
# The given plumbing: plugs your decision into the engine's Scrubber seam (no answer in it).
from minikv.grading.harness import KEEP, ZERO, PlacedScrubber, PlannedScrubber, placed_llm, planned_llm  # noqa: F401


def zero_blocks(pool, block_ids: list[int]) -> None:
    """Overwrite blocks ``block_ids`` of ``pool`` with zeros: every layer, both K and V.

    Contract:

    * afterwards ``pool.k_cache[:, b]`` and ``pool.v_cache[:, b]`` are all zeros for every
      ``b`` in ``block_ids`` (any order, possibly several blocks, possibly none);
    * every other block is untouched (other blocks hold other requests' live K/V, or cached
      prefixes that later requests will hit);
    * works on any object with ``k_cache`` / ``v_cache`` tensors: do not call
      ``pool.zero_blocks`` (that is the engine's own answer to this exercise).

    Stuck?  ``make hint EX=3a`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    ids = list(block_ids)
    if not ids:
        return  # nothing to zero: no kernel launch
    num_blocks = pool.k_cache.shape[1]
    bad = [b for b in ids if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_blocks]
    if bad:
        raise IndexError(f"block ids {bad} are not blocks of this pool (0..{num_blocks - 1})")
    # One indexed write per tensor along dim 1 (the block dimension), in place: every layer, K and V.
    idx = torch.as_tensor(ids, dtype=torch.long, device=pool.k_cache.device)
    pool.k_cache.index_fill_(1, idx, 0)
    pool.v_cache.index_fill_(1, idx, 0)
    # END SOLUTION


def sneaky_zero_blocks_a(pool, block_ids: list[int]) -> None:
    """Exercise 3c, "write the mutant" (first of two): a WRONG ``zero_blocks``.

    Contract, for both ``sneaky_zero_blocks_a`` and ``sneaky_zero_blocks_b``:

    * it passes a colleague's quick test of 3a, ``smoke_test`` in ``minikv/grading/written_mutants.py``
      (lesson 08 prints it): the bug would survive a code review that ran it;
    * 3a's grader, ``check_zero_blocks``, rejects it: it breaks a promise of 3a's contract;
    * it runs like a real ``zero_blocks`` on every list of block ids (empty, one, several, repeated):
      a crash is not a subtle bug;
    * the two are rejected for different bug classes (the grader prints the class it named).

    Stuck?  ``make hint EX=3c`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    ids = list(block_ids)
    if ids:  # the keys only: every value of the previous owner stays
        pool.k_cache[:, ids] = 0
    # END SOLUTION


def sneaky_zero_blocks_b(pool, block_ids: list[int]) -> None:
    """Exercise 3c, second mutant: see ``sneaky_zero_blocks_a`` for the contract."""
    # BEGIN SOLUTION
    ids = list(block_ids)
    if ids:  # "the ids of one request are consecutive": a slice, so every block in between goes too
        lo, hi = min(ids), max(ids) + 1
        pool.k_cache[:, lo:hi] = 0
        pool.v_cache[:, lo:hi] = 0
    # END SOLUTION


def scrub_action(transition: Transition, seq) -> str:
    """Should the blocks of this lifecycle event be zeroed (``ZERO``) or kept (``KEEP``)?

    ``transition`` is a :class:`~minikv.engine.lifecycle.Transition` (or its string value, e.g.
    ``"evict"``); ``seq`` is the request that caused it -- finished, still running (a preemption
    frees a running request's blocks), aborted (``seq.finish_reason == "abort"``) -- or ``None``
    when the operator evicts (``reset_prefix_cache``).

    Contract (the grader runs the real engine through every path):

    * at no moment may a request's block table hold nonzero K/V in a slot that request never wrote:
      a block must be zero by the time it is handed to a new owner without a cache hit, whichever
      path released it (finish, preemption, abort, LRU eviction, quota eviction, operator reset);
    * never destroy data that is still meant to be read: a running request's own K/V, a block
      stored in the prefix cache, a hit, an adopted twin (two requests with one prefix in one
      step: the second swaps its copy for the first's, which both now read).  Outputs must equal a
      cache-off engine's, and same-tenant hits must still happen (a scrubber that wipes every hit
      fails);
    * KV tiers (``LLM(kv_tiers=[...])``): a block sealed into a tier (``offload``) leaves no plaintext copy
      of its K/V in the pool once it is back on the free list, and a block copied back from a tier
      (``onload``) is data a request is about to read;
    * raises ``ValueError`` for anything that is not a lifecycle transition.

    Think about it with ``LIFECYCLE``: which rows put a block's old bytes within a NEW reader's
    reach, and which rows hand data to a reader who is meant to have it?

    Stuck?  ``make hint EX=3b`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    try:
        transition = Transition(transition)
    except ValueError:
        raise ValueError(f"not a block-lifecycle transition: {transition!r}; "
                         f"known: {', '.join(t.value for t in Transition)}") from None
    if transition in (Transition.FREE, Transition.EVICT):
        # On the way INTO the free list, whatever the cause (seq finished, preempted, aborted, or None
        # for an operator's reset): the data stops being reachable on purpose, so it dies now.
        return ZERO
    if transition is Transition.ALLOCATE:
        # Every block reaches the free list through FREE or EVICT, and the pool starts zeroed, so a
        # freshly allocated block is already clean: zeroing again would be safe, but twice the work.
        return KEEP
    if transition in (Transition.HIT, Transition.ADOPT, Transition.STORE, Transition.CACHE,
                      Transition.PROMOTE, Transition.ISOLATE):
        # Reuse is the point of the cache: a hit, an adopted twin (live in two block tables now), a
        # stored block, a block released INTO the cache and a re-keyed block all hold data that a
        # reader is meant to see.  (The duplicate an adoption lets go of leaves through FREE.)
        return KEEP
    if transition is Transition.OFFLOAD:
        # KV tiers: the block was just sealed into a tier and is about to be evicted; the tier holds
        # the only copy readers need, so the pool's plaintext dies now (as both safe scrubbers do).
        return ZERO
    if transition is Transition.ONLOAD:
        # KV tiers: verified K/V was just copied INTO this block for later hits: stored data, keep it.
        return KEEP
    raise ValueError(f"no scrub decision for transition {transition!r}")  # a new row: decide it first
    # END SOLUTION


def scrubbed_llm(*args, **kwargs):
    """``LLM(*args, **kwargs)`` whose scrubber runs YOUR placement (3b) with YOUR zeroing (3a)."""
    return placed_llm(scrub_action, zero_blocks, *args, **kwargs)


class BudgetScrubber:
    """Exercise 3d, an open design: a scrubber within a cost budget that never lets a stale read through.

    ``PlannedScrubber(BudgetScrubber(), zero)`` (given) calls ``plan`` on every block-lifecycle event
    of one engine (a fresh ``BudgetScrubber()`` per engine) and zeroes the blocks it returns, all of
    them in one indexed write per tensor, before the engine goes on.

    ``plan(transition, block_ids) -> list[int]``:

    * ``transition`` is the event's ``Transition`` value as a string (``"allocate"``, ``"free"``,
      ``"evict"``, ``"cache"``, ``"hit"``, ``"adopt"``, ``"store"``, ...: ``LIFECYCLE``'s rows), and
      ``block_ids`` its blocks;
    * returns the ids of the blocks to zero *now* (``[]`` for none); they may be any blocks of the
      pool, not only this event's.

    Contract (``check_scrub_budget`` runs 3b's eight engines with it, checks first, then the cost):

    * safety, as in 3b: no request is ever handed a block holding K/V it did not write, on any path
      (finish, preemption, abort, LRU and quota eviction, ``reset_prefix_cache``), and nothing still
      meant to be read is zeroed (outputs equal a cache-off engine's, same-tenant hits kept);
    * bytes: the blocks you zero add up to at most 1.00x the *required* ones -- a block is required
      each time it is handed to a new owner (``"allocate"``) after some request held it before;
    * writes: at most one per handover that needs a scrub (each write is one kernel launch per tensor);
    * deterministic: the same events give the same answers.

    Stuck?  ``make hint EX=3d`` (three levels, one per call).
    """

    def __init__(self):
        # BEGIN SOLUTION
        self.used: set[int] = set()  # blocks some request has held since they were last zeroed
        # END SOLUTION

    def plan(self, transition: str, block_ids: list[int]) -> list[int]:
        # BEGIN SOLUTION
        if transition == "allocate":
            # The last moment a block can be zeroed, and the only one where we know someone will read
            # it: zero the handed-over blocks that ever had an owner (a fresh pool is zeros already).
            # Blocks freed or evicted but never handed out again are never zeroed at all.
            stale = [b for b in block_ids if b in self.used]
            self.used.update(block_ids)  # the new owner writes them
            return stale
        if transition == "onload":
            self.used.update(block_ids)  # KV tiers: verified K/V copied into a free block
            return []
        if transition == "offload":
            # KV tiers: the sealed copy left for a tier; as minikv's scrubbers do, the plaintext dies now
            self.used.difference_update(block_ids)
            return list(block_ids)
        # free, evict, cache, hit, adopt, store, promote, isolate: nothing is handed to a new owner
        # (a hit or an adoption hands over data its reader is meant to have): zero nothing yet.
        return []
        # END SOLUTION


def budget_llm(*args, **kwargs):
    """``LLM(*args, **kwargs)`` whose scrubber asks a fresh ``BudgetScrubber`` (3d) what to zero."""
    return planned_llm(BudgetScrubber(), *args, **kwargs)
