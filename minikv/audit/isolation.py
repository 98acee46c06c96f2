"""The concurrent multi-tenant isolation audit: can one tenant's request use another's cache?

A timing audit (``minikv.audit.timing``) asks the question statistically, from outside.  This
audit asks it directly, with a workload built so that every cached token has exactly one
possible origin:

* every tenant ``t`` has a **private document** ``D_t`` (a random, per-run tag first, so no two
  tenants' documents share even their first block), and all tenants share one **system
  prompt** ``S`` (random per run too, so nothing is left over from earlier runs);
* requests run in *waves*; the requests of a wave are sent concurrently, tenants interleaved,
  so they join the same continuous batches -- isolation must hold inside a batch, not only
  between quiet requests;
* each request has a label that says where its cached tokens could come from:

  ====================  ==============================================  ==================
  label                 request                                          cached tokens are
  ====================  ==============================================  ==================
  ``private-prime``     t's first ``D_t + q``                            cross-tenant
  ``system-prime``      the first tenant's first ``S + q``               cross-tenant
  ``private-repeat``    t re-sends ``D_t + q'`` (same key or another     same-tenant
                        key of the same tenant)
  ``system-first``      u's first ``S + q`` after another tenant's       cross-tenant
  ``private-copy``      u sends another tenant's ``D_v + q''`` --        cross-tenant
                        exactly what a prompt-stealing attacker does
  ``system-repeat``     u re-sends ``S + q'''``                          same-tenant
  ====================  ==============================================  ==================

The verdict needs **both directions**.  Cross-tenant cached tokens must be 0 -- else ``fail``.
But 0 alone proves nothing: if the cache never hits at all (caching off, per-request
isolation, or an audit that cannot see hits), a cross-tenant check "passes" vacuously.  SGLang
#23300 is the cautionary tale: a one-sided isolation test passed while the salt never reached
the scheduler.  So same-tenant cached tokens must be > 0, proving that this very audit *could*
see a hit; otherwise the verdict is ``inconclusive``, never ``pass``.

Two modes
---------
* :func:`audit_engine` runs the workload in-process against an engine configuration.  It reads
  ground truth: a block-manager listener records every ``hit`` with the tenant that *wrote* the
  block (and whether it lies in an operator-declared public prefix, which every tenant may
  share), and after every step it checks that no running request holds a private block written
  by another tenant.
* :func:`audit_server` runs it against a server URL with several API keys, reading
  ``usage.prompt_tokens_details.cached_tokens`` (``minikv serve --report-cached-tokens``, or
  vLLM's ``--enable-prompt-tokens-details``).  From outside, the label of a request says whose
  cache its hits can have come from.

``minikv audit isolation`` wraps both; its exit status is 2 on a violation, 3 when inconclusive.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping, Sequence

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"

#: label -> whose cache a hit of that request must have come from
LABELS = {"private-prime": "cross", "system-prime": "cross", "private-repeat": "same",
          "system-first": "cross", "private-copy": "cross", "system-repeat": "same"}

_WORDS = (
    "apple river stone cloud market silver garden window engine copper forest planet bridge "
    "candle harbor island ladder meadow orange pencil rocket saddle tunnel valley wagon yellow "
    "anchor basket cactus dragon falcon glacier hammer jungle kettle lantern magnet needle "
    "oyster parrot quartz ribbon sandal tiger umbrella violin walnut zebra amber blossom canyon "
    "desert ember fossil granite horizon ivory jasmine kernel lemon marble nectar olive pepper "
    "quiver raven summit thistle urchin velvet willow cobalt dune echo fjord grove haze"
).split()


@dataclass(frozen=True)
class AuditRequest:
    """One request of the workload (``prompt`` never leaves the auditor's process)."""

    wave: int
    label: str
    tenant: str
    prompt: str = field(repr=False)

    @property
    def expect(self) -> str:
        return LABELS[self.label]


def build_workload(tenants: Sequence[str], rounds: int = 2, seed: int = 0, salt: str | None = None,
                   prompt_words: int = 40, question_words: int = 6) -> list[list[AuditRequest]]:
    """The waves of requests described in the module docstring (each wave: tenants interleaved).

    ``salt`` (random by default) makes every prompt new to the server, so nothing cached by an
    earlier run -- or by other traffic -- can hit.  ``seed`` fixes the order within waves.
    """
    tenants = list(dict.fromkeys(tenants))
    if len(tenants) < 2:
        raise ValueError(f"the isolation audit needs at least 2 tenants, got {len(tenants)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if prompt_words < 4 or question_words < 1:
        raise ValueError("prompt_words must be >= 4 and question_words >= 1")
    salt = salt if salt is not None else os.urandom(8).hex()
    rng = random.Random(f"{seed}:{salt}")

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    def tag(t: str) -> str:  # distinct first characters per tenant: no shared first block
        return hashlib.sha256(f"{salt}/{t}".encode()).hexdigest()[:12]

    system = f"{salt} system prompt: you are the assistant of the {words(2)} company. {words(prompt_words)}."
    docs = {t: f"{tag(t)} private notes, keep secret: {words(prompt_words)}." for t in tenants}

    def q() -> str:
        return f" Question: {words(question_words)}?"

    n = len(tenants)
    waves: list[list[AuditRequest]] = []
    w0 = [AuditRequest(0, "private-prime", t, docs[t] + q()) for t in tenants]
    w0.append(AuditRequest(0, "system-prime", tenants[0], system + q()))
    w1 = [AuditRequest(1, "private-repeat", t, docs[t] + q()) for t in tenants]
    w1 += [AuditRequest(1, "system-first", u, system + q()) for u in tenants[1:]]
    w1 += [AuditRequest(1, "private-copy", u, docs[tenants[(i + 1) % n]] + q()) for i, u in enumerate(tenants)]
    w2 = [AuditRequest(2, "system-repeat", t, system + q()) for t in tenants]
    waves += [w0, w1, w2]
    for r in range(1, rounds):  # repeated prefixes, and copies of documents not copied before
        w = [AuditRequest(2 + r, "private-repeat", t, docs[t] + q()) for t in tenants]
        w += [AuditRequest(2 + r, "system-repeat", t, system + q()) for t in tenants]
        if r + 1 < n:
            w += [AuditRequest(2 + r, "private-copy", u, docs[tenants[(i + r + 1) % n]] + q())
                  for i, u in enumerate(tenants)]
        waves.append(w)
    for w in waves:
        rng.shuffle(w)
    return waves


# ---------------------------------------------------------------------------------------- report
@dataclass
class IsolationReport:
    """What one isolation audit saw, and its verdict (``pass`` / ``fail`` / ``inconclusive``)."""

    mode: str                              # "engine" or "server"
    target: str                            # engine settings or base URL (no keys, no secrets)
    tenants: tuple[str, ...]
    n_requests: int
    failures: int
    cross_tenant_cached_tokens: int
    same_tenant_cached_tokens: int
    public_cached_tokens: int = 0          # hits on operator-declared shared prefixes (allowed)
    foreign_block_holds: int = 0           # engine mode: private blocks of tenant A held by B
    by_label: dict = field(default_factory=dict)   # label -> {"requests", "cached_tokens"}
    violations: list = field(default_factory=list)  # one dict per offending request
    notes: list = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def violation(self) -> bool:
        return self.cross_tenant_cached_tokens > 0 or self.foreign_block_holds > 0

    @property
    def verdict(self) -> str:
        if self.violation:
            return FAIL
        if self.same_tenant_cached_tokens == 0 or self.failures:
            return INCONCLUSIVE
        return PASS

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def explanation(self) -> str:
        if self.violation:
            return (f"VIOLATION: {self.cross_tenant_cached_tokens} prompt tokens were served from another "
                    f"tenant's cache ({len(self.violations)} request(s))")
        if self.failures:
            return f"{self.failures} request(s) failed: the audit is incomplete"
        if self.same_tenant_cached_tokens == 0:
            return ("no cross-tenant hits, but no same-tenant hits either: the audit never saw a cache hit, "
                    "so it cannot tell isolation from a cache that is off (or invisible to it)")
        return (f"isolated: 0 cross-tenant cached tokens, {self.same_tenant_cached_tokens} same-tenant "
                f"cached tokens (the audit can see hits)")

    def summary(self) -> str:
        """Deterministic text for a fixed configuration (no timings, no addresses)."""
        lines = [f"isolation audit ({self.mode}), {len(self.tenants)} tenants, {self.n_requests} requests, "
                 f"{self.failures} failed",
                 f"  cross-tenant cached tokens: {self.cross_tenant_cached_tokens}",
                 f"  same-tenant cached tokens:  {self.same_tenant_cached_tokens}"]
        if self.public_cached_tokens:
            lines.append(f"  public-prefix cached tokens: {self.public_cached_tokens}")
        if self.mode == "engine":
            lines.append(f"  foreign private blocks held: {self.foreign_block_holds}")
        lines.append(f"verdict: {self.verdict.upper()} -- {self.explanation()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(verdict=self.verdict, violation=self.violation, explanation=self.explanation())
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _tally(report_labels: dict, label: str, cached: int) -> None:
    entry = report_labels.setdefault(label, {"requests": 0, "cached_tokens": 0})
    entry["requests"] += 1
    entry["cached_tokens"] += cached


# ---------------------------------------------------------------------------------------- engine mode
def _as_engine(llm_or_engine_kwargs):
    if isinstance(llm_or_engine_kwargs, Mapping):
        from ..engine.llm import LLM
        return LLM(**dict(llm_or_engine_kwargs)).engine
    from ..engine.config import EngineConfig
    if isinstance(llm_or_engine_kwargs, EngineConfig):
        from ..engine.engine import LLMEngine
        return LLMEngine(llm_or_engine_kwargs)
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
        if event != "hit" or seq is None or seq.request_id not in seq_of:
            return
        with lock:
            for bid in block_ids:
                b = bm.blocks[bid]
                kind = "public" if b.public else ("same" if b.writer_tenant == seq.tenant else "cross")
                hits[seq.request_id][kind] += bs
                if kind == "cross":
                    hits[seq.request_id].setdefault("owners", set()).add(b.writer_tenant)  # type: ignore[arg-type]

    def check_holders() -> None:
        for seq in list(eng.scheduler.running):
            if seq.request_id not in seq_of:
                continue
            for bid in seq.block_table:
                b = bm.blocks[bid]
                if not b.public and b.writer_tenant != seq.tenant:
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


# ---------------------------------------------------------------------------------------- server mode
def audit_server(base_url: str, api_keys: Mapping[str, str], model: str | None = None, rounds: int = 2,
                 seed: int = 0, salt: str | None = None, prompt_words: int = 40, concurrency: int = 8,
                 timeout: float = 120.0, max_tokens: int = 1) -> IsolationReport:
    """Audit a running OpenAI-compatible server with several API keys (``{key: tenant}``).

    Needs ``usage.prompt_tokens_details.cached_tokens`` in responses; without it the verdict is
    ``inconclusive`` (nothing observable).  Where a tenant has several keys, repeats use a
    different key than the prime, which also checks that isolation follows the tenant, not the key.
    The requests of each wave are sent concurrently by ``concurrency`` threads.  Keys are never
    stored in the report.
    """
    import httpx

    by_tenant: dict[str, list[str]] = defaultdict(list)
    for key, tenant in api_keys.items():
        by_tenant[tenant].append(key)
    tenants = list(by_tenant)
    waves = build_workload(tenants, rounds, seed, salt, prompt_words)
    base = base_url.rstrip("/")
    use_count: dict[str, int] = defaultdict(int)

    def key_for(tenant: str) -> str:
        keys = by_tenant[tenant]
        k = keys[use_count[tenant] % len(keys)]
        use_count[tenant] += 1
        return k

    t0 = time.perf_counter()
    by_label: dict = {}
    violations: list[dict] = []
    notes: list[str] = []
    cross = same = failures = n = 0
    missing_details = 0
    with httpx.Client(timeout=timeout) as http:
        if model is None:
            r = http.get(f"{base}/models", headers={"Authorization": f"Bearer {next(iter(api_keys))}"})
            if r.status_code != 200 or not r.json().get("data"):
                raise RuntimeError(f"GET {base}/models failed ({r.status_code}); pass model=")
            model = r.json()["data"][0]["id"]

        def send(job: tuple[AuditRequest, str]) -> tuple[AuditRequest, int | None, str | None]:
            req, key = job
            body = {"model": model, "prompt": req.prompt, "max_tokens": max_tokens, "temperature": 0}
            try:
                r = http.post(f"{base}/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            except httpx.HTTPError as exc:
                return req, None, type(exc).__name__
            if r.status_code != 200:
                return req, None, f"HTTP {r.status_code}"
            details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            return req, (cached if isinstance(cached, int) else -1), None

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            for wave in waves:
                jobs = [(req, key_for(req.tenant)) for req in wave]
                for req, cached, err in pool.map(send, jobs):
                    n += 1
                    if err is not None:
                        failures += 1
                        if len(notes) < 5:
                            notes.append(f"{req.label} request of {req.tenant!r} failed: {err}")
                        continue
                    if cached < 0:
                        missing_details += 1
                        cached = 0
                    _tally(by_label, req.label, cached)
                    if req.expect == "cross":
                        cross += cached
                        if cached:
                            violations.append({"label": req.label, "tenant": req.tenant, "cached_tokens": cached})
                    else:
                        same += cached
    if missing_details:
        notes.append(f"{missing_details} response(s) had no usage.prompt_tokens_details.cached_tokens: "
                     "the server does not report cache hits (minikv: --report-cached-tokens)")
    return IsolationReport("server", base, tuple(tenants), n, failures, cross, same, 0, 0, by_label,
                           violations, notes, time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------- CLI
def _cmd_isolation(args: argparse.Namespace) -> int:
    try:
        if args.base_url:
            if args.model:
                print("error: give either --model (in-process) or --base-url (server), not both",
                      file=sys.stderr)
                return 1
            if not args.api_keys:
                print("error: --base-url needs --api-keys FILE (JSON: key -> tenant, >= 2 tenants)",
                      file=sys.stderr)
                return 1
            with open(args.api_keys, encoding="utf-8") as fh:
                keys = json.load(fh)
            if not isinstance(keys, dict):
                raise ValueError("--api-keys must hold a JSON object mapping key -> tenant")
            report = audit_server(args.base_url, keys, model=args.served_model, rounds=args.rounds,
                                  seed=args.seed_workload, concurrency=args.concurrency,
                                  prompt_words=args.prompt_words, timeout=args.timeout)
        else:
            if not args.model:
                print("error: give --model M (in-process) or --base-url URL --api-keys FILE", file=sys.stderr)
                return 1
            from ..serve.cli import engine_kwargs_from_args
            tenants = [t for t in args.tenants.split(",") if t]
            report = audit_engine(engine_kwargs_from_args(args), tenants=tenants, rounds=args.rounds,
                                  seed=args.seed_workload, prompt_words=args.prompt_words)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report.to_json() if args.json else report.summary())
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    return {PASS: 0, FAIL: 2, INCONCLUSIVE: 3}[report.verdict]


def add_isolation_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``audit isolation`` on the audit subparsers (see ``minikv.audit.cli``)."""
    from ..serve.cli import add_engine_arguments

    p = sub.add_parser("isolation", help="concurrent multi-tenant isolation audit (engine or server)",
                       description="Check that no request is served from another tenant's cache, and that "
                                   "the audit could see same-tenant hits at all.  Exit status: 0 pass, "
                                   "2 violation, 3 inconclusive, 1 error.")
    p.add_argument("--base-url", help="audit a running server (API root ending in /v1)")
    p.add_argument("--api-keys", metavar="FILE", help="JSON key -> tenant (server mode; >= 2 tenants)")
    p.add_argument("--served-model", help="server mode: model id (default: first of GET /models)")
    p.add_argument("--tenants", default="alice,bob,carol", help="engine mode: comma-separated tenants")
    p.add_argument("--rounds", type=int, default=2, help="rounds of repeated prefixes (default 2)")
    p.add_argument("--prompt-words", type=int, default=40, help="words per system prompt / document")
    p.add_argument("--concurrency", type=int, default=8, help="server mode: parallel requests")
    p.add_argument("--timeout", type=float, default=120.0, help="server mode: per-request timeout (s)")
    p.add_argument("--seed-workload", type=int, default=0, help="order of requests within waves")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_engine_arguments(p, model_required=False)
    p.set_defaults(func=_cmd_isolation)
    return p
