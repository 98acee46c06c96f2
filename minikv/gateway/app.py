"""The gateway's HTTP app: the course's defenses in front of any OpenAI-compatible engine.

    app = create_gateway_app(GatewayConfig(upstreams=("http://127.0.0.1:8017/v1",),
                                           secret=secrets.token_bytes(32)), keys)

One request's path, cheapest check first (the order ``minikv serve`` uses, for the same
reason: a tenant must not be able to slow others down with requests that are refused anyway):

1. API key -> identity (401), the tenant's request rate (429; ``/v1/models`` counts too),
   ``Content-Length`` (413);
2. one of the tenant's concurrency slots (429 when too many already wait);
3. the body: strict JSON (400), the prompt's size (``--max-prompt-chars``, ``--max-messages``:
   400), ``max_tokens`` at most the cap (400; absent -> the cap), the tenant's decode budget (429);
4. the salt of this identity replaces whatever ``cache_salt`` the client sent; the prompt's
   tokens (upstream tokenizer) pick the upstream (:mod:`minikv.gateway.routing`);
5. forward (:mod:`minikv.gateway.proxy`) -- to a minikv upstream with the tenant's name in
   ``X-Minikv-Tenant``, which only the gateway's key may send there (:mod:`minikv.serve.identity`),
   so the upstream's per-tenant limits see tenants -- pass the answer back, write one trail record.

Nothing a client sends can choose its salt, tenant or user.  The limits, key loader and metrics
are ``minikv serve``'s own (:mod:`minikv.serve.limits`, :mod:`minikv.serve.auth`,
:mod:`minikv.serve.metrics`); ``/metrics`` and ``/admin/findings`` answer operator keys only.
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter

from ..serve.auth import ApiKeys
from ..serve.limits import Lease, ServeLimits, TenantLimiter
from ..serve.metrics import ServerMetrics
from ..serve.middleware import GuardedStreamingResponse, MetricsMiddleware, QueryStringGuard, install_error_handlers
from ..serve.protocol import APIError, read_json
from ..serve.routes import add_openai_routes
from . import proxy
from .routing import SaltAwareRouter
from .salt import GatewayKeys, Identity, derive_salt

log = logging.getLogger("minikv.gateway")


@dataclass
class GatewayConfig:
    """Everything the app needs besides the keys.

    upstreams: API roots ending in ``/v1``.  upstream_key: the gateway's own key for them.
    secret: the gateway secret (>= 16 bytes) the salts are derived from -- keep it stable, or
    every tenant's cache goes cold on restart.  salt_scope: ``"tenant"`` or ``"user"``.
    salt_header: also send the salt as ``X-Cache-Salt``.  max_tokens_cap: per-request cap (and
    the value used when a request gives none).  prefix_tokens: routing key length.
    tenant_upstreams: the upstreams that are told each request's tenant (``X-Minikv-Tenant``:
    ``minikv serve --gateway-keys``), so that their per-tenant limits apply per tenant.
    """

    upstreams: tuple[str, ...]
    secret: bytes
    upstream_key: str | None = None
    salt_scope: str = "tenant"
    salt_header: bool = False
    limits: ServeLimits = field(default_factory=ServeLimits)
    max_tokens_cap: int = 512
    prefix_tokens: int = 128
    timeout: float = 300.0
    tenant_upstreams: tuple[str, ...] = ()


def _max_tokens(body: dict, chat: bool, cap: int) -> int:
    """Validate the request's ``max_tokens`` against ``cap``; set it when absent."""
    names = ("max_tokens", "max_completion_tokens") if chat else ("max_tokens",)
    given = [(n, body[n]) for n in names if body.get(n) is not None]
    for name, value in given:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise APIError(400, f"'{name}' must be a positive integer, got {value!r}", param=name)
        if value > cap:
            raise APIError(400, f"{name}={value} is above this gateway's cap of {cap} tokens per request",
                           param=name, code="max_tokens_above_cap")
    if not given:
        body["max_tokens"] = cap
    return max((v for _, v in given), default=cap)


def check_prompt_size(body: dict, chat: bool, limits: ServeLimits) -> None:
    """``--max-prompt-chars`` and ``--max-messages``, before anything tokenizes the prompt.  Only
    the sizes: the shape of a prompt is the upstream's to judge (vLLM takes roles and content
    parts minikv does not), so whatever is not text or a list of messages passes to it."""
    cap = limits.max_prompt_chars
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return
        if len(messages) > limits.max_messages:
            raise APIError(400, f"'messages' has {len(messages)} messages; this gateway accepts at most "
                                f"{limits.max_messages} (--max-messages)", param="messages")
        total = sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict))
        what = "'messages' content"
    else:
        prompt = body.get("prompt")
        total = _text_chars(prompt) if not (isinstance(prompt, list) and prompt and isinstance(prompt[0], int)) \
            else len(prompt)
        what = "'prompt'"
    if cap is not None and total > cap:
        raise APIError(400, f"{what} has {total} characters; this gateway accepts at most {cap} "
                            "(--max-prompt-chars)", param="messages" if chat else "prompt", code="prompt_too_long")


def _text_chars(content) -> int:
    """Characters of a prompt or message content: a string, text parts, or a list of strings."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(_text_chars(p.get("text") if isinstance(p, dict) else p) for p in content)
    return 0


def create_gateway_app(config: GatewayConfig, keys: GatewayKeys, *, operator_keys: ApiKeys | None = None,
                       tokens=None, trail=None, transport: httpx.AsyncBaseTransport | None = None) -> FastAPI:
    """Build the app.  ``tokens``: a :class:`~minikv.gateway.oversight.PromptTokens` (routing
    key and trail; None routes on the salt alone and keeps no trail).  ``trail``: a
    :class:`~minikv.gateway.oversight.GatewayTrail`.  ``transport``: for tests."""
    limiter = TenantLimiter(config.limits)
    router = SaltAwareRouter(config.upstreams, config.prefix_tokens)
    metrics = ServerMetrics()
    replaced = Counter("minikv_gateway_client_salts_replaced", "Requests whose client-sent cache_salt "
                       "(body or header) was replaced, by tenant", ["tenant"], registry=metrics.registry)
    upstream_errors = Counter("minikv_gateway_upstream_errors", "Requests the gateway could not serve "
                              "because an upstream failed", ["upstream", "code"], registry=metrics.registry)
    salts: dict[Identity, str] = {}
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = httpx.AsyncClient(timeout=httpx.Timeout(config.timeout, connect=5.0),
                                            transport=transport, limits=httpx.Limits(max_connections=256))
        try:
            yield
        finally:
            await state["client"].aclose()
            if trail is not None:
                trail.close()

    app = FastAPI(title="minikv-gateway", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.metrics, app.state.limiter, app.state.router = metrics, limiter, router
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(QueryStringGuard)
    install_error_handlers(app, metrics)

    def identity_of(request: Request) -> Identity:
        raw = next((v for k, v in request.scope["headers"] if k == b"authorization"), None)
        who = keys.resolve(raw)
        if who is None:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        request.state.tenant = who.tenant
        return who

    def tenant_for(upstream: str, who: Identity) -> str | None:
        return who.tenant if upstream in config.tenant_upstreams else None

    def salt_of(who: Identity) -> str:
        if who not in salts:
            salts[who] = derive_salt(config.secret, who, config.salt_scope)
        return salts[who]

    def operator(request: Request) -> None:
        if operator_keys is None:
            raise APIError(404, "operator endpoints need --operator-keys", "not_found_error",
                           code="operator_endpoints_disabled")
        raw = next((v for k, v in request.scope["headers"] if k == b"authorization"), None)
        if operator_keys.resolve(raw) is None:
            raise APIError(401, "invalid or missing operator key", code="invalid_api_key")

    def finish(who: Identity, ids: list[int], slot: int, status: int, usage: dict | None) -> None:
        usage = usage or {}
        cached = proxy.cached_tokens_of({"usage": usage})
        if status == 200 and isinstance(usage.get("prompt_tokens"), int):
            metrics.observe_finish(usage["prompt_tokens"], cached or 0, usage.get("completion_tokens") or 0,
                                   "stop", None, who.tenant)
        if trail is not None and ids:
            trail.record(who.tenant, ids, upstream=slot, status=status, cached_tokens=cached)

    async def handle(request: Request, chat: bool, who: Identity, lease: Lease):
        """An admitted request (:mod:`minikv.serve.routes`): body, salt, upstream, answer."""
        body = await read_json(request, config.limits.max_body_bytes)
        check_prompt_size(body, chat, config.limits)
        n = _max_tokens(body, chat, config.max_tokens_cap)
        try:
            lease.reserve(n)
        except ValueError as exc:
            raise APIError(400, str(exc), param="max_tokens") from None
        if "cache_salt" in body or request.headers.get("x-cache-salt") is not None:
            replaced.labels(tenant=who.tenant).inc()
        salt = salt_of(who)
        body = proxy.salted(body, salt)
        ids: list[int] = []
        if tokens is not None:
            try:
                ids = await asyncio.to_thread(tokens.of_body, body, chat)
            except Exception as exc:   # noqa: BLE001 -- a chat template raises its own kinds
                raise APIError(400, f"cannot tokenize the prompt ({type(exc).__name__}): {exc}"[:500]) from None
        path = "/chat/completions" if chat else "/completions"
        client: httpx.AsyncClient = state["client"]
        last: APIError | None = None
        for upstream in router.ranking(salt, ids):   # the best first; the next only if it cannot connect
            slot = config.upstreams.index(upstream)
            headers = proxy.upstream_headers(salt, config.upstream_key, config.salt_header, tenant_for(upstream, who))
            try:
                if body.get("stream"):
                    resp = await proxy.open_stream(client, upstream.rstrip("/") + path, body, headers)
                else:
                    resp = await proxy.race_disconnect(
                        request, client.post(upstream.rstrip("/") + path, json=body, headers=headers))
                    if resp is None:    # the client hung up: the upstream call was cancelled
                        return Response(status_code=499)
            except httpx.ConnectError as exc:
                upstream_errors.labels(upstream=str(slot), code="connect").inc()
                last = proxy.upstream_error(exc, upstream)
                continue
            except httpx.HTTPError as exc:
                upstream_errors.labels(upstream=str(slot), code=type(exc).__name__).inc()
                raise proxy.upstream_error(exc, upstream) from None
            if body.get("stream") and resp.status_code == 200:
                release = lease.hand_off()  # the stream outlives this handler

                async def cleanup(resp=resp):
                    await resp.aclose()
                    release()
                return GuardedStreamingResponse(
                    proxy.relay(resp, lambda u, slot=slot: finish(who, ids, slot, 200, u)), cleanup,
                    media_type=resp.headers.get("content-type", "text/event-stream"), headers=proxy.STREAM_HEADERS)
            if body.get("stream"):
                await resp.aread()
                await resp.aclose()
            try:
                payload = resp.json()
            except ValueError:
                payload = None
            finish(who, ids, slot, resp.status_code, payload.get("usage") if isinstance(payload, dict) else None)
            if payload is None:
                return Response(resp.content, status_code=resp.status_code,
                                media_type=resp.headers.get("content-type"))
            return JSONResponse(payload, status_code=resp.status_code, headers=proxy.passed_headers(resp))
        raise last or APIError(502, "no upstream available; the request was not served", "server_error",
                               code="upstream_unavailable")

    add_openai_routes(app, limiter, config.limits.max_body_bytes, identity_of, handle)

    @app.get("/v1/models")
    async def models(request: Request):
        who = identity_of(request)
        limiter.check_rate(who.tenant)   # every route counts against the tenant's rate
        for upstream in config.upstreams:
            headers = proxy.upstream_headers("-", config.upstream_key, False, tenant_for(upstream, who))
            try:
                r = await state["client"].get(upstream.rstrip("/") + "/models", headers=headers)
            except httpx.HTTPError:
                continue
            try:   # the upstream's own answer, a 429 of the tenant's included, passes through
                return JSONResponse(r.json(), status_code=r.status_code, headers=proxy.passed_headers(r))
            except ValueError:
                continue
        raise APIError(502, "no upstream answered GET /models", "server_error", code="upstream_unavailable")

    @app.get("/health")
    async def health():
        return {"status": "ok", "upstreams": len(config.upstreams)}

    @app.get("/metrics")
    async def prometheus(request: Request):
        operator(request)
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/admin/findings")
    async def findings(request: Request):
        operator(request)
        if trail is None:
            raise APIError(404, "no trail: start the gateway with a tokenizer", "not_found_error")
        found = await asyncio.to_thread(trail.findings)
        return {"findings": [{"kind": f.kind, "tenant": f.tenant, "detail": f.detail,
                              "requests": list(f.request_ids)} for f in found]}

    return app
