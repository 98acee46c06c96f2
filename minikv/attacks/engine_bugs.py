"""Deliberately buggy engine helpers: how stale K/V reaches the wrong reader (lesson 05).

The engine itself is correct; these helpers re-create two realistic bug classes on top of it,
for the lesson and its tests only.  They are kept apart from the inversion
(:mod:`minikv.attacks.kv_inversion`) because they answer a different question: not "what do
these bytes say?" but "how did an attacker get them?".

* :func:`unmasked_decode_attention` -- decode attention that forgets to mask the unwritten
  slots of a sequence's last block, so every decode step attends over whatever the block held
  before (:func:`buggy_context_mask`, installed with ``LLMEngine.set_decode_mask`` for the
  duration of a ``with``); :func:`spray_stale_reads` is the attacker's move that exploits it;
* :func:`buggy_abort_release` / :func:`abort_recycles_held_blocks` -- an abort path that
  returns *every* block of the aborted request to the free list, even blocks another request
  still holds (the use-after-free class of bug), installed with ``LLMEngine.set_abort_release``.

:class:`StaleReadRecorder` records exactly which stale slots a decode read and the layer-0
bytes it read there (``LLMEngine.set_kv_read_observer``), so a lesson can state precisely what
the bug exposed.

Only the engine's documented test-only seams (``minikv/engine/seams.py``) and public state are
used; no engine function is patched.  The seams warn when installed (``SeamWarning``); these
helpers install them on purpose, so they silence that warning while they do.
"""
from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field

import torch

from ..engine.block_manager import BlockManager
from ..engine.lifecycle import Transition
from ..engine.seams import SeamWarning

__all__ = [
    "StaleRead", "StaleReadRecorder", "unmasked_decode_attention", "buggy_context_mask",
    "SprayResult", "spray_stale_reads", "buggy_abort_release", "abort_recycles_held_blocks",
]


@contextlib.contextmanager
def _seams(engine, **installed):
    """Install ``engine.set_<name>(fn)`` for each ``name=fn`` inside a ``with``; put back what was
    there before on exit.  The helpers mean it, so the seams' warning is silenced here."""
    before = {name: getattr(engine, name) for name in installed}

    def put(values):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", SeamWarning)
            for name, fn in values.items():
                getattr(engine, f"set_{name}")(fn)
    put(installed)
    try:
        yield
    finally:
        put(before)

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

    def on_decode_read(self, layer: int, tables: torch.Tensor, context_lens: torch.Tensor,
                       k: torch.Tensor, v: torch.Tensor) -> None:
        """The engine's KV-read observer (``LLMEngine.set_kv_read_observer``): one decode gather."""
        if layer != 0:
            return
        running = [s.request_id for s in self.engine.scheduler.running]
        bs, width = self.engine.block_size, tables.shape[1] * self.engine.block_size
        for row, n in enumerate(context_lens.tolist()):
            # every gathered slot past the sequence's length: the tail of its last block, and
            # whole padding blocks when a longer sequence widened the batch's block table
            slots = [(int(tables[row, p // bs]), p % bs) for p in range(n, width)]
            self.reads.append(StaleRead(self.engine.step_count, running[row], n, slots,
                                        k[row, n:width].clone(), v[row, n:width].clone()))


@contextlib.contextmanager
def unmasked_decode_attention(engine):
    """Run ``engine`` with BUGGY decode attention that does not mask unwritten slots.

    Inside the ``with`` block, the engine's decode mask is :func:`buggy_context_mask`
    (``engine.set_decode_mask``), and the block yields a :class:`StaleReadRecorder` that logs
    what each decode read past its length (``engine.set_kv_read_observer``).  On exit both
    seams are removed: the engine is correct again.
    """
    recorder = StaleReadRecorder(engine)
    with _seams(engine, decode_mask=buggy_context_mask, kv_read_observer=recorder.on_decode_read):
        yield recorder


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


def buggy_abort_release(bm: BlockManager, seq) -> None:
    """BUGGY: release an aborted request's blocks as if it were their only holder."""
    recycled = []
    for bid in reversed(seq.block_table):
        block = bm.blocks[bid]
        block.ref_count -= 1
        bm.cached.pop(bid, None)
        if bid not in bm.free_ids:
            bm.free_ids.append(bid)  # BUG: ignores block.ref_count (other holders)
            recycled.append(bid)
    seq.block_table = []
    seq.num_computed_tokens = 0
    bm.emit(Transition.FREE, recycled, seq)


@contextlib.contextmanager
def abort_recycles_held_blocks(engine):
    """Run ``engine`` with :func:`buggy_abort_release` as its abort path inside a ``with``
    (``engine.set_abort_release``); yields the engine's block manager.

    The abort path was written as if an aborted request owned its blocks exclusively.  A block
    shared with another running request (a prefix-cache hit) is recycled while that request
    still reads it: the next allocation hands the same physical block to a second owner.  This
    is the use-after-free class of bug (recycling memory that something still uses).  Finishes
    and preemptions still take the correct path.

    The engine's state is left as the bug made it (possibly inconsistent); use a throw-away
    engine.  On exit the seam is removed: later aborts take the correct path again.
    """
    with _seams(engine, abort_release=buggy_abort_release):
        yield engine.block_manager
