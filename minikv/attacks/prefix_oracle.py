"""Leak 1: the shared prefix cache as an oracle (lesson 04; re-run by lessons 07, 08 and 09).

When the prefix cache is shared across tenants (``cache_isolation="shared"``), an attacker's
request reuses a victim's cached blocks exactly when it *starts with the same tokens*.  Two
observables turn that into a yes/no answer to "did someone send this prefix?":

* the **cached-token count** a server returns (``RequestOutput.num_cached_tokens``, OpenAI's
  ``usage.prompt_tokens_details.cached_tokens``): exact and deterministic;
* the **time to first token** (``RequestOutput.metrics.ttft_s``): a hit skips prefill work, so it
  answers sooner -- noisy, but available from every API.

A yes/no oracle only confirms guesses, so the attacker also needs a good *guesser*.  PromptPeek
(Wu et al., NDSS 2025) lets a language model rank the candidates for the next token; the oracle
then confirms which one is cached.  This module implements both halves:

* :func:`rank_candidates` / :class:`ModelRanker` -- the attacker's own copy of the model
  proposes the top-k next tokens (attacker-side computation, no request to the server);
* :func:`recover_secret_by_count` -- block-aware, model-guided search with the count oracle.
  The cache answers per *whole block*, so every block that holds ``u`` unknown tokens costs a
  search over up to ``k**u`` candidate fillings (depth-first, in the model's order);
* :func:`timing_rounds` / :func:`repeats_needed` -- the same decision from TTFT alone.

The **self-priming pitfall**: under a shared cache the attacker's own probe stores its blocks
too.  Probe a wrong candidate twice and the second probe *hits* -- on the attacker's own entry.
A single pass over distinct candidates is safe (the count attack never repeats a candidate);
timing needs repeats, so :func:`timing_rounds` calls :func:`forget_tenant_blocks` after every
probe.  That models the attacker's cold entries ageing out of the LRU while the victim's hot
ones stay; it is a lab instrument, not something a tenant can do.

Every function works under any engine configuration; under ``cache_isolation="tenant"`` (the
default) the oracle never answers "hit" for another tenant's prefix and the attack fails cleanly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from ..engine.sampling import SamplingParams

__all__ = [
    "PROBE_PARAMS", "rank_candidates", "ModelRanker", "token_ranks", "greedy_fill", "probe",
    "probe_cached_tokens", "Recovery", "recover_secret_by_count", "worst_case_probes_per_token",
    "forget_tenant_blocks", "timing_rounds", "repeats_needed",
]

#: One output token is enough: the oracle is read off the prefill (cached count, TTFT).
PROBE_PARAMS = SamplingParams(max_tokens=1, temperature=0.0)


# --------------------------------------------------------------------------- the guesser
def rank_candidates(engine, prefix_ids: Sequence[int], k: int) -> list[int]:
    """The model's ``k`` most likely next tokens after ``prefix_ids``, most likely first.

    Uses ``engine.score`` (an uncached forward pass on borrowed blocks), which stands for the
    attacker running its own copy of an open model: it never looks up or stores cache entries
    (give the engine free blocks to spare, or borrowing may evict the LRU cached block).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    logits = engine.score(list(prefix_ids))[-1]
    return [int(t) for t in logits.topk(k).indices.tolist()]


class ModelRanker:
    """``rank_candidates`` with a memo: a search revisits the same prefixes (e.g. across a block
    size sweep), and the attacker's model answers the same way every time."""

    def __init__(self, engine, k: int):
        self.engine, self.k, self.calls = engine, k, 0
        self._memo: dict[tuple[int, ...], list[int]] = {}

    def __call__(self, prefix_ids: Sequence[int]) -> list[int]:
        key = tuple(prefix_ids)
        if key not in self._memo:
            self.calls += 1
            self._memo[key] = rank_candidates(self.engine, key, self.k)
        return self._memo[key]


def token_ranks(engine, prefix_ids: Sequence[int], secret_ids: Sequence[int]) -> list[int]:
    """Rank (0 = the model's top-1) of every secret token given the true tokens before it."""
    ids = list(prefix_ids) + list(secret_ids)
    logits = engine.score(ids)
    return [int((logits[len(prefix_ids) + i - 1] > logits[len(prefix_ids) + i - 1, t]).sum())
            for i, t in enumerate(secret_ids)]


def greedy_fill(engine, prefix_ids: Sequence[int], n: int) -> list[int]:
    """The model-only baseline: ``n`` greedy tokens after ``prefix_ids`` (no oracle)."""
    ids = list(prefix_ids)
    for _ in range(n):
        ids.append(int(engine.score(ids)[-1].argmax()))
    return ids[len(prefix_ids):]


# --------------------------------------------------------------------------- the oracle
def probe(llm, ids: Sequence[int], tenant: str | None):
    """Send one probe request as ``tenant``; return its ``RequestOutput``."""
    return llm.generate([list(ids)], PROBE_PARAMS, tenant=tenant)[0]


def probe_cached_tokens(llm, ids: Sequence[int], tenant: str | None) -> int:
    """The count oracle: how many leading tokens of ``ids`` the server took from its cache."""
    return probe(llm, ids, tenant).num_cached_tokens


@dataclass
class Recovery:
    """Outcome of :func:`recover_secret_by_count`."""

    token_ids: list[int]                 # recovered secret tokens (a prefix of the secret)
    probes: int                          # requests sent to the server
    complete: bool                       # True when all ``secret_len`` tokens were recovered
    probes_per_block: list[int] = field(default_factory=list)
    #: one entry per probe: (block_end, guessed tokens, cached tokens reported, hit)
    trace: list[tuple[int, tuple[int, ...], int, bool]] = field(default_factory=list)

    @property
    def probes_per_token(self) -> float:
        return self.probes / max(1, len(self.token_ids))


def recover_secret_by_count(llm, known_prefix_ids: Sequence[int], secret_len: int,
                            known_suffix_ids: Sequence[int] = (), *, attacker_tenant: str | None,
                            k: int = 4, ranker: Callable | None = None, filler_id: int = 0,
                            max_probes: int | None = None) -> Recovery:
    """Recover ``secret_len`` unknown tokens that follow ``known_prefix_ids`` in a cached prompt.

    The attacker knows the template around the secret (``known_prefix_ids`` before it,
    ``known_suffix_ids`` after it) and the secret's length in tokens.  Block by block: for the
    block holding the next unknown token, enumerate fillings of its ``u`` unknown tokens
    depth-first in the model's order (top-``k`` per position), complete the block from the known
    suffix, add one ``filler_id`` token (the engine always computes the last prompt token, so a
    block can only be hit when something follows it) and probe.  A hit covers the whole block:
    ``num_cached_tokens >= block_end``.  If no filling hits (the secret is not in the model's
    top-k, or the cache is isolated), the search stops and returns what it has.

    ``ranker`` maps a prefix to candidate tokens, best first (default: ``ModelRanker(engine, k)``;
    pass one ranker to several runs to share its memo).  One search never repeats a probe, but a
    *second* search on the same engine would hit the first one's entries (self-priming): call
    :func:`forget_tenant_blocks` for the attacker in between.
    """
    bs = llm.engine.block_size
    rank = ranker if ranker is not None else ModelRanker(llm.engine, k)
    prefix, suffix = list(known_prefix_ids), list(known_suffix_ids)
    rec = Recovery([], 0, False)
    while len(rec.token_ids) < secret_len:
        start = len(prefix) + len(rec.token_ids)
        block_end = (start // bs + 1) * bs
        u = min(block_end - start, secret_len - len(rec.token_ids))
        tail = suffix[:block_end - start - u]
        if len(tail) < block_end - start - u:
            raise ValueError(f"known_suffix_ids has {len(suffix)} tokens; the block ending at "
                             f"{block_end} needs {block_end - start - u} of them")
        before, found = rec.probes, None
        stack = [[]]                                   # depth-first, model order
        while stack and found is None:
            path = stack.pop()
            if len(path) < u:
                stack.extend([path + [t] for t in reversed(rank(prefix + rec.token_ids + path))])
                continue
            if max_probes is not None and rec.probes >= max_probes:
                break
            cached = probe_cached_tokens(llm, prefix + rec.token_ids + path + tail + [filler_id],
                                         attacker_tenant)
            rec.probes += 1
            hit = cached >= block_end
            rec.trace.append((block_end, tuple(path), cached, hit))
            found = path if hit else None
        rec.probes_per_block.append(rec.probes - before)
        if found is None:
            return rec
        rec.token_ids += found
    rec.complete = True
    return rec


def worst_case_probes_per_token(block_size: int, secret_len: int, k: int) -> float:
    """Upper bound on probes per token with ``k`` candidates per position, for a secret that
    starts on a block boundary: each block of ``u`` unknown tokens costs up to ``k**u`` probes."""
    full, rest = divmod(secret_len, block_size)
    return (full * k ** block_size + (k ** rest if rest else 0)) / secret_len


# --------------------------------------------------------------------------- timing only
def forget_tenant_blocks(llm, tenant: str | None) -> int:
    """Lab instrument: evict every cached, unused block that ``tenant`` wrote; return how many.

    Models the attacker's cold probe entries ageing out of the LRU while the victim's hot blocks
    stay cached.  Uses the engine's ``reset_prefix_cache(tenant)`` (which also runs the scrub
    hooks and the audit trail)."""
    return llm.engine.reset_prefix_cache(tenant)


def timing_rounds(llm, probes: Sequence[Sequence[int]], *, rounds: int,
                  attacker_tenant: str | None, seed: int = 0, warmup: int = 2,
                  background_max: int = 0, background_tenant: str = "bystander") -> np.ndarray:
    """TTFT (seconds, real ``perf_counter`` clock) of every probe, ``rounds`` times.

    Each round sends every probe once, in a fresh random order (so slow drifts of the machine
    hit all candidates alike), as a fresh request, and forgets the attacker's own cache entries
    after each one (self-priming).  With ``background_max > 0`` every probe shares its engine
    step with a bystander's request of 0..``background_max`` random tokens (seeded): a real
    server is never idle, and other tenants' work in the same batch is noise the attacker cannot
    control.  Returns an array of shape ``[rounds, len(probes)]``.  ``warmup`` unrecorded probes
    come first: the first requests of a process are slower.
    """
    rng = np.random.default_rng(seed)
    vocab = llm.engine.model.shape.vocab_size

    def send(ids) -> float:
        n = int(rng.integers(0, background_max + 1)) if background_max else 0
        batch = [list(ids)] + ([rng.integers(vocab // 4, vocab, n).tolist()] if n else [])
        tenants = [attacker_tenant, background_tenant][:len(batch)]
        out = llm.generate(batch, PROBE_PARAMS, tenant=tenants)[0]
        for t in set(tenants):
            forget_tenant_blocks(llm, t)
        return out.metrics.ttft_s

    for i in range(warmup):
        send(probes[i % len(probes)])
    out = np.empty((rounds, len(probes)))
    for r in range(rounds):
        for j in rng.permutation(len(probes)):
            out[r, j] = send(probes[j])
    return out


def repeats_needed(ttft: np.ndarray, true_index: int, max_repeats: int | None = None,
                   trials: int = 50, seed: int = 0) -> int | None:
    """Smallest ``r`` such that "the candidate with the lowest median TTFT over ``r`` rounds is
    the secret" is right in every one of ``trials`` random draws of ``r`` distinct rounds from
    ``ttft`` (shape ``[rounds, candidates]``, from :func:`timing_rounds`).  None: not reached."""
    ttft = np.asarray(ttft, dtype=float)
    n = ttft.shape[0]
    rng = np.random.default_rng(seed)
    for r in range(1, min(max_repeats or n, n) + 1):
        draws = [rng.choice(n, size=r, replace=False) for _ in range(trials)]
        if all(int(np.argmin(np.median(ttft[d], axis=0))) == true_index for d in draws):
            return r
    return None
