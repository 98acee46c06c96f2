"""Grader for exercise 3d: a scrubber that meets a cost budget and never lets a stale read through.

3a wrote the zeroing and 3b decided where in the block lifecycle it goes.  Both safe answers of 3b
still do work nobody needed: zeroing on allocation wipes the blocks of a fresh pool, which hold
nothing; zeroing on free wipes blocks that no one ever allocates again.  3d asks for a scrubber
that does only the work the workload *requires*, and stays safe on every path.

The learner writes a *planner*, ``BudgetScrubber``: on every lifecycle event the given
:class:`~minikv.grading.harness.PlannedScrubber` asks ``plan(transition, block_ids)`` which blocks
to zero now, and zeroes them in one indexed write per tensor.  The grader runs it through the
same eight engines as 3b (:func:`~minikv.grading.scrub_placement.engine_stage`: finish, preempt,
abort, LRU and quota eviction, ``reset_prefix_cache``, a multi-tenant workload with hits, an
adoption), so every stale-read and live-data check of 3b applies first.  Meanwhile a
:class:`CostMeter` on each engine counts, deterministically (no clock anywhere):

* **required** blocks: each time a block is handed to a new owner (``allocate``) after *someone*
  held it before -- the blocks that would carry old K/V to a new reader if nobody scrubbed.  This
  depends on the workload only, never on the scrubber;
* **zeroed** blocks: the distinct blocks of every write the scrubber made, and the **writes**
  (one per call that zeroed something: on a GPU, one kernel launch per tensor).

The budget (:data:`BYTES_BOUND`, and writes at most one per handover that needs one): bytes
zeroed at most 1.00x the bytes of the required blocks, and no more writes than handovers that
need a scrub.  Since every required block must be zeroed before its handover (the stale-read
checks), 1.00x means *no wasted write at all*, and the verdict names where waste went: blocks
never used (a fresh pool is zeros), blocks zeroed again before anyone used them, or blocks zeroed
that nobody received afterwards.  Timing is measured in lesson 08, never graded.
"""
from __future__ import annotations

import functools

from ..engine.lifecycle import Transition
from ..security.scrub import zero_blocks as ref_zero_blocks
from ._report import call_safely, expect, grader
from .harness import PlannedScrubber
from .scrub_placement import engine_stage

BYTES_BOUND = 1.00  #: bytes zeroed / bytes of the required blocks, at most


class CostMeter:
    """Block-manager listener (after the engine's scrub) plus the scrubber's write observer.

    ``owned``: blocks some request has held since the pool was created; ``pending``: blocks zeroed
    since their last owner and not yet handed to a new one.  Waste is counted per zeroed block:
    ``pristine`` (nobody ever held it), ``again`` (already zeroed since its last owner) and, at the
    end, ``unreused`` (zeroed, then never handed to anyone).
    """

    def __init__(self, engine):
        self.owned: set[int] = set()
        self.pending: set[int] = set()
        self.required = self.handovers = self.zeroed = self.writes = 0
        self.waste = dict(pristine=0, again=0)
        engine.block_manager.listeners.append(self)
        engine.scrubber.observer = self.on_write
        self.block_bytes = 2 * engine.pool.k_cache[:, 0].numel() * engine.pool.k_cache.element_size()

    def on_write(self, ids: list[int]) -> None:
        self.writes += 1
        self.zeroed += len(ids)
        for b in ids:
            if b not in self.owned:
                self.waste["pristine"] += 1
            elif b in self.pending:
                self.waste["again"] += 1
            else:
                self.pending.add(b)

    def __call__(self, transition, ids, seq) -> None:
        if transition in (Transition.ALLOCATE, Transition.ONLOAD):
            needed = [b for b in ids if b in self.owned] if transition == Transition.ALLOCATE else []
            self.required += len(needed)
            self.handovers += bool(needed)
            self.pending.difference_update(ids)
            self.owned.update(ids)  # the new owner (or the onloaded K/V) writes it


def _total(meters: list[CostMeter]) -> dict:
    """The meters of every engine, summed."""
    t = dict(required=0, handovers=0, zeroed=0, writes=0, pristine=0, again=0, unreused=0)
    for m in meters:
        t["required"] += m.required
        t["handovers"] += m.handovers
        t["zeroed"] += m.zeroed
        t["writes"] += m.writes
        t["pristine"] += m.waste["pristine"]
        t["again"] += m.waste["again"]
        t["unreused"] += len(m.pending)
    t["block_bytes"] = meters[0].block_bytes
    return t


def measure(planner_class) -> tuple[dict, int]:
    """Run ``planner_class`` (a fresh instance per engine) through the eight engines of 3b's engine
    stage, checks included (raises :class:`CheckFailed` on a stale read or destroyed data).
    Returns (summed cost, cached tokens of the hit workload)."""
    meters: list[CostMeter] = []
    cached, _ = engine_stage(lambda: PlannedScrubber(planner_class(), ref_zero_blocks),
                             lambda eng: meters.append(CostMeter(eng)))
    return _total(meters), sum(cached)


@functools.lru_cache(maxsize=1)
def reference_cost() -> dict:
    """The cost of the course's reference design (a planner that zeroes, on allocation, exactly
    the blocks that had an owner), measured once."""
    return measure(_Reference)[0]


class _Reference:
    """The reference design, kept here so the grader never imports solutions/."""

    def __init__(self):
        self.used: set[int] = set()

    def plan(self, transition: str, block_ids: list[int]) -> list[int]:
        if transition == "allocate":
            out = [b for b in block_ids if b in self.used]
            self.used.update(block_ids)
            return out
        if transition == "onload":
            self.used.update(block_ids)
        return []


def score_line(cost: dict) -> str:
    """``bytes zeroed 1.00x of required (...), writes 31 (budget <= 31)``: what the check prints."""
    ratio = cost["zeroed"] / cost["required"]
    return (f"bytes zeroed {ratio:.2f}x of required ({cost['zeroed']} of {cost['required']} blocks of "
            f"{cost['block_bytes']} B; budget <= {BYTES_BOUND:.2f}x), writes {cost['writes']} "
            f"(budget <= {cost['handovers']}, one per handover that needs a scrub)")


#: waste kind -> (what the verdict says, its bug class)
WASTE = {"pristine": ("blocks nobody had ever held (a fresh pool is already zero)", "zeroes never-used blocks"),
         "again": ("blocks zeroed again before anyone used them", "zeroes the same block twice"),
         "unreused": ("blocks zeroed that nobody received afterwards", "zeroes blocks nobody reuses")}


def over_budget(cost: dict) -> list[tuple[str, str]]:
    """Every bound ``cost`` breaks, as (what, bug class): bytes first (one entry per kind of waste),
    then writes.  Empty when the budget is met."""
    out = []
    if cost["zeroed"] > BYTES_BOUND * cost["required"]:
        out += [(f"{cost[k]} {what}", cls) for k, (what, cls) in WASTE.items() if cost[k]]
        out = out or [(f"{cost['zeroed'] - cost['required']} block writes more than required", "over the bytes budget")]
    if cost["writes"] > cost["handovers"]:
        out.append((f"{cost['writes']} writes where {cost['handovers']} suffice (each a kernel launch per tensor: "
                    "the blocks of one handover belong in one write)", "too many writes"))
    return out


@grader("which blocks can hold old K/V when they are handed over, and which writes would happen even if "
        "nobody ever read those bytes again?")
def check_scrub_budget(BudgetScrubber) -> str:
    """Exercise 3d: safe on every path (3b's engine checks), within the cost budget."""
    planner, exc = call_safely(BudgetScrubber)
    expect(exc is None, f"BudgetScrubber() raised {type(exc).__name__}: {exc}",
           "the constructor takes no arguments: one planner per engine.")
    _, exc = call_safely(planner.plan, "allocate", [0, 1])
    expect(exc is None, f"BudgetScrubber().plan('allocate', [0, 1]) raised {type(exc).__name__}: {exc}",
           "plan(transition, block_ids) returns a list of block ids to zero now ([] for none).")
    cost, cached = measure(BudgetScrubber)
    ref = reference_cost()
    line = score_line(cost)
    over = over_budget(cost)
    expect(not over, f"{line}: over budget -- " + "; ".join(what for what, _ in over)
           + f" (bug class: {'; '.join(cls for _, cls in over)})",
           "which blocks can hold old K/V at the moment a new owner receives them?  Zero those, then, together, "
           "and nothing else.")
    return (f"no stale read on any path (finish, preempt, abort, lru, quota, reset), outputs equal to a cache-off "
            f"engine, {cached} same-tenant cached tokens kept; {line}; reference "
            f"{ref['zeroed'] / ref['required']:.2f}x, {ref['writes']} writes")


__all__ = ["check_scrub_budget", "CostMeter", "measure", "reference_cost", "score_line", "BYTES_BOUND"]
