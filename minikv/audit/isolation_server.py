"""The isolation audit against a running server: several API keys, and ``cached_tokens``.

An outsider cannot see who wrote a cached block, but it does not need to: the workload
(:func:`~minikv.audit.isolation.build_workload`) is built so that the *label* of each request says
whose cache its hits can have come from.  Any ``usage.prompt_tokens_details.cached_tokens`` on a
``cross`` request is therefore another tenant's cache serving this one.  The server must report
that field (``minikv serve --report-cached-tokens``, vLLM ``--enable-prompt-tokens-details``);
without it nothing is observable and the verdict is ``inconclusive``.

Isolation must follow the *tenant*, not the key: where a tenant has several keys, first sends use
its first key and repeats its last, so the same-tenant hits that make the verdict conclusive have
to cross keys.  A server that isolates per key (too strict, but easy to mistake for correct) does
not get a ``pass``.
"""
from __future__ import annotations

import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from typing import Mapping

from .isolation import AuditRequest, IsolationReport, _tally, build_workload


def audit_server(base_url: str, api_keys: Mapping[str, str], model: str | None = None, rounds: int = 2,
                 seed: int = 0, salt: str | None = None, prompt_words: int = 40, concurrency: int = 8,
                 timeout: float = 120.0, max_tokens: int = 1, prime_url: str | None = None) -> IsolationReport:
    """Audit a running OpenAI-compatible server with several API keys (``{key: tenant}``).

    Needs ``usage.prompt_tokens_details.cached_tokens`` in responses; without it the verdict is
    ``inconclusive`` (nothing observable).  Where a tenant has several keys, first sends use its
    first key and repeats its last one, so same-tenant hits must cross keys: isolation has to follow
    the tenant, not the key.
    The requests of each wave are sent concurrently by ``concurrency`` threads.  Keys are never
    stored in the report.

    ``prime_url``: another instance (same keys) that receives the first wave -- every tenant's first
    send of its document and of the system prompt -- while everything after goes to ``base_url``.
    That audits a fleet sharing a KV tier: a ``cross`` hit on ``base_url`` is then another tenant's
    block cached through the *other* instance (LMCache #4825's salt-drop), and the same-tenant hits
    that make the verdict conclusive must cross instances too.
    """
    import httpx

    by_tenant: dict[str, list[str]] = defaultdict(list)
    for key, tenant in api_keys.items():
        by_tenant[tenant].append(key)
    tenants = list(by_tenant)
    waves = build_workload(tenants, rounds, seed, salt, prompt_words)
    base = base_url.rstrip("/")
    prime = prime_url.rstrip("/") if prime_url else base

    def key_for(req: AuditRequest) -> str:
        # First sends use the tenant's first key, repeats its last: with two keys per tenant the
        # same-tenant hits must cross keys, so a server that isolates per *key* is not "passed".
        keys = by_tenant[req.tenant]
        return keys[0] if req.expect == "cross" else keys[-1]

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
                url = prime if req.wave == 0 else base  # the first wave primes the other instance, if any
                r = http.post(f"{url}/completions", json=body, headers={"Authorization": f"Bearer {key}"})
            except httpx.HTTPError as exc:
                return req, None, type(exc).__name__
            if r.status_code != 200:
                return req, None, f"HTTP {r.status_code}"
            details = (r.json().get("usage") or {}).get("prompt_tokens_details") or {}
            cached = details.get("cached_tokens")
            return req, (cached if isinstance(cached, int) else -1), None

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            for wave in waves:
                jobs = [(req, key_for(req)) for req in wave]
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
