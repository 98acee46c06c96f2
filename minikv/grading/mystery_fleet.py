"""The capstone's mystery fleet (lesson 12): N minikv servers, some misconfigured, behind HTTP.

    python -m minikv.grading.mystery_fleet [--seed N] [--nodes 5 | --graded]

Run as a subprocess by the capstone grader (and by lesson 12 with a fixed seed).  From its seed
(``os.urandom`` by default) it draws a random subset of :data:`KINDS`, puts each on its own
random node (a graded fleet, ``--graded``, carries every kind: :func:`draw_graded_fleet`), and
serves every node with the real app (:func:`minikv.serve.create_app`, tiny-random, ``cached_tokens``
reported) on its own loopback port.  It prints one JSON line -- the node URLs,
two tenants' API keys, the auditor's key and the list of kinds -- and prints the **answer key**
(which node has which misconfiguration, and how many requests each node served) only when its
stdin closes.  The learner's process never holds the answer.

Every node publishes, like a real operator would:

* ``GET /fleet/node``  -- its block size and its operator-declared public prefix (a system prompt
  shared on purpose; hits on it across tenants are expected, not a finding);
* ``GET /fleet/trail`` -- its request-level audit trail (JSONL, no prompt text), for the
  auditor's key only: feed it to ``minikv audit detect``.

The misconfigurations, each one observable from outside:

``shared_cache``        ``cache_isolation="shared"``: another tenant's private prompt hits, and the
                        trail records the cross-tenant hits.
``tenant_key_dropped``  the server loses the tenant on the way to the engine (a serving bug: the
                        request reaches the hash with no tenant), so all tenants share one cache.
                        Private prompts hit across tenants, but the trail shows every request as
                        the *same* (anonymous) tenant and no cross-tenant hit at all.
``first_block_only``    tenant keys on the first block only (``KeyedFirstBlockOnly``, hits verified on
                        their tokens only, as in engines without minikv's identity check): harmless until
                        a prompt starts with the public prefix, whose blocks are unkeyed -- then
                        every private block after it is shared (lesson 07).
``weak_hash``           ``hash_algo="poly"`` with ``verify_hits=False``: a crafted twin block
                        (lesson 06, :func:`minikv.attacks.collisions.poly_collision`) is served
                        from the original's cache entry.
``client_salt_key``     the node keys the cache by the request's ``cache_salt`` alone when one is
                        sent (vLLM's ``cache_salt`` contract, where the salt *is* the isolation,
                        with no tenant behind it): two tenants who send the same salt share a cache.
                        Requests without a salt are tenant-keyed, so the isolation audit passes.
                        **Hidden**: no cell of lesson 12 demonstrates it; the learner designs its test.

Clean nodes are decoys: they declare a public prefix too, and some use ``poly`` *with*
``verify_hits=True``, whose collisions are caught by the engine and never served.
"""
from __future__ import annotations

import argparse
import contextvars
import hashlib
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
from fastapi import Request  # at module level: FastAPI resolves the routes' annotations here
from .sealed import make_undumpable

VISIBLE_KINDS = ("shared_cache", "tenant_key_dropped", "first_block_only", "weak_hash")  # lesson 12 shows each
HIDDEN_KINDS = ("client_salt_key",)  # no lesson cell shows it: the learner designs the test
KINDS = VISIBLE_KINDS + HIDDEN_KINDS
API_KEYS = {"sk-fleet-alice": "alice", "sk-fleet-bob": "bob"}
AUDITOR_KEY = "sk-fleet-auditor"
PUBLIC_PREFIXES = ("You are a helpful assistant of the Acme fleet. Answer in one sentence, politely. ",
                   "System: you answer questions about the weather in short, friendly sentences. ")
BLOCK_SIZE = 16


def draw_fleet(seed: int, num_nodes: int = 5) -> list[dict]:
    """Per node: {"kind": one of KINDS or None, "public_prefix": str, "decoy_poly": bool}."""
    if num_nodes < len(KINDS):
        raise ValueError(f"num_nodes must be >= {len(KINDS)} (one node per kind), got {num_nodes}")
    rng = np.random.default_rng(seed)
    kinds = [k for k in VISIBLE_KINDS if rng.random() < 0.6] or [VISIBLE_KINDS[int(rng.integers(len(VISIBLE_KINDS)))]]
    slots = rng.permutation(num_nodes)[:len(kinds)]
    nodes = [{"kind": None, "public_prefix": PUBLIC_PREFIXES[int(rng.integers(2))],
              "decoy_poly": bool(rng.random() < 0.5)} for _ in range(num_nodes)]
    for kind, slot in zip(kinds, slots):
        nodes[int(slot)]["kind"] = kind
    # Hidden kinds are drawn last, onto nodes still clean: a seed keeps the visible kinds where they were
    free = [i for i, n in enumerate(nodes) if n["kind"] is None]
    for kind in HIDDEN_KINDS:
        if free and rng.random() < 0.6:
            nodes[free.pop(int(rng.integers(len(free))))]["kind"] = kind
    return nodes


#: nodes of a graded fleet: one per kind, one always clean, and one more, clean or a second copy of a kind
GRADED_NODES = len(KINDS) + 2


def draw_graded_fleet(seed: int) -> list[dict]:
    """A graded fleet: :data:`GRADED_NODES` nodes that carry **every** kind at least once, on random
    nodes, and at least one clean node.  :func:`draw_fleet`'s random subset suits a lesson, but
    grading on it would let an audit that never tests a kind pass whenever that kind was not drawn
    (40% of fleets for each): an audit without a ``cache_salt`` test passed 2 grades in a row in a
    timed walkthrough.  The last node is clean or a second copy of a random kind (even odds), so
    the count of clean nodes (1 or 2) does not let an audit name the last kind by elimination."""
    rng = np.random.default_rng(seed)
    extra = None if rng.random() < 0.5 else KINDS[int(rng.integers(len(KINDS)))]
    kinds = list(KINDS) + [None, extra]
    order = rng.permutation(GRADED_NODES)
    return [{"kind": kinds[int(i)], "public_prefix": PUBLIC_PREFIXES[int(rng.integers(2))],
             "decoy_poly": bool(rng.random() < 0.5)} for i in order]


_CLIENT_SALT: contextvars.ContextVar = contextvars.ContextVar("fleet_client_salt", default=None)


class SaltFromBody:
    """ASGI middleware of a ``client_salt_key`` node: reads the request body's ``cache_salt`` (a
    non-empty string, else None) into a context variable, then hands the app the same body.  The
    app itself ignores ``cache_salt``; the node's runner (below) is where the misconfiguration is."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, more = [], True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            salt = json.loads(body).get("cache_salt") if body else None
        except (ValueError, AttributeError):
            salt = None
        replayed = False

        async def replay():
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        token = _CLIENT_SALT.set(salt if isinstance(salt, str) and salt else None)
        try:
            await self.app(scope, replay, send)
        finally:
            _CLIENT_SALT.reset(token)


def _engine_settings(node: dict, secret: bytes, audit_log: str) -> dict:
    from .mutants.tenant_keys import KeyedFirstBlockOnly

    s = dict(device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=512, enable_prefix_caching=True,
             seed=0, engine_secret=secret, shared_prefixes=(node["public_prefix"],), audit_log=audit_log)
    kind = node["kind"]
    if kind == "shared_cache":
        s["cache_isolation"] = "shared"
    elif kind == "first_block_only":
        # verify_hits="tokens" compares a hit's tokens but not its tenant domain, as engines without
        # minikv's identity check do; the default check would catch the wrongly keyed block
        s.update(block_hasher=KeyedFirstBlockOnly(secret), verify_hits="tokens")
    elif kind == "weak_hash":
        s.update(hash_algo="poly", verify_hits=False)
    elif kind is None and node["decoy_poly"]:
        s["hash_algo"] = "poly"  # verify_hits stays True: a twin is detected and recomputed
    return s


def build_node(node: dict, audit_log: str):
    """The FastAPI app of one node, with its two published routes."""
    from fastapi.responses import JSONResponse, PlainTextResponse

    from ..engine.config import UnsafeSettingWarning
    from ..llm import LLM
    from ..serve import EngineRunner, ServeLimits, ServerMetrics, create_app

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        llm = LLM("tiny-random", **_engine_settings(node, os.urandom(32), audit_log))
    metrics = ServerMetrics()
    runner_cls = EngineRunner
    if node["kind"] == "tenant_key_dropped":
        class TenantDroppingRunner(EngineRunner):
            """The serving bug behind ``tenant_key_dropped``: the tenant never reaches the engine."""

            def submit(self, request_id, prompt, params, tenant=None):
                return super().submit(request_id, prompt, params, None)
        runner_cls = TenantDroppingRunner
    elif node["kind"] == "client_salt_key":
        class SaltKeyedRunner(EngineRunner):
            """The bug behind ``client_salt_key``: a sent salt replaces the tenant as the domain."""

            def submit(self, request_id, prompt, params, tenant=None):
                salt = _CLIENT_SALT.get()
                domain = tenant if salt is None else "cache_salt:" + hashlib.sha256(salt.encode()).hexdigest()[:16]
                return super().submit(request_id, prompt, params, domain)
        runner_cls = SaltKeyedRunner
    runner = runner_cls(llm.engine, metrics)
    limits = ServeLimits(requests_per_s=None, max_concurrent=None, max_queued=None)
    app = create_app(llm, API_KEYS, model_name="tiny", report_cached_tokens=True, limits=limits,
                     metrics=metrics, runner=runner)
    app.state.fleet_requests = 0
    if node["kind"] == "client_salt_key":
        app.add_middleware(SaltFromBody)

    @app.middleware("http")
    async def count(request: Request, call_next):
        app.state.fleet_requests += request.url.path.startswith("/v1/")
        return await call_next(request)

    @app.get("/fleet/node")
    async def node_card():
        return JSONResponse({"block_size": BLOCK_SIZE, "public_prefix": node["public_prefix"],
                             "trail": "/fleet/trail", "model": "tiny"})

    @app.get("/fleet/trail")
    async def trail(request: Request):
        if request.headers.get("authorization") != f"Bearer {AUDITOR_KEY}":
            return JSONResponse({"error": {"message": "the trail is for the auditor's key"}}, status_code=401)
        return PlainTextResponse(Path(audit_log).read_text(encoding="utf-8") if Path(audit_log).exists() else "")

    return app


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minikv.grading.mystery_fleet", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="fixed fleet (lessons); default: fresh from os.urandom")
    ap.add_argument("--nodes", type=int, default=5)
    ap.add_argument("--graded", action="store_true",
                    help=f"a graded fleet: every kind at least once on {GRADED_NODES} nodes (--nodes ignored)")
    args = ap.parse_args(argv)
    make_undumpable()  # before the secret exists: no other process of this user can read our memory
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(8), "big")
    from ..serve.background import BackgroundServer, stop_all

    nodes = draw_graded_fleet(seed) if args.graded else draw_fleet(seed, args.nodes)
    with tempfile.TemporaryDirectory() as tmp:
        apps = [build_node(n, str(Path(tmp) / f"node{i}.jsonl")) for i, n in enumerate(nodes)]
        servers = [BackgroundServer(a).start() for a in apps]
        try:
            urls = [s.base_url for s in servers]
            print(json.dumps({"nodes": urls, "api_keys": API_KEYS, "auditor_key": AUDITOR_KEY,
                              "kinds": list(KINDS), "model": "tiny"}), flush=True)
            sys.stdin.read()  # the grader closes our stdin when the audit is over
        finally:
            stop_all(servers)
    print(json.dumps({"findings": [{"node": u, "kind": n["kind"]} for u, n in zip(urls, nodes) if n["kind"]],
                      "requests": {u: a.state.fleet_requests for u, a in zip(urls, apps)}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
