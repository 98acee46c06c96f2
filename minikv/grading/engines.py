"""Small real engines for the graders, and the instruments they read.

Graders run the learner's code *inside* minikv: a hasher through ``LLM(block_hasher=...)``, a
scrubber through ``LLM(scrubber=...)``.  They use the ``tiny-random`` model (2 layers, byte-level
tokenizer: token ids 3..258 are bytes) because the properties checked -- which blocks hit,
which memory is zeroed -- do not depend on what the model says, and it builds in milliseconds.

Two things have no seam in the engine, so :func:`use_key_derivation` and
:func:`use_block_keys` swap one method on *one engine object* (never on the class): the
per-tenant key derivation (``LLMEngine.tenant_key``) and the chain plumbing
(``BlockManager.block_hash``, which is its prefix cache's).
"""
from __future__ import annotations

import warnings
from typing import Callable

from ..engine.config import UnsafeSettingWarning
from ..engine.lifecycle import REUSES, crosses_tenants
from ..llm import LLM
from ..engine.sampling import SamplingParams

BS = 4  # block size of every grading engine: small blocks, many of them per prompt
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
ENGINE_SECRET = bytes(range(100, 132))  # fixed, so a grading run is reproducible


def tiny_llm(**kwargs) -> LLM:
    """A tiny-random engine on CPU in fp32, block size 4, UNSAFE-setting warnings silenced."""
    cfg = dict(device="cpu", dtype="float32", block_size=BS, num_blocks=96, seed=0)
    cfg.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        return LLM("tiny-random", **cfg)


class HitLog:
    """Block-manager listener: every prefix-cache hit as (hitting tenant, writer tenant, public).
    Adoptions (a same-step twin taken at commit) count as hits here: another tenant's adopted
    block is as much a leak as a hit on it."""

    def __init__(self, engine):
        self.hits: list[tuple] = []
        self._bm = engine.block_manager
        self._bm.listeners.append(self)

    def __call__(self, event, ids, seq) -> None:
        if event in REUSES and seq is not None:
            self.hits += [(seq.tenant, self._bm.blocks[b].writer_tenant, self._bm.blocks[b].public) for b in ids]

    @property
    def cross(self) -> list[tuple]:
        """Hits on another tenant's private block (never allowed)."""
        return [h for h in self.hits if crosses_tenants(h[:2], h[2])]

    @property
    def same(self) -> list[tuple]:
        """Hits on the same tenant's blocks (public or not)."""
        return [h for h in self.hits if h[0] == h[1]]

    @property
    def public(self) -> list[tuple]:
        return [h for h in self.hits if h[2]]


def use_key_derivation(llm: LLM, derive: Callable[[bytes, str | None], bytes], secret: bytes) -> LLM:
    """Make ``llm``'s engine derive tenant keys with ``derive(secret, tenant)``.

    The engine has no seam for key derivation: this replaces ``tenant_key`` on this one engine
    object (instance attribute), which is where ``add_request`` gets a request's key.
    """
    cache: dict = {}

    def tenant_key(tenant):
        if tenant not in cache:
            cache[tenant] = derive(secret, tenant)
        return cache[tenant]

    llm.engine.tenant_key = tenant_key
    return llm


def use_block_keys(llm: LLM, block_keys: Callable) -> LLM:
    """Make ``llm``'s block manager compute the chain of block keys with the learner's
    ``block_keys(hasher, token_ids, block_size, tenant_key, public_len)`` (replaces
    ``PrefixCache.block_hash`` on this one engine's prefix cache)."""
    bm = llm.engine.block_manager

    def block_hash(seq, i):
        if len(seq.block_hashes) <= i:
            keys = list(block_keys(bm.hasher, list(seq.token_ids), bm.block_size, seq.tenant_key, seq.public_len))
            if len(keys) <= i:
                raise ValueError(f"block_keys returned {len(keys)} keys for {len(seq.token_ids)} tokens "
                                 f"(block size {bm.block_size}); the engine needs block {i}")
            seq.block_hashes.extend(keys[len(seq.block_hashes):])
        return seq.block_hashes[i]

    bm.prefix_cache.block_hash = block_hash
    return llm


def use_key_layout(llm: LLM, layout: Callable, secret: bytes, request: dict) -> LLM:
    """Make ``llm``'s engine take every block's domain key from ``layout`` (exercise 2d's
    ``key_layout(secret, tenant, user, n_tokens, block_size, public_len, tenant_end)``).

    The engine knows one tenant per request and no users or part boundaries, so the caller puts
    the next request's ``user``, ``public_len`` and ``tenant_end`` into ``request`` before sending
    it; each new sequence reads them once, keeps them in ``request["seen"]`` under its request id,
    and answers the block manager's ``domain_key(i, block_size)`` from the layout (asked again when
    the sequence grows, since the layout depends on its length).  Replaces ``_new_sequence`` on this
    one engine object, and ``domain_key`` on each of its sequences."""
    engine = llm.engine
    new_sequence = engine._new_sequence

    def keyed_sequence(*args, **kwargs):
        seq = new_sequence(*args, **kwargs)
        user, pub, end = request["user"], request["public_len"], request["tenant_end"]
        request.setdefault("seen", {})[seq.request_id] = (seq.tenant, user, pub, end)
        memo: dict[int, list] = {}

        def domain_key(i, block_size):
            n = len(seq.token_ids)
            if n not in memo:
                memo[n] = list(layout(secret, seq.tenant, user, n, block_size, pub, end))
            return memo[n][i]

        seq.domain_key = domain_key
        return seq

    engine._new_sequence = keyed_sequence
    return llm
