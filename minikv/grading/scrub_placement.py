"""Grader for exercise 3b: where in the block lifecycle to scrub.

``check_scrub_placement`` grades a *placement decision*, ``scrub_action(transition, seq)``, run
inside real engines through the given :class:`~minikv.grading.harness.PlacedScrubber`.  One small
engine per path a block can take back to the free list -- a request that finishes, is preempted,
is aborted, an LRU eviction, a quota eviction, an operator's ``reset_prefix_cache`` -- each built so
that the released blocks really are handed to another request.  A listener that runs right after
the engine's scrub inspects every block the moment it is allocated to a request: it must be all
zeros (a slot the new owner never wrote).  The path that failed names the bug class.  Then a
multi-tenant workload with repeats must give the cached tokens of minikv's own scrubber (same-
tenant hits kept) and logits equal to a cache-off engine's (nothing still needed was destroyed).
Finally one prompt sent twice in one step, then again: the second copy *adopts* the first's blocks
at commit, and the logits must still equal a cache-off engine's (the adopted twin was kept).
"""
from __future__ import annotations

import functools

import torch

from ..engine.lifecycle import Transition
from ..engine.sampling import SamplingParams
from ..engine.sequence import Sequence, SequenceStatus
from ..security.scrub import zero_blocks as ref_zero_blocks
from ._report import CheckFailed, call_safely, expect, grader, single_thread
from .engines import ENGINE_SECRET, tiny_llm
from .harness import KEEP, ZERO, PlacedScrubber

NUM_BLOCKS = 16  # engine pool: two or three requests at a time, so blocks are evicted and reused constantly
UNLIMITED = dict(max_cached_blocks_per_tenant="unlimited")  # no quota evictions where they would blur a path
GEN = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
TEXTS = [f"t{i} note {i * 7919 % 1000:03d}: code {i}{i}{i}." for i in range(8)]  # 23 tokens: 6 blocks of 4

#: path -> (bug class, why it matters); the order is the order they are run and diagnosed in
PATHS = {
    "finish": ("not scrubbed when a request finishes",
               "a finished request's uncached blocks go back to the free list: through which row, and who reads "
               "them next?"),
    "preempt": ("scrubs on the free path but not on PREEMPTION",
                "a preempted request is still running when its blocks are released: what does your decision "
                "read that tells it from a finished one, and should the decision depend on it?"),
    "abort": ("scrubs on the free path but not on ABORT",
              "an aborted request releases its blocks too: through a row of its own, or through one every "
              "request uses?"),
    "lru": ("not scrubbed on LRU EVICTION",
            "an evicted cached block goes to the free list; its bytes reach whoever allocates it next."),
    "quota": ("not scrubbed on QUOTA eviction",
              "a tenant over its cache quota loses its oldest cached blocks: which row carries them, and does "
              "your decision treat it as it treats an LRU eviction?"),
    "reset": ("not scrubbed on reset_prefix_cache (operator eviction, seq None)",
              "reset_prefix_cache evicts with seq=None: your decision must not depend on there being a request."),
}


class _DirtyWatch:
    """Listener after the engine's scrub: every freshly allocated block must be all zeros; also
    records which blocks left through which transition, so each path can prove it recycled them."""

    def __init__(self, engine):
        self.engine, self.dirty, self.released, self.reused = engine, [], set(), set()
        engine.block_manager.listeners.append(self)

    def __call__(self, transition, ids, seq) -> None:
        if transition in (Transition.FREE, Transition.EVICT):
            self.released.update(ids)
        if transition != Transition.ALLOCATE:
            return
        self.reused.update(b for b in ids if b in self.released)
        pool = self.engine.pool
        for bid in ids:
            if pool.k_cache[:, bid].abs().sum() > 0 or pool.v_cache[:, bid].abs().sum() > 0:
                self.dirty.append(f"block {bid} to a request of tenant {seq.tenant!r}")


def _run_path(path: str, scrubber, watch=None) -> None:
    """Run ``path`` on a fresh engine with ``scrubber`` (attached here; ``watch(engine)``, if given, is
    called first); raise CheckFailed if a request ever got a dirty block."""
    caching = path not in ("finish", "preempt", "abort")  # the first three: every release is a 'free'
    kwargs = dict(enable_prefix_caching=caching, **({} if path == "quota" else UNLIMITED))
    kwargs["num_blocks"] = {"preempt": 9, "quota": 64, "reset": 24}.get(path, 16)
    if path == "quota":
        kwargs["max_cached_blocks_per_tenant"] = 2
    llm = tiny_llm(scrubber=scrubber, **kwargs)
    eng = llm.engine
    scrubber.attach(eng)
    if watch is not None:
        watch(eng)
    handed = _DirtyWatch(eng)
    if path == "preempt":  # two long decodes in 9 blocks: the newer one is preempted, its blocks reused
        llm.generate(["p0 short", "p1 short", "p2 short"],
                     SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True), tenant=["t0", "t1", "t2"])
        if eng.stats["preemptions"] == 0:
            raise RuntimeError("grader bug: the preemption path never preempted")
    elif path == "abort":  # abort a running request, then another tenant takes its blocks
        for i in range(2):
            eng.add_request(f"a{i}", TEXTS[i], GEN, tenant=f"t{i}")
        eng.step()
        eng.abort_request("a0")
        while eng.has_unfinished_requests():
            eng.step()
        for i in (2, 3):
            llm.generate([TEXTS[i]], GEN, tenant=f"t{i}")
    elif path == "reset":
        llm.generate([TEXTS[0]], GEN, tenant="t0")
        eng.reset_prefix_cache()
        for i in range(1, 5):
            llm.generate([TEXTS[i]], GEN, tenant=f"t{i}")
    else:  # finish, lru, quota: one request after another, different tenants, so blocks cycle
        for i in range(6 if path != "quota" else 8):
            llm.generate([TEXTS[i], TEXTS[(i + 3) % 8]] if path == "quota" else [TEXTS[i]], GEN,
                         tenant=[f"t{i}", f"t{i}"] if path == "quota" else f"t{i}")
    if not handed.reused:
        raise RuntimeError(f"grader bug: the {path!r} path never recycled a released block")
    bug, why = PATHS[path]
    expect(not handed.dirty, f"{bug}: the engine handed {len(handed.dirty)} block(s) still holding old K/V to new "
           f"requests, e.g. {handed.dirty[0] if handed.dirty else ''}", why)


#: Requests of 6 tenants, alone and in batches, with repeats (cache hits) and evictions; indexes
#: into TEXTS, one generate() per group.
PLAN = ((0,), (0,), (1, 2), (3,), (4, 5, 1), (2,), (3, 0))
#: One prompt twice in one step (both compute it; at commit the second ADOPTS the first's blocks,
#: which both then read while decoding), then once more (it hits them).
ADOPT_PLAN = ((6, 6), (6,))


def _workload(llm, plan=PLAN) -> tuple[list, list[int]]:
    """Run ``plan`` (tenant ``t<i>`` sends ``TEXTS[i]``).  Returns (per-step logits, cached tokens
    per request)."""
    eng = llm.engine
    eng.logit_trace = []
    cached = []
    for group in plan:
        outs = llm.generate([TEXTS[i] for i in group], GEN, tenant=[f"t{i}" for i in group])
        cached += [o.num_cached_tokens for o in outs]
    return eng.logit_trace, cached


@functools.lru_cache(maxsize=4)
def _reference(caching: bool, plan=PLAN):
    """``plan`` on minikv's own ``scrub="on_alloc"``, with or without prefix caching (computed once)."""
    with single_thread():
        return _workload(tiny_llm(enable_prefix_caching=caching, num_blocks=NUM_BLOCKS, scrub="on_alloc"), plan)


def _same_logits(trace, ref_trace) -> bool:
    """Per-request logits of every step, in order (a hit changes which step computes what, so steps are
    compared per request, not per step index)."""
    def per_request(t):
        out: dict = {}
        for step in t:
            for rid, logits in step.items():
                out.setdefault(rid, []).append(logits[-1] if logits.dim() > 1 else logits)
        return out
    a, b = per_request(trace), per_request(ref_trace)
    return a.keys() == b.keys() and all(len(a[r]) == len(b[r]) and all(
        torch.allclose(x, y, atol=1e-4) for x, y in zip(a[r], b[r])) for r in a)


def _scrubbed_llm(scrubber, watch=None):
    """A caching engine with ``scrubber`` attached (and ``watch(engine)`` called, if given)."""
    llm = tiny_llm(enable_prefix_caching=True, num_blocks=NUM_BLOCKS, scrubber=scrubber)
    scrubber.attach(llm.engine)
    if watch is not None:
        watch(llm.engine)
    return llm


def _check_adoption(scrubber, watch=None) -> None:
    """ADOPT_PLAN's logits must equal a cache-off engine's: the twin adopted at commit is live."""
    llm = _scrubbed_llm(scrubber, watch)
    adopted = []
    llm.engine.block_manager.listeners.insert(  # first: it sees the adoption even if the scrub raises
        0, lambda t, ids, seq: adopted.extend(ids) if t == Transition.ADOPT else None)
    trace, _ = _workload(llm, ADOPT_PLAN)
    if not adopted:
        raise RuntimeError("grader bug: two copies of one prompt in one step adopted nothing")
    failed = llm.engine.stats["failed"]
    expect(not failed, f"{failed} request(s) failed when one prompt arrived twice in one step: your scrubber "
           "raised when the second request ADOPTED the first's blocks at commit (bug class: a transition left "
           "undecided)", "'adopt' is a row of LIFECYCLE like the others: decide it (it hands over a live block).")
    expect(_same_logits(trace, _reference(False, ADOPT_PLAN)[0]),
           "outputs differ from a cache-off engine's when one prompt arrives twice in one step: your scrubber "
           "zeroed the block the second request ADOPTED at commit, which both requests still read (bug class: "
           "wipes every ADOPTED block)",
           "what does an adoption hand over, and to whom?  Would you zero the block of a hit?")


#: KV tiers: a victim's 4 full blocks, then a flood that evicts them all into the host tier, then the
#: victim again, served from the tier (``offload`` on the way out, ``onload`` on the way back)
TIER_VICTIM, TIER_FLOOD = list(range(10, 30)), list(range(100, 144))


@single_thread()
def _check_tiers(action) -> None:
    """The KV-tier transitions, run through the engine: an offloaded block leaves no plaintext in the
    pool once it is back on the free list, and a block onloaded from the tier is kept for its hit."""
    scrubber = PlacedScrubber(action, ref_zero_blocks)
    llm = tiny_llm(scrubber=scrubber, num_blocks=12, enable_prefix_caching=True, kv_tiers=["host"],
                   engine_secret=ENGINE_SECRET, max_cached_blocks_per_tenant=12)
    eng = scrubber.attach(llm.engine) and llm.engine
    offloaded, dirty = set(), []

    def after_scrub(transition, ids, seq) -> None:
        if transition == Transition.OFFLOAD:
            offloaded.update(ids)
        elif transition == Transition.EVICT:
            dirty.extend(b for b in ids if b in offloaded and (eng.pool.k_cache[:, b].abs().sum() > 0
                                                               or eng.pool.v_cache[:, b].abs().sum() > 0))
    eng.block_manager.listeners.append(after_scrub)
    first = llm.generate([TIER_VICTIM], GEN, tenant="a")[0]
    llm.generate([TIER_FLOOD], GEN, tenant="flood")
    if not offloaded:
        raise RuntimeError("grader bug: the tier path offloaded nothing")
    again = llm.generate([TIER_VICTIM], GEN, tenant="a")[0]
    expect(not dirty, f"{len(dirty)} block(s) sealed into a KV tier (transition 'offload') went back to the free list "
           "still holding their K/V in the pool (bug class: offloaded K/V left in the pool)",
           "once a block's K/V live sealed in a tier, what reason is there to keep a plaintext copy in the pool?")
    expect(eng.tiers.stats["onloaded"] > 0 and again.outputs[0].token_ids == first.outputs[0].token_ids,
           "a prefix served from the KV tier gave other tokens than when it was computed: your scrubber zeroed "
           "blocks ONLOADED from the tier, which the request then read (bug class: wipes K/V ONLOADED from a tier)",
           "an onload copies verified K/V into a block so that a request can read it, like a hit: keep it.")


def engine_stage_placement(action) -> tuple[list[int], int]:
    """Every path, then the hit workload, then an adoption, each with a ``PlacedScrubber`` following
    ``action``, then the KV-tier transitions; raise :class:`CheckFailed` on the first failure.  Returns
    (cached tokens per request, engine steps) of the hit workload."""
    done = engine_stage(lambda: PlacedScrubber(action, ref_zero_blocks))
    _check_tiers(action)
    return done


@single_thread()
def engine_stage(new_scrubber, watch=None) -> tuple[list[int], int]:
    """:func:`engine_stage_placement` for any scrubber: ``new_scrubber()`` builds a fresh one (with an
    ``attach(engine)``) for each of the 8 engines, ``watch(engine)`` sees each engine (exercise 3d
    meters its cost there)."""
    for path in PATHS:
        _run_path(path, new_scrubber(), watch)
    llm = _scrubbed_llm(new_scrubber(), watch)
    trace, cached = _workload(llm)
    _, ref_cached = _reference(True)
    expect(cached == ref_cached, f"same-tenant hits lost: cached tokens per request {cached}, minikv's scrubber keeps "
           f"{ref_cached} (bug class: scrubbing destroys the reuse the cache exists for)",
           "which of your ZERO rows hands a block to a reader who is meant to read its data?")
    ref_trace, _ = _reference(False)
    expect(_same_logits(trace, ref_trace), "outputs differ from a cache-off engine's: your scrubber zeroed K/V that "
           "a running request or a cache hit still needed (bug class: scrub destroys live data)",
           "which of your ZERO rows zeroes a block that can still be read: by a running request, or by a later hit?")
    _check_adoption(new_scrubber(), watch)
    return cached, llm.engine.stats["steps"]


def _fake_seq(status: SequenceStatus, reason: str | None = None) -> Sequence:
    seq = Sequence("probe", [3, 4, 5, 6], SamplingParams(), tenant="t")
    seq.status, seq.finish_reason = status, reason
    return seq


def _placement_error(t: Transition, who: str, exc: Exception) -> CheckFailed:
    """The diagnosis of an exception from ``scrub_action(t, seq)``: a refused row (ValueError or
    KeyError) is a transition left undecided; anything else is a crash inside the decision."""
    call = f"scrub_action({t.value!r}, <{who}>) raised {type(exc).__name__}: {exc}"
    if isinstance(exc, (ValueError, KeyError)):
        return CheckFailed(f"{call} -- but {t.value!r} is a transition of the lifecycle (bug class: a transition "
                           "left undecided)", "every row of LIFECYCLE needs a decision, including 'adopt' (a "
                           "same-step duplicate swapped for its twin at commit); only names that are not "
                           "transitions raise ValueError.")
    if who == "operator (None)":
        return CheckFailed(f"{call} (bug class: crashed in the decision -- it assumes every transition has a "
                           "request, but an operator's reset_prefix_cache passes seq=None)",
                           "what does the engine pass as seq when no request caused the transition?")
    return CheckFailed(f"{call} (bug class: crashed in the decision, not a refused transition: the code that "
                       "decides failed on a value it was given)",
                       "call your scrub_action by hand with this transition and this kind of request, and read "
                       "the traceback.")


@grader("which rows of LIFECYCLE put old bytes within a NEW reader's reach, and which hand data to a reader who is "
        "meant to have it?")
def check_scrub_placement(scrub_action) -> str:
    """Exercise 3b: a decision for every transition, right on every path through the real engine."""
    seqs = {"running": _fake_seq(SequenceStatus.RUNNING), "finished": _fake_seq(SequenceStatus.FINISHED, "stop"),
            "aborted": _fake_seq(SequenceStatus.FINISHED, "abort"), "operator (None)": None}
    for t in Transition:
        for who, seq in seqs.items():
            got, exc = call_safely(scrub_action, t, seq)
            if exc is not None:
                raise _placement_error(t, who, exc)
            expect(got in (ZERO, KEEP), f"scrub_action({t.value!r}, <{who}>) returned {got!r}; expected ZERO or KEEP")
            if t in (Transition.HIT, Transition.ADOPT, Transition.STORE, Transition.CACHE) and got == ZERO:
                what = {"hit": "wipes every HIT", "adopt": "wipes every ADOPTED block",
                        "store": "zeroes a block right after it is STORED",
                        "cache": "zeroes blocks released INTO the cache"}[t.value]
                raise CheckFailed(f"your decision {what} (transition {t.value!r}): that destroys data a reader is "
                                  "meant to reuse (bug class: scrubbing destroys the reuse the cache exists for)",
                                  "after this transition, who reads the block next, and who wrote its bytes?")
    _, exc = call_safely(scrub_action, "defragment", None)
    expect(isinstance(exc, ValueError), f"scrub_action('defragment', None) "
           f"{'returned normally' if exc is None else 'raised ' + type(exc).__name__}; expected ValueError",
           "an unknown transition is a new lifecycle row nobody has decided yet: refuse it loudly.")
    cached, steps = engine_stage_placement(scrub_action)
    return (f"right on every path ({', '.join(PATHS)}): no request ever received old K/V; {sum(cached)} same-tenant "
            f"cached tokens kept over {steps} steps, outputs equal to a cache-off engine")
