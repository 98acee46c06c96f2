"""The isolation audit in-process: ground truth from the engine's own block manager.

From outside, a cached token is just a number in ``usage``; inside, every block knows which
tenant *wrote* it.  :func:`audit_engine` runs the workload of
:func:`~minikv.audit.isolation.build_workload` against an engine and watches two things:

* **every cache hit**: a block-manager listener records each ``hit`` -- and each ``adopt``, the
  same reuse found at commit (``lifecycle.REUSES``) -- with the tenant that wrote the block:
  ``same`` (the requesting tenant), ``cross`` (another tenant: a violation) or ``public`` (an
  operator-declared shared prefix, which every tenant may use);
* **every block held**: after each step, no running request may hold a private block that another
  tenant wrote.  This second check does not rely on the hit path: however a foreign block got into
  a request's block table, holding it fails the audit.

Requests arrive ``arrivals_per_step`` at a time between steps, so tenants share batches and
prefill runs next to decode: isolation must hold inside a batch, not only between quiet requests.
"""
from __future__ import annotations

import os
import threading
import time
from collections import defaultdict
from typing import Mapping, Sequence

from ..engine.lifecycle import REUSES, crosses_tenants
from .isolation import AuditRequest, IsolationReport, _tally, build_workload


def _as_engine(llm_or_engine_kwargs):
    if isinstance(llm_or_engine_kwargs, Mapping):
        from ..llm import LLM
        return LLM(**dict(llm_or_engine_kwargs)).engine
    from ..engine.config import EngineConfig
    if isinstance(llm_or_engine_kwargs, EngineConfig):
        from ..llm import build_engine
        return build_engine(llm_or_engine_kwargs)
    return getattr(llm_or_engine_kwargs, "engine", llm_or_engine_kwargs)


def audit_engine(llm_or_engine_kwargs, tenants: Sequence[str] = ("alice", "bob", "carol"), rounds: int = 2,
                 seed: int = 0, salt: str | None = None, prompt_words: int = 40, arrivals_per_step: int = 2,
                 max_tokens: int = 2) -> IsolationReport:
    """Audit an engine in-process (ground truth from the block manager).

    ``llm_or_engine_kwargs`` is an ``LLM``, an ``LLMEngine``, an ``EngineConfig`` or a dict of
    ``LLM`` keyword arguments (``{"model": "tiny-random", "enable_prefix_caching": True, ...}``).
    The engine must be idle.  Within a wave, ``arrivals_per_step`` new requests join before each
    engine step, so requests of different tenants run in the same batches, prefill next to decode.
    """
    from ..engine.sampling import SamplingParams

    eng = _as_engine(llm_or_engine_kwargs)
    if eng.has_unfinished_requests():
        raise ValueError("the engine has unfinished requests; audit an idle engine")
    waves = build_workload(tenants, rounds, seed, salt, prompt_words)
    bm, bs = eng.block_manager, eng.block_size
    seq_of: dict[str, AuditRequest] = {}
    hits: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))  # rid -> owner class -> tokens
    violations: list[dict] = []
    foreign: set[tuple[str, int]] = set()
    lock = threading.Lock()

    def on_event(event: str, block_ids: list[int], seq) -> None:
        if event not in REUSES or seq is None or seq.request_id not in seq_of:  # adoptions count too
            return
        with lock:
            for bid in block_ids:
                b = bm.blocks[bid]
                cross = crosses_tenants((seq.tenant, b.writer_tenant), b.public)
                kind = "cross" if cross else ("public" if b.public else "same")
                hits[seq.request_id][kind] += bs
                if kind == "cross":
                    hits[seq.request_id].setdefault("owners", set()).add(b.writer_tenant)  # type: ignore[arg-type]

    def check_holders() -> None:
        for seq in list(eng.scheduler.running):
            if seq.request_id not in seq_of:
                continue
            for bid in seq.block_table:
                b = bm.blocks[bid]
                if crosses_tenants((seq.tenant, b.writer_tenant), b.public):
                    foreign.add((seq.request_id, bid))

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    by_label: dict = {}
    cross = same = public = n = 0
    prefix = f"iso-{os.urandom(4).hex()}-"
    t0 = time.perf_counter()
    bm.listeners.append(on_event)
    try:
        for wave in waves:
            todo, pending, finished = list(wave), set(), {}
            while todo or pending:
                for req in todo[:arrivals_per_step]:
                    rid = f"{prefix}{n}"
                    n += 1
                    seq_of[rid] = req
                    eng.add_request(rid, req.prompt, params, tenant=req.tenant)
                    pending.add(rid)
                todo = todo[arrivals_per_step:]
                for out in eng.step():
                    if out.finished and out.request_id in pending:
                        pending.discard(out.request_id)
                        finished[out.request_id] = out
                check_holders()
            for rid, out in finished.items():
                req = seq_of[rid]
                h = hits.get(rid, {})
                c, s, p = h.get("cross", 0), h.get("same", 0), h.get("public", 0)
                cross, same, public = cross + c, same + s, public + p
                _tally(by_label, req.label, out.num_cached_tokens)
                if c:
                    violations.append({"label": req.label, "tenant": req.tenant, "cached_tokens": c,
                                       "owners": sorted(str(o) for o in h.get("owners", ()))})
    finally:
        bm.listeners.remove(on_event)
    cfg = eng.config
    target = (f"{cfg.model} cache_isolation={cfg.cache_isolation} prefix_caching={cfg.enable_prefix_caching} "
              f"hash={cfg.hash_algo} block_size={eng.block_size}")
    notes = []
    if not cfg.enable_prefix_caching:
        notes.append("prefix caching is disabled: no request can hit any cache")
    return IsolationReport("engine", target, tuple(dict.fromkeys(tenants)), n, 0, cross, same, public,
                           len(foreign), by_label, violations, notes, time.perf_counter() - t0)
