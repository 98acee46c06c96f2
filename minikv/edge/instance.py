"""One edge instance: a real engine that shares the fleet's weights, and its shutdown scrub.

An edge node loads the model once and runs engines that come and go; each owns its KV pool,
block manager, tenant keys and audit trail.  ``shared_weights_engine`` builds such an engine
from a donor without reading the checkpoint again; ``EdgeInstance.shutdown`` zeroes the whole
pool, because a node that is recycled must not leave one tenant's K/V for the next process.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..engine.engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams


def _engine_of(weights) -> LLMEngine:
    engine = getattr(weights, "engine", weights)  # an LLM or an LLMEngine
    if not isinstance(engine, LLMEngine):
        raise TypeError(f"weights must be an LLM or an LLMEngine, got {type(weights).__name__}")
    return engine


def shared_weights_engine(weights, **overrides) -> LLMEngine:
    """A new :class:`LLMEngine` that shares ``weights``' model, tokenizer and HF config.

    ``weights`` is an ``LLM`` or ``LLMEngine`` that already loaded a model.  The new engine's
    config is the donor's with ``overrides`` applied (any :class:`EngineConfig` field), except
    that ``model``, ``device`` and ``dtype`` always follow the donor (the tensors *are* the
    donor's) and ``audit_log`` is *not* inherited: two engines appending to one file would
    interleave their trails, so pass ``audit_log=`` explicitly per engine.  ``engine_secret`` is
    inherited when the donor was given one; pass ``engine_secret=None`` for a fresh random one.

    The new engine owns its KV pool, block manager, scheduler, tenant keys and audit trail;
    only the (read-only) weights are shared.  ``engine.model is donor.model`` holds.
    """
    overrides.setdefault("audit_log", None)
    return _engine_of(weights).fork(**overrides)


# --------------------------------------------------------------------------- one instance
@dataclass
class EdgeResponse:
    """What a client gets back, plus what only the operator sees.

    ``instance`` is what an ``x-instance-id``/``server`` header or a per-node IP would expose;
    ``num_cached_tokens`` is what an OpenAI-style ``usage.prompt_tokens_details.cached_tokens``
    field would expose; ``ttft_s`` is the client-side time to first token (real clock).
    ``route`` (the router's decision) is operator-side only.
    """

    request_id: str
    instance: str
    slot: int
    tenant: str | None
    text: str
    num_prompt_tokens: int
    num_cached_tokens: int
    ttft_s: float
    route: str
    output: RequestOutput


class EdgeInstance:
    """One serving instance: an engine with a name, a generation and a lifecycle."""

    def __init__(self, name: str, engine: LLMEngine, generation: int = 0):
        self.name, self.engine, self.generation = name, engine, generation
        self.served = 0
        self.alive = True

    @property
    def instance_id(self) -> str:
        """Name and generation, e.g. ``edge-1/g3``: a restarted instance is a new instance."""
        return f"{self.name}/g{self.generation}"

    def run(self, request_id: str, prompt, params: SamplingParams | None = None,
            tenant: str | None = None) -> tuple[RequestOutput, float]:
        """Run one request to completion; returns its final output and the client-side TTFT."""
        if not self.alive:
            raise RuntimeError(f"instance {self.instance_id} is shut down")
        eng = self.engine
        t0 = time.perf_counter()
        eng.add_request(request_id, prompt, params or SamplingParams(max_tokens=1, temperature=0.0),
                        tenant=tenant)
        ttft, final = None, None
        while final is None:
            for out in eng.step():
                if out.request_id != request_id:
                    continue
                if ttft is None and out.outputs[0].token_ids:
                    ttft = time.perf_counter() - t0
                if out.finished:
                    final = out
        self.served += 1
        return final, ttft if ttft is not None else time.perf_counter() - t0

    def pool_nonzero_blocks(self) -> int:
        """How many blocks hold any nonzero K or V value (any layer)."""
        pool = self.engine.pool
        dims = tuple(d for d in range(pool.k_cache.dim()) if d != 1)
        nz = pool.k_cache.ne(0).any(dim=dims) | pool.v_cache.ne(0).any(dim=dims)
        return int(nz.sum())

    def shutdown(self) -> int:
        """Stop serving and scrub: abort what is running, zero every block of the pool (all
        layers, K and V, used, cached and free alike), record it in the audit trail, close
        the trail.  Returns the number of blocks zeroed.

        Why every block and not just the cached ones: a free block still holds whatever its
        last owner wrote unless the scrub policy zeroed it on free (``scrub="on_alloc"``, the
        default, zeroes on the *next* allocation -- which never comes for a dying instance).
        Memory that outlives the process (a GPU handed to the next container, a host buffer,
        a crash dump) must not carry any tenant's K/V.
        """
        if not self.alive:
            return 0
        eng = self.engine
        for rid in list(eng.requests):
            eng.abort_request(rid)
        ids = list(range(eng.num_blocks))
        eng.pool.zero_blocks(ids)
        if eng.audit is not None:
            for bid in ids:
                eng.audit.record("scrub", request_id=None, tenant=None, block_id=bid, fp=None,
                                 hook="shutdown")
            eng.audit.close()
        self.alive = False
        return len(ids)
