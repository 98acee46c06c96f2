"""A fleet of short-lived instances behind a router, and the prime-and-probe experiment.

``EdgeFleet`` runs N :class:`~minikv.edge.instance.EdgeInstance` s behind a router, restarts
them every k requests (churn), and merges their audit trails so the operator's detector sees
the whole fleet.  ``prime_and_probe`` measures the eviction side channel that per-tenant keys
do not close, with and without per-tenant cache quotas.  Everything is synchronous, so an
experiment is exactly repeatable.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from ..engine.sampling import SamplingParams
from .instance import EdgeInstance, EdgeResponse, _engine_of, shared_weights_engine
from .router import PrefixAffinityRouter, RoundRobinRouter


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
        return self.donor.encode_prompt(prompt)[0] if isinstance(prompt, str) else list(prompt)

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
def prime_and_probe(weights, victim_requests: int, *, quota: int | str | None = None, num_blocks: int = 16,
                    block_size: int = 16, attacker_blocks: int = 4, victim_blocks: int = 3,
                    seed: int = 0, **settings) -> int:
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
    ``quota`` is passed as ``max_cached_blocks_per_tenant``: None is the engine's default
    (``num_blocks // 8``), ``"unlimited"`` turns the quota off (UNSAFE: the attack works).
    ``settings``: other :class:`EngineConfig` settings of the target (default
    ``cache_isolation="tenant"``; e.g. ``cache_isolation="selective"``).
    """
    import random
    rng = random.Random(seed)
    vocab = _engine_of(weights).model.shape.vocab_size
    settings.setdefault("cache_isolation", "tenant")
    eng = shared_weights_engine(weights, enable_prefix_caching=True, num_blocks=num_blocks, block_size=block_size,
                                max_cached_blocks_per_tenant=quota, engine_secret=None, **settings)
    inst = EdgeInstance("probe-target", eng)

    def prompt(n_blocks):
        return [rng.randrange(3, vocab) for _ in range(n_blocks * block_size + 1)]

    mine = prompt(attacker_blocks)
    inst.run("prime", mine, tenant="attacker")
    for i in range(victim_requests):
        inst.run(f"victim-{i}", prompt(victim_blocks), tenant="victim")
    out, _ = inst.run("probe", mine, tenant="attacker")
    return out.num_cached_tokens
