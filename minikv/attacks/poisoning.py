"""Weak cache keys: contamination and collision poisoning of the prefix cache (lesson 06).

A prefix-cache hit makes a request attend over K/V that some *other* request computed.  That is
only correct if the cached block was computed for exactly the same tokens **in exactly the same
context** (every layer above 0 mixes in everything before the block).  Two ways to break it:

* **contamination** -- content-only keys (``chain_hashes=False``) name a block by its own 16
  tokens, so identical tokens after a *different* prefix reuse the wrong K/V
  (:func:`contamination_demo`);
* **collision poisoning** -- a hash that an attacker can collide (``builtin``, ``trunc32``,
  ``poly``) lets it plant K/V under the key of a block someone else will send
  (:func:`poison_with_collision`).

``verify_hits`` is the engine's second line of defence: ``"tokens"`` compares the cached
block's tokens (stops collisions of different tokens, not contamination), ``True`` also compares
the parent block (stops both).

Every helper records what the cache actually did through a :class:`HitRecorder` (a block-manager
listener), and compares the victim's output with a **cache-off reference** computed by
``engine.score`` (fresh blocks, no prefix lookup), so "poisoned" is a measured fact: a hit on a
block whose tokens or context differ, and different logits.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.sampling import SamplingParams

__all__ = [
    "HitRecord", "HitRecorder", "ReuseRun", "reference_greedy", "run_request",
    "ContaminationResult", "contamination_demo", "PoisonResult", "poison_with_collision",
    "fit_block",
]


# ------------------------------------------------------------------ what a hit really reused


@dataclass(frozen=True)
class HitRecord:
    """One prefix-cache hit, checked against the request that received it."""

    request_id: str
    index: int  # logical block index in the receiving request
    block_id: int
    writer_request: str | None  # request that computed the cached K/V
    tokens_match: bool  # the cached block holds the receiver's tokens
    context_match: bool  # ... computed after the receiver's own (faithful) previous blocks

    @property
    def faithful(self) -> bool:
        return self.tokens_match and self.context_match


class HitRecorder:
    """Block-manager listener that checks every hit against the receiving sequence.

    A hit is *faithful* when the cached block holds the receiver's tokens and was computed after
    the same parent block the receiver uses, itself faithful (hits form a prefix of the block
    table, so the parent of hit ``i`` is hit ``i - 1``).  Use as a context manager on an engine.
    """

    def __init__(self, engine):
        self.engine = engine
        self.hits: list[HitRecord] = []

    def __call__(self, event: str, ids: list[int], seq) -> None:
        if event != "hit" or seq is None:
            return
        bm = self.engine.block_manager
        parent, prefix_ok = None, True
        for i, bid in enumerate(ids):
            block = bm.blocks[bid]
            tokens_ok = block.identity.tokens == seq.block_tokens(i, bm.block_size)
            context_ok = prefix_ok and block.identity.parent == parent
            self.hits.append(HitRecord(seq.request_id, i, bid, block.writer_request, tokens_ok, context_ok))
            parent, prefix_ok = block.ref, tokens_ok and context_ok

    def for_request(self, request_id: str) -> list[HitRecord]:
        return [h for h in self.hits if h.request_id == request_id]

    def __enter__(self):
        self.engine.block_manager.listeners.append(self)
        return self

    def __exit__(self, *exc):
        self.engine.block_manager.listeners.remove(self)


# ------------------------------------------------------------------ running and referencing


@dataclass
class ReuseRun:
    """One request's output, its prefix-cache hits and its logits at every generated token."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int]
    logits: list[torch.Tensor]
    hits: list[HitRecord]
    num_cached_tokens: int

    @property
    def wrong_hits(self) -> list[HitRecord]:
        return [h for h in self.hits if not h.faithful]


def run_request(engine, prompt_ids: list[int], max_tokens: int = 4, tenant: str | None = None) -> ReuseRun:
    """Run one greedy request to completion on ``engine``, recording hits and logits."""
    rid = engine.new_request_id()
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    saved, engine.logit_trace = engine.logit_trace, []
    try:
        with HitRecorder(engine) as rec:
            engine.add_request(rid, list(prompt_ids), params, tenant=tenant)
            out = None
            while out is None:
                for o in engine.step():
                    if o.request_id == rid and o.finished:
                        out = o
        logits = [step[rid] for step in engine.logit_trace if rid in step]
    finally:
        engine.logit_trace = saved
    return ReuseRun(rid, list(prompt_ids), list(out.outputs[0].token_ids), logits,
                    rec.for_request(rid), out.num_cached_tokens)


@torch.inference_mode()
def reference_greedy(engine, prompt_ids: list[int], max_tokens: int = 4) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy continuation computed with the prefix cache out of the picture.

    On an engine with prefix caching off this is one ordinary request (no lookup can hit).
    Otherwise every step is a full ``engine.score`` on fresh blocks (slower, same guarantee).
    The reference depends only on the model and the prompt, so one cache-off engine can serve
    every configuration of the same model: compute it once and pass it as ``reference=``.
    """
    if not engine.block_manager.enable_caching:
        run = run_request(engine, prompt_ids, max_tokens)
        return run.token_ids, run.logits
    ids, toks, logits = list(prompt_ids), [], []
    for _ in range(max_tokens):
        row = engine.score(ids)[-1]
        tok = int(row.argmax())
        logits.append(row)
        toks.append(tok)
        ids.append(tok)
    return toks, logits


class _VersusReference:
    """What a victim run's output lost, compared with its cache-off reference.  Mixed into the
    result classes below, which hold ``victim``, ``reference_tokens`` and ``reference_logits``."""

    @property
    def first_divergence(self) -> int | None:
        pairs = zip(self.victim.token_ids, self.reference_tokens)
        return next((i for i, (x, y) in enumerate(pairs) if x != y), None)

    @property
    def max_logit_diff(self) -> float:
        return max(float((a - b).abs().max()) for a, b in zip(self.victim.logits, self.reference_logits))


def fit_block(ids: list[int], block_size: int, pad_id: int) -> list[int]:
    """Truncate or right-pad ``ids`` to exactly one block."""
    ids = list(ids)[:block_size]
    return ids + [pad_id] * (block_size - len(ids))


# ------------------------------------------------------------------ contamination


@dataclass
class ContaminationResult(_VersusReference):
    """Victim = ``first_b + shared + tail``; the cache held ``shared`` computed after ``first_a``."""

    victim: ReuseRun
    reference_tokens: list[int]
    reference_logits: list[torch.Tensor]

    @property
    def contaminated(self) -> bool:
        """A hit reused a block computed in another context (tokens equal, parent different)."""
        return any(h.tokens_match and not h.context_match for h in self.victim.hits)


def contamination_demo(engine, first_a: list[int], first_b: list[int], shared: list[int],
                       tail: list[int], max_tokens: int = 4, writer_tail: list[int] | None = None,
                       tenants: tuple = (None, None, None), reference=None) -> ContaminationResult:
    """Three requests: a writer caches ``shared`` after ``first_a``; an earlier request caches
    ``first_b``; the victim sends ``first_b + shared + tail``.

    ``first_a`` and ``first_b`` must be exactly one block each, ``shared`` one or more whole
    blocks.  With content-only keys the victim's lookup hits ``first_b`` (correct: a first block
    has no context) and then ``shared`` -- computed after ``first_a``.
    ``tenants`` = (writer, earlier, victim).  ``reference``: the victim's cache-off
    ``(tokens, logits)`` from :func:`reference_greedy` (computed here when None).
    """
    bs = engine.block_size
    for name, blk in (("first_a", first_a), ("first_b", first_b)):
        if len(blk) != bs:
            raise ValueError(f"{name} must be exactly one block ({bs} tokens), got {len(blk)}")
    if not shared or len(shared) % bs:
        raise ValueError(f"shared must be a whole number of blocks ({bs} tokens each), got {len(shared)}")
    writer_tail = list(tail if writer_tail is None else writer_tail)
    run_request(engine, list(first_a) + list(shared) + writer_tail, 1, tenants[0])
    run_request(engine, list(first_b) + writer_tail, 1, tenants[1])
    victim_ids = list(first_b) + list(shared) + list(tail)
    victim = run_request(engine, victim_ids, max_tokens, tenants[2])
    ref_toks, ref_logits = reference or reference_greedy(engine, victim_ids, max_tokens)
    return ContaminationResult(victim, list(ref_toks), list(ref_logits))


# ------------------------------------------------------------------ collision poisoning


@dataclass
class PoisonResult(_VersusReference):
    """The attacker primed ``block_a``; the victim sent ``block_b`` (+ its tail)."""

    block_a: tuple[int, ...]
    block_b: tuple[int, ...]
    keys_equal: bool
    victim: ReuseRun
    reference_tokens: list[int]
    reference_logits: list[torch.Tensor]

    @property
    def poisoned(self) -> bool:
        """The victim's request reused a block holding the attacker's (different) tokens."""
        return any(not h.tokens_match for h in self.victim.hits)


def poison_with_collision(engine, block_a, block_b, victim_tail: list[int],
                          attacker_tail: list[int] | None = None, max_tokens: int = 4,
                          attacker_tenant: str | None = None, victim_tenant: str | None = None,
                          reference=None) -> PoisonResult:
    """Attacker sends ``block_a + attacker_tail`` (its K/V get cached); victim then sends
    ``block_b + victim_tail``.  Returns what the victim's lookup reused and how its output
    compares with the cache-off reference.

    ``block_a`` and ``block_b`` are one block each; they should collide under the engine's block
    hasher in the setting of the first block (parent None; tenant key None under
    ``cache_isolation="shared"``).  ``keys_equal`` reports whether they do, as the engine hashes
    them for the victim's tenant.  ``reference``: the victim's cache-off ``(tokens, logits)``
    from :func:`reference_greedy` (computed here when None).
    """
    bm, bs = engine.block_manager, engine.block_size
    a, b = tuple(block_a), tuple(block_b)
    if len(a) != bs or len(b) != bs:
        raise ValueError(f"block_a and block_b must be {bs} tokens each, got {len(a)} and {len(b)}")
    attacker_tail = list(victim_tail if attacker_tail is None else attacker_tail)
    key = engine.tenant_key(victim_tenant) if engine.config.cache_isolation == "tenant" else None
    keys_equal = bm.hasher(None, a, (), key) == bm.hasher(None, b, (), key)
    run_request(engine, list(a) + attacker_tail, 1, attacker_tenant)
    victim_ids = list(b) + list(victim_tail)
    victim = run_request(engine, victim_ids, max_tokens, victim_tenant)
    ref_toks, ref_logits = reference or reference_greedy(engine, victim_ids, max_tokens)
    return PoisonResult(a, b, keys_equal, victim, list(ref_toks), list(ref_logits))
