"""The OpenAI-compatible HTTP server: ``/v1/completions``, ``/v1/chat/completions``,
``/v1/models``, ``/health`` and ``/metrics``.

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
shares the victim's cache again (vLLM issue #53347).  A key that only the server derives from
(engine secret, authenticated tenant) cannot be copied by a client, because no client ever sees
it.  Keys are compared in constant time (:mod:`minikv.serve.auth`), so response timing does not
reveal how much of a guessed key was right.

Concurrency
-----------
Handlers never touch the engine: they hand requests to :class:`~minikv.serve.runner.EngineRunner`,
whose single thread steps the engine, so concurrent requests share one continuous batch.  A
client that disconnects has its request aborted (``engine.abort_request``), streaming or not
(:mod:`minikv.serve.streaming`).

Errors
------
Every error is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 401 for a
missing/unknown key, 413 for a body over ``max_body_bytes``, 400 for malformed JSON or bad
parameters (including what the engine's own validation rejects), 404 for an unknown model or
path.  A bad request never disturbs the others: validation (:mod:`minikv.serve.protocol`) happens
before anything is allocated.

Logs carry request ids, tenants and token counts -- never prompt or completion text.
"""
from __future__ import annotations

import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

# load_api_keys, BackgroundServer and CHAT_ROLES are re-exported: they used to live here.
from .auth import ApiKeys, load_api_keys  # noqa: F401
from .background import BackgroundServer  # noqa: F401
from .metrics import ServerMetrics
from .protocol import (CHAT_ROLES, APIError, _chat_messages, _completion_prompt, _field,  # noqa: F401
                       _sampling_params, error_body, read_json)
from .runner import ChatPrompt, EngineRunner, EngineUnavailable, RequestRejected
from .streaming import _ClientGone, _Delta, run_to_end, sse

log = logging.getLogger("minikv.serve")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
DEFAULT_CHAT_MAX_TOKENS = 256


# ---------------------------------------------------------------------------------------- app
class _MetricsMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware, which breaks streaming disconnect detection): counts
    requests per endpoint and status code."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in self.ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/")
                                                        else "other")
        status = {"code": 500}

        async def _send(message):
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            self.metrics.requests.labels(endpoint=endpoint, status=str(status["code"])).inc()


def _error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=headers)


def create_app(llm_or_engine, api_keys: ApiKeys | Mapping[str, str], *, model_name: str | None = None,
               report_cached_tokens: bool = False, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               metrics: ServerMetrics | None = None, runner: EngineRunner | None = None) -> FastAPI:
    """Build the FastAPI app around an ``LLM`` or ``LLMEngine``.

    ``report_cached_tokens`` adds ``usage.prompt_tokens_details.cached_tokens``: useful to
    operators and auditors, and an explicit cache-hit oracle for clients -- under tenant
    isolation it only ever reveals a tenant's own hits.
    The engine runner starts with the app (lifespan) and stops with it.
    """
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    keys = api_keys if isinstance(api_keys, ApiKeys) else ApiKeys(api_keys)
    metrics = metrics if metrics is not None else ServerMetrics()
    runner = runner if runner is not None else EngineRunner(engine, metrics)
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

    app = FastAPI(title="minikv", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.engine, app.state.runner, app.state.metrics, app.state.api_keys = engine, runner, metrics, keys
    app.state.model_name = name
    app.add_middleware(_MetricsMiddleware, metrics=metrics)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception):
        log.error("internal error on %s: %s", request.url.path, type(exc).__name__)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)

    # ------------------------------------------------------------------ helpers
    def tenant_of(request: Request) -> str:
        tenant = keys.resolve(request.headers.get("authorization"))
        if tenant is None:
            raise APIError(401, "invalid or missing API key (send 'Authorization: Bearer <key>')",
                           code="invalid_api_key")
        return tenant

    def check_model(body: dict) -> str:
        model = body.get("model")
        if model is None:
            return name
        if not isinstance(model, str):
            raise APIError(400, "'model' must be a string", param="model", code="invalid_type")
        if model not in names:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{name}'",
                           param="model", code="model_not_found")
        return model

    def usage(out) -> dict:
        n_prompt, n_out = len(out.prompt_token_ids), len(out.outputs[0].token_ids)
        u: dict[str, Any] = {"prompt_tokens": n_prompt, "completion_tokens": n_out,
                             "total_tokens": n_prompt + n_out}
        if report_cached_tokens:
            u["prompt_tokens_details"] = {"cached_tokens": out.num_cached_tokens}
        return u

    async def start(request_id: str, prompt, params, tenant: str, request: Request):
        """Submit and wait until the engine accepted (or rejected) the request."""
        try:
            return await runner.open(request_id, prompt, params, tenant)
        except RequestRejected as exc:
            raise APIError(400, str(exc)) from None
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None

    async def handle(request: Request, chat: bool):
        tenant = tenant_of(request)
        body = await read_json(request, max_body_bytes)
        model = check_model(body)
        if chat:
            prompt: Any = ChatPrompt(_chat_messages(body))
        else:
            prompt = _completion_prompt(body)
        params = _sampling_params(body, DEFAULT_CHAT_MAX_TOKENS if chat else 16, engine.max_model_len, chat)
        stream_flag = _field(body, "stream", (bool,), False, "a boolean")
        opts = _field(body, "stream_options", (dict,), {}, "an object")
        include_usage = bool(opts.get("include_usage", False))
        # Deliberately ignored: body["cache_salt"], body["user"], any "tenant" field (see module doc).
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        created_at = int(time.time())
        stream = await start(rid, prompt, params, tenant, request)
        obj = "chat.completion" if chat else "text_completion"

        if not stream_flag:
            try:
                out = await run_to_end(stream, request)
            except _ClientGone:
                log.info("request %s: client disconnected, aborted", rid)
                return Response(status_code=499)
            comp = out.outputs[0]
            if comp.finish_reason == "abort":
                raise APIError(503, "the request was aborted", "server_error", code="aborted")
            choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": comp.finish_reason}
            if chat:
                choice["message"] = {"role": "assistant", "content": comp.text}
            else:
                choice["text"] = comp.text
            return JSONResponse({"id": rid, "object": obj, "created": created_at, "model": model,
                                 "choices": [choice], "usage": usage(out)})

        chunk_obj = "chat.completion.chunk" if chat else "text_completion"
        delta = _Delta(params.stop_strings)

        def chunk(text: str | None, finish: str | None, first: bool = False) -> dict:
            if chat:
                d: dict[str, Any] = {}
                if first:
                    d["role"] = "assistant"
                if text is not None:
                    d["content"] = text
                c: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
            else:
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
            return {"id": rid, "object": chunk_obj, "created": created_at, "model": model, "choices": [c]}

        async def events():
            last = None
            try:
                if chat:
                    yield sse(chunk("", None, first=True))
                async for out in stream:
                    last = out
                    comp = out.outputs[0]
                    piece = delta(comp.text, out.finished)
                    if out.finished:
                        if piece:
                            yield sse(chunk(piece, None))
                        yield sse(chunk(None if chat else "", comp.finish_reason))
                    elif piece:
                        yield sse(chunk(piece, None))
                if include_usage and last is not None:
                    yield sse({"id": rid, "object": chunk_obj, "created": created_at, "model": model,
                               "choices": [], "usage": usage(last)})
            except EngineUnavailable as exc:
                yield sse(error_body(str(exc), "server_error", code="engine_unavailable"))
            finally:
                # Runs on normal end and when the client disconnects (Starlette cancels the
                # response task): an unfinished request is aborted, its blocks freed.
                await stream.aclose()
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": rid})

    # ------------------------------------------------------------------ routes
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    def model_card(model_id: str) -> dict:
        return {"id": model_id, "object": "model", "created": created, "owned_by": "minikv",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request):
        tenant_of(request)
        return {"object": "list", "data": [model_card(name)]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request):
        tenant_of(request)
        if model_id not in names:
            raise APIError(404, f"the model '{model_id}' does not exist", param="model", code="model_not_found")
        return model_card(model_id)

    @app.get("/health")
    async def health():
        ok = runner.alive and runner.healthy
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    return app
