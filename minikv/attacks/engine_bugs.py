"""Deliberately buggy engine helpers: how stale K/V reaches the wrong reader (lesson 05).

The engine itself is correct; these helpers re-create two realistic bug classes on top of it,
for the lesson and its tests only.  They are kept apart from the inversion
(:mod:`minikv.attacks.kv_inversion`) because they answer a different question: not "what do
these bytes say?" but "how did an attacker get them?".

* :func:`unmasked_decode_attention` -- decode attention that forgets to mask the unwritten
  slots of a sequence's last block, so every decode step attends over whatever the block held
  before (patches ``minikv.engine.attention.context_mask`` for the duration of a ``with``);
  :func:`spray_stale_reads` is the attacker's move that exploits it;
* :class:`BuggyAbortBlockManager` / :func:`abort_recycles_held_blocks` -- an abort path that
  returns *every* block of the aborted request to the free list, even blocks another request
  still holds (the use-after-free class of bug).

:class:`StaleReadRecorder` records exactly which stale slots a decode read and the layer-0
bytes it read there, so a lesson can state precisely what the bug exposed.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..engine import attention as _attention
from ..engine.block_manager import BlockManager
from ..engine.lifecycle import Transition

__all__ = [
    "StaleRead", "StaleReadRecorder", "unmasked_decode_attention", "buggy_context_mask",
    "SprayResult", "spray_stale_reads", "BuggyAbortBlockManager", "abort_recycles_held_blocks",
]

# ====================================================================== bug 1: no mask


def buggy_context_mask(context_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """BUGGY stand-in for ``attention.context_mask``: every gathered slot is "valid".

    The author assumed a block only ever holds this sequence's tokens; the unwritten tail
    of a reused block (and the padding entries of the batch's block table) are read too.
    """
    return torch.ones(context_lens.shape[0], 1, 1, max_len, dtype=torch.bool, device=context_lens.device)


@dataclass
class StaleRead:
    """The stale slots one decoding sequence attended to in one step (layer 0)."""

    step: int
    request_id: str
    context_len: int
    slots: list[tuple[int, int]]  # (physical block id, slot) read past the sequence's length
    #                               (padding entries of the block table included)
    k: torch.Tensor  # [len(slots), kv_heads, head_dim]: the layer-0 K bytes it read there
    v: torch.Tensor


@dataclass
class StaleReadRecorder:
    """Records, for every decode step run under the bug, the slots past each sequence's length
    that attention consumed, with the layer-0 K/V bytes found there.

    Decode rows are matched to requests through the scheduler's running list (decodes come first,
    in order), which holds for every step without a preemption -- the lessons' setting.
    """

    engine: object
    reads: list[StaleRead] = field(default_factory=list)
    _pending: list = field(default_factory=list)

    def on_gather(self, layer: int, block_tables: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == 0:
            self._pending.append((block_tables.clone(), k.clone(), v.clone()))

    def on_mask(self, context_lens: torch.Tensor, max_len: int) -> None:
        if not self._pending:
            return
        tables, k, v = self._pending.pop()  # the decode gather is the last one of layer 0
        self._pending.clear()
        running = [s.request_id for s in self.engine.scheduler.running]
        bs, width = self.engine.block_size, tables.shape[1] * self.engine.block_size
        for row, n in enumerate(context_lens.tolist()):
            # every gathered slot past the sequence's length: the tail of its last block, and
            # whole padding blocks when a longer sequence widened the batch's block table
            slots = [(int(tables[row, p // bs]), p % bs) for p in range(n, width)]
            self.reads.append(StaleRead(self.engine.step_count, running[row], n, slots,
                                        k[row, n:width].clone(), v[row, n:width].clone()))


@contextlib.contextmanager
def unmasked_decode_attention(engine=None):
    """Run the engine with BUGGY decode attention that does not mask unwritten slots.

    Inside the ``with`` block, ``minikv.engine.attention.context_mask`` is replaced by
    :func:`buggy_context_mask`.  With ``engine`` given, yields a :class:`StaleReadRecorder`
    that logs what each decode read past its length; the engine is restored on exit.
    """
    original = _attention.context_mask
    recorder = StaleReadRecorder(engine) if engine is not None else None
    original_gather = engine.pool.gather if engine is not None else None

    def mask(context_lens, max_len):
        if recorder is not None:
            recorder.on_mask(context_lens, max_len)
        return buggy_context_mask(context_lens, max_len)

    def gather(layer, block_tables):
        k, v = original_gather(layer, block_tables)
        recorder.on_gather(layer, block_tables, k, v)
        return k, v

    _attention.context_mask = mask
    if engine is not None:
        engine.pool.gather = gather
    try:
        yield recorder
    finally:
        _attention.context_mask = original
        if engine is not None:
            del engine.pool.gather  # back to the class method


@dataclass
class SprayResult:
    """What ``n`` concurrent attacker requests got: their tokens, the logits of the decode step
    (the step whose attention read stale slots under the bug) and the recorded stale reads."""

    request_ids: list[str]
    token_ids: list[list[int]]
    decode_logits: torch.Tensor  # [n, vocab]
    reads: list[StaleRead]

    @property
    def k(self) -> torch.Tensor:
        """Layer-0 K bytes of every stale slot read, [slots, kv_heads, head_dim]."""
        return torch.cat([r.k for r in self.reads]) if self.reads else torch.zeros(0)

    @property
    def v(self) -> torch.Tensor:
        return torch.cat([r.v for r in self.reads]) if self.reads else torch.zeros(0)

    @property
    def slots(self) -> list[tuple[int, int]]:
        return [s for r in self.reads for s in r.slots]


def spray_stale_reads(engine, prompt_ids: list[int], n_requests: int, *, tenant: str | None = None,
                      buggy: bool = True) -> SprayResult:
    """The attacker's move: ``n_requests`` concurrent greedy requests of ``prompt_ids``, two
    output tokens each (``ignore_eos``), run to completion.

    With a prompt of exactly ``k * block_size`` tokens, each request's first decode token needs
    a fresh block: it writes slot 0 and, under :func:`unmasked_decode_attention` (``buggy``),
    attends over slots 1..block_size-1 -- whatever the block's previous owner left there.
    """
    from ..engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ids = [engine.new_request_id() for _ in range(n_requests)]
    saved, engine.logit_trace = engine.logit_trace, []
    ctx = unmasked_decode_attention(engine) if buggy else contextlib.nullcontext()
    done: dict[str, list[int]] = {}
    try:
        with ctx as recorder:
            for rid in ids:
                engine.add_request(rid, list(prompt_ids), params, tenant=tenant)
            while len(done) < n_requests:
                for out in engine.step():
                    if out.finished and out.request_id in ids:
                        done[out.request_id] = list(out.outputs[0].token_ids)
        per_req = {rid: [step[rid] for step in engine.logit_trace if rid in step] for rid in ids}
    finally:
        engine.logit_trace = saved
    logits = torch.stack([per_req[rid][-1] for rid in ids])
    reads = sorted(recorder.reads, key=lambda r: ids.index(r.request_id)) if recorder else []
    return SprayResult(ids, [done[rid] for rid in ids], logits, reads)


# ============================================================= bug 2: abort recycles held blocks


class BuggyAbortBlockManager(BlockManager):
    """BUGGY: on abort, every block of the request goes straight back to the free list.

    The abort path was written as if an aborted request owned its blocks exclusively.  A block
    shared with another running request (a prefix-cache hit) is recycled while that request
    still reads it: the next allocation hands the same physical block to a second owner.  This
    is the use-after-free class of bug (recycling memory that something still uses).
    Finishes and preemptions still take the correct path.
    """

    def free(self, seq) -> None:
        if seq.finish_reason != "abort":
            return super().free(seq)
        recycled = []
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            self.cached.pop(bid, None)
            if bid not in self.free_ids:
                self.free_ids.append(bid)  # BUG: ignores block.ref_count (other holders)
                recycled.append(bid)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._emit(Transition.FREE, recycled, seq)


@contextlib.contextmanager
def abort_recycles_held_blocks(engine):
    """Swap ``engine``'s block manager to :class:`BuggyAbortBlockManager` inside a ``with``.

    The engine's state is left as the bug made it (possibly inconsistent); use a throw-away
    engine.  On exit the correct class is restored for subsequent calls.
    """
    bm = engine.block_manager
    original = type(bm)
    bm.__class__ = BuggyAbortBlockManager
    try:
        yield bm
    finally:
        bm.__class__ = original
