"""The OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health`` and (for operators only) ``/metrics``.

    app = create_app(LLM("tiny-random", enable_prefix_caching=True), {"sk-alice": "alice"})
    with BackgroundServer(app) as srv:          # uvicorn on 127.0.0.1, a free port, own thread
        openai.OpenAI(base_url=srv.base_url, api_key="sk-alice").completions.create(...)

Who is the tenant?
------------------
The tenant -- the isolation domain whose prefix cache a request may hit -- is resolved **on the
server** from the API key in ``Authorization: Bearer <key>`` (a JSON file maps key -> tenant).
No field of the request body can choose or change it: ``cache_salt``, ``tenant``, ``user`` and
the like are ignored.  vLLM's answer to cross-tenant cache probing is a client-supplied
``cache_salt``; a salt travels in request bodies, SDK configs and logs, and whoever copies it
shares the victim's cache again (vLLM docs PR #53347).  A key that only the server derives from
(engine secret, authenticated tenant) cannot be copied by a client, because no client ever sees
it.  Keys are compared in constant time (:mod:`minikv.serve.auth`), so response timing does not
reveal how much of a guessed key was right.  (``--trust-client-salt`` lets ``cache_salt`` *narrow*
the key's tenant domain, vLLM-style, never widen it: :mod:`minikv.serve.client_salt`.)

Concurrency
-----------
Handlers never touch the engine: they hand requests to :class:`~minikv.serve.runner.EngineRunner`,
whose single thread steps the engine, so concurrent requests share one continuous batch.  A
client that disconnects has its request aborted (``engine.abort_request``), streaming or not
(:mod:`minikv.serve.streaming`).

One request's path, cheapest check first
-----------------------------------------
A tenant must not be able to slow the others down, not even with requests that are refused
anyway, so every check runs before the next, more expensive step (:mod:`minikv.serve.limits`;
steps 1 and 2 are :mod:`minikv.serve.routes`, which the gateway shares):

1. API key -> tenant (401), then the tenant's request rate (429; ``/v1/models`` counts too),
   then ``Content-Length`` (413): nothing of the body has been read yet.  Behind ``minikv
   gateway``, a gateway key names the tenant it calls for (:mod:`minikv.serve.identity`);
2. a concurrency slot of the tenant's (429 when too many already wait);
3. the body: strict JSON, field validation, prompt size caps (400), the tenant's decode budget;
4. tokenization, on a worker thread of its own (:mod:`minikv.serve.tokenize`), which also
   refuses prompts longer than the context;
5. only then the engine thread, which admits requests fair-share across tenants.

Errors
------
Every error is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``
(:mod:`minikv.serve.middleware`): 400 for malformed input, 401 for a missing/unknown key, 404
for an unknown model or path, 413 for a body over the limit, 429 with ``Retry-After`` over a
tenant limit, 500 when the engine failed this one request (the others go on), 503 when the
engine is down.  No malformed input ever produces a 500.

Metrics
-------
``/metrics`` is a side channel (:mod:`minikv.serve.metrics`), so it answers only to operator
keys (``operator_keys``, a second keys file); without them it is 404 here, and ``minikv serve
--metrics-port`` serves it on a separate, operator-only address instead (:func:`create_metrics_app`).

Logs carry request ids, tenants and token counts -- never prompt or completion text.
"""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from .auth import ApiKeys, check_disjoint
from .identity import TenantResolver
from .limits import Lease, ServeLimits, TenantLimiter
from .metrics import ServerMetrics
from .middleware import MetricsMiddleware, QueryStringGuard, install_error_handlers
from .protocol import APIError, _chat_messages, check_known_fields, _completion_prompt, _field, _sampling_params, read_json
from .client_salt import check_tenant_names, client_salt, salted_domain
from .errors import EngineUnavailable, RequestRejected
from .routes import add_openai_routes
from .runner import EngineRunner
from .streaming import Reply
from .tokenize import ChatPrompt, PromptEncoder

log = logging.getLogger("minikv.serve")

DEFAULT_CHAT_MAX_TOKENS = 256


def _keys(keys: ApiKeys | Mapping[str, str] | None) -> ApiKeys | None:
    return keys if keys is None or isinstance(keys, ApiKeys) else ApiKeys(keys)


def _require(keys: ApiKeys, request: Request, who: str) -> str:
    # The raw header bytes, compared as UTF-8 (Starlette would decode them as latin-1).
    raw = next((v for k, v in request.scope["headers"] if k == b"authorization"), None)
    name = keys.resolve(raw)
    if name is None:
        raise APIError(401, f"invalid or missing {who} key (send 'Authorization: Bearer <key>')",
                       code="invalid_api_key")
    return name


def _metrics_response(metrics: ServerMetrics) -> Response:
    data, content_type = metrics.render()
    return Response(data, media_type=content_type)


def create_metrics_app(metrics: ServerMetrics, operator_keys: ApiKeys | Mapping[str, str] | None = None) -> FastAPI:
    """``/metrics`` alone, for an operator-only address (``minikv serve --metrics-port``).
    With ``operator_keys`` it also demands an operator key; without, the address itself is
    the protection -- keep it on loopback or behind a firewall."""
    keys = _keys(operator_keys)
    app = FastAPI(title="minikv-metrics", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    @app.get("/metrics")
    async def metrics_route(request: Request):
        if keys is not None:
            _require(keys, request, "operator")
        return _metrics_response(metrics)

    return app


def create_app(llm_or_engine, api_keys: ApiKeys | Mapping[str, str], *, model_name: str | None = None,
               report_cached_tokens: bool = False, limits: ServeLimits | None = None,
               operator_keys: ApiKeys | Mapping[str, str] | None = None,
               metrics: ServerMetrics | None = None, runner: EngineRunner | None = None,
               trust_client_salt: bool = False,
               gateway_keys: ApiKeys | Mapping[str, str] | None = None) -> FastAPI:
    """Build the FastAPI app around an ``LLM`` or ``LLMEngine``.

    ``report_cached_tokens`` adds ``usage.prompt_tokens_details.cached_tokens``: useful to
    operators and auditors, and an explicit cache-hit oracle for clients -- under tenant
    isolation it only ever reveals a tenant's own hits.  ``limits`` are the per-tenant and
    per-request limits (:class:`ServeLimits`; its defaults when None).  ``operator_keys``
    unlock ``/metrics``.  The engine runner starts with the app (lifespan) and stops with it.
    ``trust_client_salt``: honour ``cache_salt`` like vLLM (:mod:`minikv.serve.client_salt`).
    ``gateway_keys``: keys that may name the tenant they call for (:mod:`minikv.serve.identity`).
    """
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    keys, ops, gateways = _keys(api_keys), _keys(operator_keys), _keys(gateway_keys)
    check_disjoint(api_keys=keys, operator_keys=ops, gateway_keys=gateways)
    resolve_tenant = TenantResolver(keys, gateways)
    check_tenant_names(**{flag: k.tenants for flag, k in (("api_keys", keys), ("gateway_keys", gateways))
                          if k is not None})  # whether or not salts are trusted
    limits = limits if limits is not None else ServeLimits()
    limiter = TenantLimiter(limits)
    metrics = metrics if metrics is not None else ServerMetrics()
    runner = runner if runner is not None else EngineRunner(engine, metrics)
    encoder = PromptEncoder(engine.tokenizer, engine.max_model_len)
    name = model_name or str(engine.config.model)
    names = {name, str(engine.config.model)}
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        runner.start()
        try:
            yield
        finally:
            runner.stop()
            encoder.close()

    app = FastAPI(title="minikv", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.runner, app.state.metrics, app.state.api_keys = engine, runner, metrics, keys
    app.state.model_name, app.state.limiter = name, limiter
    app.add_middleware(MetricsMiddleware, metrics=metrics)
    app.add_middleware(QueryStringGuard)
    install_error_handlers(app, metrics)

    # ------------------------------------------------------------------ helpers
    def tenant_of(request: Request) -> str:
        tenant = resolve_tenant(request.scope["headers"])
        if tenant is None:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        request.state.tenant = tenant
        return tenant

    def counted(request: Request) -> str:
        """The tenant of a request to any other route, charged to its request rate."""
        tenant = tenant_of(request)
        limiter.check_rate(tenant)
        return tenant

    def check_model(body: dict) -> str:
        model = body.get("model")
        if model is None:
            return name
        if not isinstance(model, str):
            raise APIError(400, "'model' must be a string", param="model", code="invalid_type")
        if model not in names:
            raise APIError(404, f"the model '{model[:200]}' does not exist; this server serves '{name}'",
                           param="model", code="model_not_found")
        return model

    def usage(out) -> dict:
        n_prompt, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        u: dict[str, Any] = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                             "total_tokens": n_prompt + n_out}
        if report_cached_tokens:
            u["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
        return u

    async def start(request_id: str, prompt, params, tenant: str):
        """Tokenize (off the engine thread), submit, and wait until the engine accepted it."""
        try:
            ids = await encoder.encode(prompt, tenant)
            return await runner.open(request_id, ids, params, tenant)
        except (ValueError, TypeError, RequestRejected) as exc:
            raise APIError(400, str(exc)) from None
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None

    async def handle(request: Request, chat: bool, tenant: str, lease: Lease):
        """An admitted request (:mod:`minikv.serve.routes`): body, prompt, engine, reply."""
        body = await read_json(request, limits.max_body_bytes)
        check_known_fields(body, chat)
        model = check_model(body)
        max_chars = limits.prompt_chars(engine.max_model_len)
        if chat:
            prompt: Any = ChatPrompt(_chat_messages(body, max_chars, limits.max_messages))
        else:
            prompt = _completion_prompt(body, max_chars)
        params = _sampling_params(body, DEFAULT_CHAT_MAX_TOKENS if chat else 16, engine.max_model_len, chat)
        try:
            lease.reserve(params.max_tokens)
        except ValueError as exc:
            raise APIError(400, str(exc), param="max_tokens") from None
        stream_flag = _field(body, "stream", (bool,), False, "a boolean")
        opts = _field(body, "stream_options", (dict,), {}, "an object")
        include_usage = bool(opts.get("include_usage", False))
        # Ignored: body["user"], any "tenant" field; body["cache_salt"] unless trusted (module doc).
        domain = salted_domain(tenant, client_salt(body)) if trust_client_salt else tenant
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        stream = await start(rid, prompt, params, domain)
        reply = Reply(rid, model, chat, usage)
        if stream_flag:  # the stream outlives this handler: it releases the lease when it ends
            return reply.streaming(stream, params.stop_strings, include_usage, on_close=lease.hand_off())
        return await reply.whole(stream, request)

    # ------------------------------------------------------------------ routes
    add_openai_routes(app, limiter, limits.max_body_bytes, tenant_of, handle)

    def model_card(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "minikv",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request):
        counted(request)
        return {"object": "list", "data": [model_card(name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        counted(request)
        if model_id not in names:
            raise APIError(404, f"the model '{model_id[:200]}' does not exist", param="model",
                           code="model_not_found")
        return model_card(model_id)

    @app.get("/health")
    async def health():
        ok = runner.alive and runner.healthy
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        if ops is None:
            raise APIError(404, "metrics are served to operators only: start the server with "
                                "--operator-keys, or --metrics-port for a separate address",
                           "not_found_error", code="metrics_disabled")
        _require(ops, request, "operator")
        return _metrics_response(metrics)

    return app
