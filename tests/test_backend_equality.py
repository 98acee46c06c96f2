"""Every attention backend computes what the reference backend computes, and writes only its slots.

Two engines with the same weights, the reference backend and one other, run one schedule in
lockstep.  The schedule covers every kind of step an engine makes: fresh prefills, a decode-only
step, a mixed step (a prefill beside decodes), prefix hits (beside decodes and alone), a pool so
tight that sequences are preempted and recomputed, and ``score``.  After every step:

* logits: every sampled row within ``TOL`` of the reference row's largest absolute logit (fp32;
  ``tests/test_attention_fused.py``'s tolerance);
* greedy tokens: identical;
* the pool: the slots the step had to write are the positions each scheduled sequence computed
  (``num_computed_tokens`` up to its length, through its block table), read from the scheduler's
  batch.  There each K and V must be within ``TOL`` of the largest K (V) the reference wrote
  (``tests/test_cuda_graphs.py``'s pool tolerance: from the second layer on K/V depend on
  attention, which backends sum in different orders).  Every other slot of every block, free or
  owned, must hold the very bytes it held before the step.  A backend that writes outside its
  slots -- a padded row, an off-by-one slot, a scratch copy in a real block -- leaks one request's
  K/V into another's block; a logit comparison alone never sees it.

The "before" copy is taken when the scheduler returns: allocation (and its ``on_alloc`` scrub)
is done, the forward pass has not started.  ``score`` borrows blocks for one forward pass; its
written slots are those blocks.

Backends come from the registry, so a new one is covered the day it is registered; one this
machine cannot run (``cpu_kernels`` needs them built, ``triton`` CUDA) is skipped with the
engine's own reason.  The CUDA-graph runners and the Triton kernel also run on the CPU through
their stand-ins, as their own tests run them: the runners with the ``"eager"`` capture strategy,
the kernel in Triton's interpreter (``make triton``), in a subprocess so that this process never
imports Triton.  The tests whose id names ``cuda`` run on a GPU (``make gpu-check`` runs them).
"""
from __future__ import annotations

import random
import sys
import warnings
from pathlib import Path

import pytest
import torch

from minikv import LLM
from minikv.backends import BACKENDS
from minikv.engine import SamplingParams

ROOT = Path(__file__).resolve().parent.parent
TOL = 1e-4
REFERENCE = "reference"
MUST_SEE = {"fresh prefill", "decode", "mixed", "prefix hit", "recompute", "score"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _variants(device: str) -> list[str]:
    """Every registered backend but the reference, plus the graph runners (on the CPU their eager
    stand-ins; on CUDA the fused backend replays real graphs by default, so ``eager`` is the
    fused backend without them)."""
    extra = ["graphs-stand-in"] if device == "cpu" else ["fused-eager"]
    return [b for b in BACKENDS if b != REFERENCE] + extra


PARAMS = [pytest.param(d, v, id=f"{d}-{v}", marks=[needs_cuda] if d == "cuda" else [])
          for d in ("cpu", "cuda") for v in _variants(d)]


# --- the engines ------------------------------------------------------------------------------------

def reference_engine(device: str):
    """fp32 tiny-random with the default 16-token blocks (the Triton kernel's smallest) and 20 of
    them, so that the preemption phase overflows the pool; contexts of at most 128 tokens keep
    the graph runners' buckets few."""
    return LLM("tiny-random", device=device, dtype="float32", attention_backend=REFERENCE, block_size=16,
               num_blocks=20, max_num_seqs=8, max_model_len=128, enable_prefix_caching=True)


def variant_engine(ref: LLM, device: str, variant: str):
    """The engine under test, sharing ``ref``'s weights; skips with the engine's reason when this
    machine cannot run ``variant``."""
    if variant == "graphs-stand-in":
        return _graph_stand_ins(ref.fork(attention_backend="fused", enforce_eager=True).engine)
    if variant == "fused-eager":
        return ref.fork(attention_backend="fused", enforce_eager=True).engine
    try:
        return ref.fork(attention_backend=variant).engine
    except (ValueError, RuntimeError) as exc:  # the registry refuses it here, and says why
        pytest.skip(f"{variant} on {device}: {exc}")


def _graph_stand_ins(engine):
    """The decode and prefill graph runners forced into a CPU engine with the ``"eager"`` capture
    strategy (the captured function is called on every replay), as tests/test_cuda_graphs.py and
    tests/test_prefill_graphs.py do."""
    from minikv.backends.cuda_graphs import DecodeGraphRunner
    from minikv.backends.prefill_graphs import PrefillGraphRunner

    engine.backend.graphs = DecodeGraphRunner(engine, capture="eager")
    engine.backend.prefill_graphs = PrefillGraphRunner(engine, capture="eager")
    return engine


# --- what a step wrote --------------------------------------------------------------------------------

class PoolWatch:
    """Hooks ``engine``'s scheduler: when it returns a batch, records the slots the step must
    write, the schedule (to compare engines) and the step's kinds, and copies the pool."""

    def __init__(self, engine):
        self.engine, self.pool, self.bs = engine, engine.pool, engine.block_size
        self.before = self.slots = self.schedule = None
        self.kinds: set[str] = set()
        schedule = engine.scheduler.schedule

        def watched():
            batch = schedule()
            self.record(batch.prefills, batch.decodes)
            return batch
        engine.scheduler.schedule = watched

    def record(self, prefills, decodes) -> None:
        self.before = self.copy()
        self.schedule = [(s.request_id, tuple(s.block_table), s.num_computed_tokens, s.num_tokens)
                         for s in prefills + decodes]
        self.slots = [s.block_table[p // self.bs] * self.bs + p % self.bs
                      for s in prefills + decodes for p in range(s.num_computed_tokens, s.num_tokens)]
        for s in prefills:
            self.kinds.add("recompute" if s.num_preemptions else "prefix hit" if s.num_computed_tokens else "fresh prefill")
        if decodes:
            self.kinds.add("mixed" if prefills else "decode")

    def copy(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.pool.k_cache.clone(), self.pool.v_cache.clone()

    def score(self, ids: list[int]) -> torch.Tensor:
        """``engine.score(ids)``, recording the blocks it borrowed as its written slots."""
        bm, tables = self.engine.block_manager, []
        allocate = bm.allocate

        def recorded(seq):
            ok = allocate(seq)
            tables.append(list(seq.block_table))
            return ok
        bm.allocate = recorded
        self.before = self.copy()
        try:
            logits = self.engine.score(ids)
        finally:
            del bm.allocate  # the instance attribute goes; the method is back
        self.slots = [b * self.bs + i for b in tables[0] for i in range(self.bs)]
        self.schedule = [("score", tuple(tables[0]), 0, len(ids))]
        self.kinds.add("score")
        return logits


def _slots_view(t: torch.Tensor) -> torch.Tensor:
    """[layers, blocks, bs, heads, D] -> [layers, slots, heads * D]."""
    return t.reshape(t.shape[0], t.shape[1] * t.shape[2], -1)


def check_pool(ref: PoolWatch, eng: PoolWatch, label: str) -> None:
    """After one step: ``eng`` changed no byte outside the step's slots, and wrote there what the
    reference wrote (within TOL of the largest value the reference wrote)."""
    assert eng.schedule == ref.schedule, f"{label}: the engines scheduled differently: {eng.schedule} vs {ref.schedule}"
    for name, i in (("K", 0), ("V", 1)):
        now_r, now_e = _slots_view(ref.copy()[i]), _slots_view(eng.copy()[i])
        written = torch.zeros(now_r.shape[1], dtype=torch.bool, device=now_r.device)
        written[ref.slots] = True
        for who, watch, now in ((REFERENCE, ref, now_r), ("backend", eng, now_e)):
            before = _slots_view(watch.before[i])
            changed = (now.view(torch.uint8) != before.view(torch.uint8)).any(-1).any(0) & ~written
            if changed.any():
                slots = changed.nonzero().flatten().tolist()
                where = [(s // watch.bs, s % watch.bs) for s in slots[:6]]
                raise AssertionError(f"{label}: the {who} wrote {name} outside its slots: {len(slots)} slots "
                                     f"(block, offset) {where}, the step's were {sorted(ref.slots)[:12]}...")
        want, got = now_r[:, written], now_e[:, written]
        err, scale = (got - want).abs().max().item(), want.abs().max().item()
        assert err <= TOL * scale, f"{label}: {name} in the written slots differs by {err:.3e} (> {TOL} x {scale:.3e})"


def check_rows(trace_r: dict, trace_e: dict, label: str) -> None:
    assert sorted(trace_r) == sorted(trace_e), f"{label}: different rows sampled"
    for rid, row in trace_r.items():
        err = (row - trace_e[rid]).abs().max().item()
        assert err <= TOL * row.abs().max().item(), f"{label}: {rid}'s logits differ by {err:.3e}"


# --- the schedule -------------------------------------------------------------------------------------

def lockstep(ref, eng, on_step=None) -> set[str]:
    """Drive both engines through the schedule, checking after every step; returns the kinds of
    step the reference made.  ``on_step(engine, watch)`` runs after each step of ``eng``, before
    the checks (the negative tests corrupt the pool there)."""
    watches = PoolWatch(ref), PoolWatch(eng)
    for e in (ref, eng):
        e.logit_trace = []
    rng = random.Random(0)
    vocab = ref.model.shape.vocab_size

    def tokens(n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    def add(rid, prompt, max_tokens=8):
        for e in (ref, eng):
            e.add_request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    def step(label):
        outs = []
        for e, w in zip((ref, eng), watches):
            out = e.step()
            if e is eng and on_step is not None:
                on_step(e, w)
            outs.append([(o.request_id, list(o.outputs[0].token_ids), o.finished) for o in out])
        assert outs[0] == outs[1], f"{label}: greedy tokens differ: {outs[0]} vs {outs[1]}"
        check_rows(ref.logit_trace[-1], eng.logit_trace[-1], label)
        check_pool(*watches, label)

    def drain(label):
        n = 0
        while ref.has_unfinished_requests() or eng.has_unfinished_requests():
            n += 1
            step(f"{label}, step {n}")

    a0, a1 = tokens(40), tokens(20)
    add("a0", a0)
    add("a1", a1)
    step("fresh prefill of two")
    step("decode")
    add("late", tokens(17))
    step("prefill beside two decodes")
    add("hit-mixed", a0[:36] + tokens(6))  # a0's two full blocks are cached: a hit beside decodes
    drain("prefix hit beside decodes")
    add("hit-alone", a1 + tokens(5))
    drain("prefix hit alone")
    add("miss-alone", tokens(30))
    drain("fresh prefill alone")
    for i in range(4):  # 4 x 6 blocks at the end > 20: the newest are preempted, then recomputed
        add(f"tight{i}", tokens(44), max_tokens=40)
    drain("a pool too small for all")
    ids = tokens(37)
    a, b = watches[0].score(ids), watches[1].score(ids)
    if on_step is not None:
        on_step(eng, watches[1])
    assert a.shape == b.shape == (len(ids), vocab)
    check_rows(dict(enumerate(a)), dict(enumerate(b)), "score")
    check_pool(*watches, "score")
    assert ref.stats["preemptions"] > 0 and ref.stats["preemptions"] == eng.stats["preemptions"]
    return watches[0].kinds


# --- the tests ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("device,variant", PARAMS)
def test_backend_matches_the_reference_in_logits_tokens_and_pool(device, variant):
    ref = reference_engine(device)
    eng = variant_engine(ref, device, variant)
    kinds = lockstep(ref.engine, eng)
    assert kinds == MUST_SEE, f"the schedule missed {MUST_SEE - kinds}"
    if variant == "graphs-stand-in":  # the runners really ran the steps they take
        assert eng.backend.graphs.replays > 0 and eng.backend.prefill_graphs.replays > 0


def test_triton_kernel_in_the_interpreter_matches_the_reference():
    """The ``triton`` backend on the CPU: a fused engine switched to it after it is built (the
    registry grants ``triton`` on CUDA only), its kernel run by Triton's interpreter."""
    from triton_helpers import interpret
    p = interpret(__file__, "triton", timeout=600)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert "triton: logits, tokens and pool equal" in p.stdout, p.stdout


# The check can fail: each corruption below, made after a step of an otherwise correct backend,
# must be caught by that step's check.

def _leak_next_slot(engine, watch):
    """An off-by-one write: the K of the step's last slot copied into the slot after it too."""
    s = max(watch.slots)
    k = engine.pool.k_cache
    src, dst = divmod(s, watch.bs), divmod(s + 1, watch.bs)
    k[0, dst[0], dst[1]] = k[0, src[0], src[1]] + 1.0


def _perturb_k(engine, watch):
    """One K value, in a slot the step wrote, off by 100 x TOL of the largest K."""
    s = watch.slots[0]
    k = engine.pool.k_cache
    k[-1, s // watch.bs, s % watch.bs, 0, 0] += 100 * TOL * k.abs().max()


def _skip_a_write(engine, watch):
    """A slot the step should have written left as it was."""
    s = watch.slots[-1]
    engine.pool.v_cache[:, s // watch.bs, s % watch.bs] = watch.before[1][:, s // watch.bs, s % watch.bs]


@pytest.mark.parametrize("corrupt,message", [(_leak_next_slot, "wrote K outside its slots"),
                                             (_perturb_k, "K in the written slots differs"),
                                             (_skip_a_write, "V in the written slots differs")])
def test_the_check_catches_a_backend_that_writes_wrong(corrupt, message):
    ref = reference_engine("cpu")
    eng = ref.fork(attention_backend="fused").engine
    with pytest.raises(AssertionError, match=message):
        lockstep(ref.engine, eng, on_step=corrupt)


def _triton_main() -> int:
    ref = reference_engine("cpu")
    eng = ref.fork(attention_backend="fused").engine
    eng.attention_backend = eng.backend.name = "triton"  # as tests/triton_engine_check.py does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kinds = lockstep(ref.engine, eng)
    assert kinds == MUST_SEE, kinds
    print("triton: logits, tokens and pool equal at every step (" + ", ".join(sorted(kinds)) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(_triton_main() if sys.argv[1:] == ["triton"] else 2)
