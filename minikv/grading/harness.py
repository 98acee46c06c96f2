"""The given half of exercise 3b: a ``Scrubber`` driven by a learner's placement decision.

The engine calls one scrubber hook per block-lifecycle transition (``LIFECYCLE[t].hook``) with
``(pool, block_ids)`` only.  A placement decision needs to know *which* transition fired, and
*why* (the request that caused it: finished, preempted, aborted -- or None for an operator's
``reset_prefix_cache``), so :meth:`PlacedScrubber.attach` also registers a block-manager listener
that runs just before the engine's own dispatch and remembers the event.  Then every hook asks
``action(transition, seq)`` and zeroes the blocks when it answers ``"zero"``.

This module is the one part of ``minikv.grading`` an exercise file may import (the grading
gate, :mod:`.guard`, allows it): it contains no answer, only the plumbing.
"""
from __future__ import annotations

from typing import Callable

from ..engine.lifecycle import LIFECYCLE

ZERO, KEEP = "zero", "keep"


class PlacedScrubber:
    """``PlacedScrubber(action, zero)``: the engine's ``Scrubber`` seam, every hook of ``LIFECYCLE``.

    ``action(transition, seq) -> "zero" | "keep"`` decides; ``zero(pool, block_ids)`` zeroes (your
    ``zero_blocks`` of exercise 3a).  Build the engine with it, then attach it::

        scrubber = PlacedScrubber(scrub_action, zero_blocks)
        llm = LLM("tiny-random", scrubber=scrubber)
        scrubber.attach(llm.engine)
    """

    def __init__(self, action: Callable, zero: Callable):
        self.action, self.zero = action, zero
        self._event = None  # (transition, seq) of the event being dispatched
        self.zeroed: dict[str, int] = {}  # transition -> blocks zeroed (what the lessons print)

    def attach(self, engine) -> "PlacedScrubber":
        if engine.scrubber is not self:
            raise ValueError("attach the scrubber to the engine built with it: LLM(..., scrubber=this)")
        engine.block_manager.listeners.insert(0, self._remember)
        return self

    def _remember(self, transition, ids, seq) -> None:
        self._event = (transition, seq)

    def _apply(self, hook: str, pool, block_ids) -> None:
        if self._event is None or LIFECYCLE[self._event[0]].hook != hook:
            raise RuntimeError(f"{hook} called without its lifecycle event: call attach(engine) first")
        transition, seq = self._event
        if self.action(transition, seq) == ZERO:
            self.zero(pool, list(block_ids))
            self.zeroed[str(transition)] = self.zeroed.get(str(transition), 0) + len(block_ids)

    def on_alloc(self, pool, block_ids):
        self._apply("on_alloc", pool, block_ids)

    def on_free(self, pool, block_ids):
        self._apply("on_free", pool, block_ids)

    def on_hit(self, pool, block_ids):
        self._apply("on_hit", pool, block_ids)

    def on_store(self, pool, block_ids):
        self._apply("on_store", pool, block_ids)

    def on_cache(self, pool, block_ids):
        self._apply("on_cache", pool, block_ids)

    def on_promote(self, pool, block_ids):
        self._apply("on_promote", pool, block_ids)

    def on_isolate(self, pool, block_ids):
        self._apply("on_isolate", pool, block_ids)

    def on_offload(self, pool, block_ids):
        self._apply("on_offload", pool, block_ids)

    def on_onload(self, pool, block_ids):
        self._apply("on_onload", pool, block_ids)


class PlannedScrubber(PlacedScrubber):
    """``PlannedScrubber(planner, zero)``: exercise 3d's plumbing.  On every lifecycle event it asks
    ``planner.plan(transition, block_ids)`` (the transition's string value and the event's block ids,
    as data) which blocks to zero *now*, and zeroes them with ``zero(pool, ids)``: one indexed write
    per tensor, however many blocks.  The planner may name any blocks of the pool, not only the
    event's (a deferred design zeroes blocks it remembered earlier).  ``writes`` counts the calls
    that zeroed something, ``blocks`` the distinct blocks they zeroed; ``observer(ids)``, when set,
    sees every write (the 3d grader's cost meter).  Attach it like ``PlacedScrubber``."""

    def __init__(self, planner, zero: Callable):
        super().__init__(None, zero)
        self.planner, self.writes, self.blocks, self.observer = planner, 0, 0, None

    def _apply(self, hook: str, pool, block_ids) -> None:
        if self._event is None or LIFECYCLE[self._event[0]].hook != hook:
            raise RuntimeError(f"{hook} called without its lifecycle event: call attach(engine) first")
        got = self.planner.plan(str(self._event[0]), list(block_ids))
        ids = sorted(set(_block_ids(got, pool.k_cache.shape[1])))
        if ids:
            self.zero(pool, ids)
            self.writes, self.blocks = self.writes + 1, self.blocks + len(ids)
            if self.observer is not None:
                self.observer(ids)


def _block_ids(got, num_blocks: int) -> list[int]:
    """``plan``'s answer as block ids; TypeError/IndexError for anything else (a clear failure)."""
    if got is None or isinstance(got, (str, bytes)) or not hasattr(got, "__iter__"):
        raise TypeError(f"plan() must return a list of block ids, got {type(got).__name__}")
    ids = list(got)
    bad = [b for b in ids if isinstance(b, bool) or not isinstance(b, int) or not 0 <= b < num_blocks]
    if bad:
        raise IndexError(f"plan() returned {bad[:3]}: not blocks of this pool (0..{num_blocks - 1})")
    return ids


def planned_llm(planner, *args, **kwargs):
    """``LLM(*args, **kwargs)`` whose scrubber is ``PlannedScrubber(planner, <minikv's zero_blocks>)``."""
    from ..llm import LLM
    from ..security.scrub import zero_blocks

    scrubber = PlannedScrubber(planner, zero_blocks)
    llm = LLM(*args, scrubber=scrubber, **kwargs)
    scrubber.attach(llm.engine)
    return llm


def placed_llm(action: Callable, zero: Callable, *args, **kwargs):
    """``LLM(*args, **kwargs)`` whose scrubber is ``PlacedScrubber(action, zero)``, attached."""
    from ..llm import LLM

    scrubber = PlacedScrubber(action, zero)
    llm = LLM(*args, scrubber=scrubber, **kwargs)
    scrubber.attach(llm.engine)
    return llm
