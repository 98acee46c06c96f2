"""Many short-lived engines behind a prefix-aware router, simulated in one process.

Edge and serverless platforms do not run one big engine: they run many small instances that
start and stop with demand, behind a router that tries to send requests with the same prompt
prefix to the instance that already holds its KV blocks (SGLang's cache-aware router, vLLM
production-stack's ``prefixaware`` routing, llm-d's prefix-cache scorer).  This module builds
that picture from real :class:`~minikv.engine.engine.LLMEngine` objects:

* :func:`shared_weights_engine` -- a new engine that reuses another engine's weights (the same
  tensors, loaded once), with its own KV pool, block manager, secret and audit trail;
* :class:`EdgeInstance` -- one instance: an engine plus a name, a generation (bumped on every
  restart) and :meth:`EdgeInstance.shutdown`, which zeroes the whole pool;
* :class:`RoundRobinRouter` and :class:`PrefixAffinityRouter` -- where each request goes;
* :class:`EdgeFleet` -- N instances + a router + restarts + merged audit trails;
* :func:`prime_and_probe` -- the eviction side channel that per-tenant keys do not close.

Everything is synchronous: :meth:`EdgeFleet.submit` runs one request to completion on the
instance the router picked, so an experiment is exactly repeatable.  Requests are never
concurrent, so "load" in the routers means *how many prefixes an instance owns*, not queue
length (see :class:`PrefixAffinityRouter`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..engine.engine import LLMEngine
from ..engine.outputs import RequestOutput
from ..engine.sampling import SamplingParams
from ..security.encoding import encode_fields

__all__ = [
    "shared_weights_engine", "EdgeInstance", "EdgeResponse", "RoundRobinRouter",
    "PrefixAffinityRouter", "EdgeFleet", "prime_and_probe", "merge_trails", "bracket_verdict",
]

_LOAD_LOCK = threading.Lock()


# --------------------------------------------------------------------------- weight sharing
@contextlib.contextmanager
def _reuse_weights(model, tokenizer, hf_config):
    """While active, ``LLMEngine.__init__`` gets ``(model, tokenizer, hf_config)`` from memory
    instead of reading the checkpoint.

    ``LLMEngine`` loads its weights in its constructor through the module-level name
    ``minikv.engine.engine.load_model``; there is no constructor argument to pass loaded weights
    in.  Rather than duplicate the constructor (and drift from it), we swap that one name for
    the duration of one construction, under a lock, and restore it in ``finally``.  Everything
    else -- config validation, pool, hasher, secret, audit trail -- runs the real code.
    """
    from ..engine import engine as engine_module
    with _LOAD_LOCK:
        original = engine_module.load_model
        engine_module.load_model = lambda path, dtype, device: (model, tokenizer, hf_config)
        try:
            yield
        finally:
            engine_module.load_model = original


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
    donor = _engine_of(weights)
    overrides.setdefault("audit_log", None)
    for fixed in ("model", "device", "dtype"):
        if fixed in overrides:
            raise ValueError(f"{fixed!r} cannot be overridden: a shared-weights engine uses the donor's")
    cfg = dataclasses.replace(donor.config, model=donor.config.model, device=str(donor.device),
                              dtype=donor.dtype, **overrides)
    with _reuse_weights(donor.model, donor.tokenizer, donor.hf_config):
        return LLMEngine(cfg)


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


# --------------------------------------------------------------------------- routers
class RoundRobinRouter:
    """Instance ``i mod N`` for the i-th request: perfect load spread, no cache affinity."""

    name = "round-robin"

    def __init__(self, num_instances: int):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self.num_instances = num_instances
        self._next = 0

    def route(self, token_ids: list[int], tenant: str | None = None) -> tuple[int, str]:
        slot = self._next
        self._next = (self._next + 1) % self.num_instances
        return slot, "round-robin"

    def forget(self, slot: int) -> None:  # nothing remembered
        pass


class PrefixAffinityRouter:
    """Route by the first ``prefix_blocks`` blocks of the prompt, remembering recent routes.

    The routing key is a SHA-256 over the first ``prefix_blocks * block_size`` token ids (the
    whole prompt when it is shorter).  The router keeps an LRU index ``key -> instance`` of
    recently routed prefixes -- what SGLang's cache-aware router keeps as an approximate radix
    tree per worker and llm-d's approximate prefix scorer keeps as an LRU of prefix hashes per
    pod.  A request whose key is in the index goes to that instance (``"affinity"``); any other
    request goes to the *fallback* instance and is recorded there (``"fallback"``).

    Fallback: real routers pick the least-loaded worker.  In this synchronous simulation no
    request ever waits, so every instance is equally loaded and least-loaded with a rotating
    tie-break is round-robin: the fallback pointer advances once per fallback decision.  That
    pointer is shared state that every tenant's misses move, which is why it leaks (lesson 10).

    ``tenant_aware=True`` puts the tenant into the key, so one tenant's requests never follow
    another tenant's routes: the routing domain matches the cache-isolation domain.
    ``forget(slot)`` drops the routes to an instance (it restarted; its cache is gone).
    """

    name = "prefix-affinity"

    def __init__(self, num_instances: int, block_size: int = 16, prefix_blocks: int = 1,
                 tenant_aware: bool = False, capacity: int = 4096):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        if block_size < 1 or prefix_blocks < 1 or capacity < 1:
            raise ValueError("block_size, prefix_blocks and capacity must be >= 1")
        self.num_instances, self.block_size, self.prefix_blocks = num_instances, block_size, prefix_blocks
        self.tenant_aware, self.capacity = tenant_aware, capacity
        self.index: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0
        if tenant_aware:
            self.name = "prefix-affinity (tenant-aware)"

    def key(self, token_ids: list[int], tenant: str | None = None) -> bytes:
        head = tuple(int(t) for t in token_ids[:self.prefix_blocks * self.block_size])
        fields = ("minikv/route/v1", head) + ((tenant,) if self.tenant_aware else ())
        return hashlib.sha256(encode_fields(*fields)).digest()

    def route(self, token_ids: list[int], tenant: str | None = None) -> tuple[int, str]:
        k = self.key(token_ids, tenant)
        slot = self.index.get(k)
        if slot is not None:
            self.index.move_to_end(k)
            return slot, "affinity"
        slot = self._next
        self._next = (self._next + 1) % self.num_instances
        self.index[k] = slot
        while len(self.index) > self.capacity:
            self.index.popitem(last=False)
        return slot, "fallback"

    def forget(self, slot: int) -> None:
        for k in [k for k, s in self.index.items() if s == slot]:
            del self.index[k]


def bracket_verdict(slot_before: int, slot_after: int, num_instances: int) -> str:
    """The instance-id side channel of a router with a shared fallback pointer.

    An attacker sends a fresh control request C1 (a miss: it lands on the fallback instance
    ``a``), then its probe P, then another fresh control C2.  If P *missed* the router's index
    it consumed a fallback decision and C2 lands on ``a + 2``; if P *hit* (somebody recently
    sent P's prefix) it went to that somebody's instance and C2 lands on ``a + 1``.  Returns
    ``"seen recently"`` or ``"not seen"``.  With concurrent traffic the same logic works
    statistically; here it is exact.
    """
    return "seen recently" if slot_after == (slot_before + 1) % num_instances else "not seen"


# --------------------------------------------------------------------------- the fleet
class EdgeFleet:
    """N instances sharing one set of weights, behind a router, with optional churn.

    ``weights``: an ``LLM``/``LLMEngine`` whose model every instance reuses.  ``router``: a
    router object, or ``"prefix"`` / ``"prefix-tenant"`` / ``"round-robin"``.
    ``restart_every=k`` restarts an instance (scrub, fresh engine, generation + 1) after it
    served k requests.  ``engine_secret``: bytes shared by every instance (so a tenant's key is
    the same everywhere), or None for a fresh random secret per instance *and per restart*.
    ``audit_dir``: each instance generation writes ``<audit_dir>/<name>-g<gen>.jsonl``.
    ``instance_overrides``: ``{slot: {setting: value}}`` for a deliberately different node.
    Remaining keyword arguments are :class:`EngineConfig` settings for every instance.
    """

    def __init__(self, weights, num_instances: int = 3, router="prefix", *,
                 restart_every: int | None = None, engine_secret: bytes | None = None,
                 audit_dir: str | Path | None = None, name: str = "edge",
                 instance_overrides: dict | None = None, **engine_settings):
        self.donor = _engine_of(weights)
        if restart_every is not None and restart_every < 1:
            raise ValueError(f"restart_every must be >= 1 or None, got {restart_every}")
        self.num_instances, self.restart_every, self.name = num_instances, restart_every, name
        self.engine_secret = engine_secret
        self.audit_dir = Path(audit_dir) if audit_dir is not None else None
        if self.audit_dir is not None:
            self.audit_dir.mkdir(parents=True, exist_ok=True)
        self.instance_overrides = dict(instance_overrides or {})
        self.engine_settings = engine_settings
        bs = engine_settings.get("block_size", self.donor.config.block_size)
        if isinstance(router, str):
            router = {"prefix": lambda: PrefixAffinityRouter(num_instances, bs),
                      "prefix-tenant": lambda: PrefixAffinityRouter(num_instances, bs, tenant_aware=True),
                      "round-robin": lambda: RoundRobinRouter(num_instances)}[router]()
        self.router = router
        self.audit_paths: list[Path] = []
        self.restarts = 0
        self.responses: list[EdgeResponse] = []
        self._ids = 0
        self.instances = [self._start(slot, 0) for slot in range(num_instances)]

    # -- lifecycle ---------------------------------------------------------------------------
    def _start(self, slot: int, generation: int) -> EdgeInstance:
        name = f"{self.name}-{slot}"
        settings = dict(self.engine_settings)
        settings.update(self.instance_overrides.get(slot, {}))
        settings["engine_secret"] = self.engine_secret
        if self.audit_dir is not None:
            path = self.audit_dir / f"{name}-g{generation}.jsonl"
            path.unlink(missing_ok=True)
            settings["audit_log"] = str(path)
            self.audit_paths.append(path)
        return EdgeInstance(name, shared_weights_engine(self.donor, **settings), generation)

    def restart(self, slot: int) -> EdgeInstance:
        """Shut instance ``slot`` down (scrubbing its pool) and start a fresh one in its place:
        a cold cache, and -- without a configured ``engine_secret`` -- a new secret."""
        old = self.instances[slot]
        old.shutdown()
        self.router.forget(slot)
        self.instances[slot] = self._start(slot, old.generation + 1)
        self.restarts += 1
        return self.instances[slot]

    def shutdown(self) -> None:
        for inst in self.instances:
            inst.shutdown()

    # -- requests ----------------------------------------------------------------------------
    def tokenize(self, prompt) -> list[int]:
        return self.donor._encode_prompt(prompt)[0] if isinstance(prompt, str) else list(prompt)

    def submit(self, prompt, params: SamplingParams | None = None,
               tenant: str | None = None) -> EdgeResponse:
        """Route ``prompt`` and run it to completion on the chosen instance."""
        ids = self.tokenize(prompt)
        slot, decision = self.router.route(ids, tenant)
        inst = self.instances[slot]
        rid = f"r{self._ids}"
        self._ids += 1
        out, ttft = inst.run(rid, ids, params, tenant)
        resp = EdgeResponse(rid, inst.instance_id, slot, tenant, out.outputs[0].text,
                            len(ids), out.num_cached_tokens, ttft, decision, out)
        self.responses.append(resp)
        if self.restart_every is not None and inst.served >= self.restart_every:
            self.restart(slot)
        return resp

    def hit_rate(self) -> float:
        """Cached prompt tokens / prompt tokens over every response so far."""
        total = sum(r.num_prompt_tokens for r in self.responses)
        return sum(r.num_cached_tokens for r in self.responses) / total if total else 0.0

    # -- governance --------------------------------------------------------------------------
    def merged_trail(self) -> list[dict]:
        """Every instance generation's audit events in one list, ordered by time, each tagged
        with ``instance`` (the file it came from)."""
        return merge_trails(self.audit_paths)

    def detect(self, threshold: int = 8):
        """Run :func:`minikv.audit.detector.detect` over the merged trail."""
        from ..audit.detector import detect
        return detect(self.merged_trail(), threshold=threshold)


def merge_trails(paths: Iterable[str | Path]) -> list[dict]:
    """Read JSONL trails and merge them by timestamp; adds ``instance`` = the file's stem."""
    events = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            continue
        with open(p, encoding="utf-8") as fh:
            for line in fh:
                if line.strip():
                    ev = json.loads(line)
                    ev.setdefault("instance", p.stem)
                    events.append(ev)
    events.sort(key=lambda e: e.get("t", 0.0))
    return events


# --------------------------------------------------------------------------- prime and probe
def prime_and_probe(weights, victim_requests: int, *, quota: int | None = None, num_blocks: int = 16,
                    block_size: int = 16, attacker_blocks: int = 4, victim_blocks: int = 3,
                    seed: int = 0) -> int:
    """One round of prime-and-probe on a fresh tenant-isolated instance; returns how many of the
    attacker's own prompt tokens were still cached when it probed.

    1. *prime*: the attacker sends its own prompt (``attacker_blocks`` full blocks + 1 token);
       its blocks stay cached.
    2. the victim sends ``victim_requests`` distinct prompts of ``victim_blocks`` blocks + 1.
    3. *probe*: the attacker re-sends its prompt and reads ``num_cached_tokens`` (or its TTFT).

    Per-tenant keys stop the attacker from ever *hitting* the victim's blocks, but the pool and
    its LRU are shared: the victim's load evicts the attacker's blocks, and the attacker sees
    its own hits drop -- a measure of the victim's activity and volume.  With
    ``quota=max_cached_blocks_per_tenant`` each tenant recycles its own cache first, so (with
    the pool sized for the quotas) the victim's load never evicts the attacker's blocks.
    """
    import random
    rng = random.Random(seed)
    vocab = _engine_of(weights).model.shape.vocab_size
    eng = shared_weights_engine(weights, enable_prefix_caching=True, cache_isolation="tenant",
                                num_blocks=num_blocks, block_size=block_size,
                                max_cached_blocks_per_tenant=quota, engine_secret=None)
    inst = EdgeInstance("probe-target", eng)

    def prompt(n_blocks):
        return [rng.randrange(3, vocab) for _ in range(n_blocks * block_size + 1)]

    mine = prompt(attacker_blocks)
    inst.run("prime", mine, tenant="attacker")
    for i in range(victim_requests):
        inst.run(f"victim-{i}", prompt(victim_blocks), tenant="victim")
    out, _ = inst.run("probe", mine, tenant="attacker")
    return out.num_cached_tokens
