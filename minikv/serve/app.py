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
it.  Keys are compared in constant time (HMAC-style digest comparison over every configured key),
so response timing does not reveal how much of a guessed key was right.

Concurrency
-----------
Handlers never touch the engine: they hand requests to :class:`~minikv.serve.runner.EngineRunner`,
whose single thread steps the engine, so concurrent requests share one continuous batch.  A
client that disconnects has its request aborted (``engine.abort_request``), streaming or not.

Errors
------
Every error is OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``: 401 for a
missing/unknown key, 413 for a body over ``max_body_bytes``, 400 for malformed JSON or bad
parameters (including what the engine's own validation rejects), 404 for an unknown model or
path.  A bad request never disturbs the others: validation happens before anything is allocated.

Logs carry request ids, tenants and token counts -- never prompt or completion text.
"""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, Mapping

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .metrics import ServerMetrics
from .runner import ChatPrompt, EngineRunner, EngineUnavailable, RequestRejected

log = logging.getLogger("minikv.serve")

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB
DEFAULT_CHAT_MAX_TOKENS = 256
CHAT_ROLES = ("system", "user", "assistant", "developer")


# ---------------------------------------------------------------------------------------- keys
class ApiKeys:
    """API key -> tenant, resolved in constant time.

    Every configured key is compared (no early exit), and what is compared are SHA-256 digests
    of equal length, so neither the position of the first wrong character nor the key's length
    shows in the response time.
    """

    def __init__(self, mapping: Mapping[str, str]):
        if not isinstance(mapping, Mapping) or not mapping:
            raise ValueError("api keys must be a non-empty mapping of key -> tenant")
        entries = []
        for key, tenant in mapping.items():
            if not isinstance(key, str) or not key.strip() or key != key.strip():
                raise ValueError("every API key must be a non-empty string without surrounding spaces")
            if not isinstance(tenant, str) or not tenant:
                raise ValueError("every tenant name must be a non-empty string")
            entries.append((hashlib.sha256(key.encode()).digest(), tenant))
        self._entries = tuple(entries)
        self.tenants = tuple(sorted(set(mapping.values())))

    def __repr__(self) -> str:  # never print keys
        return f"ApiKeys({len(self._entries)} keys, tenants={list(self.tenants)})"

    def resolve(self, authorization: str | None) -> str | None:
        """The tenant of a ``Bearer`` header, or None (missing, malformed or unknown key)."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found = None
        for key_digest, tenant in self._entries:
            if hmac.compare_digest(key_digest, digest):
                found = tenant
        return found


def load_api_keys(path: str | os.PathLike) -> ApiKeys:
    """Read a JSON object ``{"<api key>": "<tenant>", ...}``."""
    with open(path, encoding="utf-8") as fh:
        try:
            data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object mapping API key -> tenant name")
    return ApiKeys(data)


# ---------------------------------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def _error_response(exc: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=headers)


class _ClientGone(Exception):
    pass


# ---------------------------------------------------------------------------------------- parsing
_MISSING = object()


def _field(body: dict, name: str, kinds: tuple, default: Any = None, what: str = "") -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        raise APIError(400, f"'{name}' must be {what or ' or '.join(k.__name__ for k in kinds)}, "
                            f"got {type(value).__name__}", param=name, code="invalid_type")
    return value


def _sampling_params(body: dict, default_max_tokens: int, max_model_len: int, chat: bool):
    from ..engine.sampling import SamplingParams

    n = _field(body, "n", (int,), 1, "an integer")
    if n != 1:
        raise APIError(400, f"n={n} is not supported; minikv returns one choice per request", param="n")
    best_of = _field(body, "best_of", (int,), 1, "an integer")
    if best_of != 1:
        raise APIError(400, "best_of is not supported", param="best_of")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise APIError(400, "logprobs are not supported", param="logprobs")
    if not chat and _field(body, "echo", (bool,), False):
        raise APIError(400, "echo is not supported", param="echo")
    if not chat and body.get("suffix") not in (None, ""):
        raise APIError(400, "suffix is not supported", param="suffix")
    max_tokens = _field(body, "max_tokens", (int,), None, "an integer")
    if chat and max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", (int,), None, "an integer")
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif max_tokens <= 0:
        raise APIError(400, f"max_tokens must be > 0, got {max_tokens}", param="max_tokens")
    elif max_tokens >= max_model_len:
        raise APIError(400, f"max_tokens={max_tokens} exceeds the model's context ({max_model_len} tokens)",
                       param="max_tokens")
    temperature = _field(body, "temperature", (int, float), 1.0, "a number")
    if temperature < 0:
        raise APIError(400, f"temperature must be >= 0, got {temperature}", param="temperature")
    top_p = _field(body, "top_p", (int, float), 1.0, "a number")
    top_k = _field(body, "top_k", (int,), 0, "an integer")
    seed = _field(body, "seed", (int,), None, "an integer")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                          and all(isinstance(s, str) for s in stop))):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if isinstance(stop, list) and len(stop) > 16:
        raise APIError(400, "at most 16 stop strings are supported", param="stop")
    ignore_eos = _field(body, "ignore_eos", (bool,), False, "a boolean")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                              top_k=top_k, seed=seed, stop=stop or None, ignore_eos=ignore_eos)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from None


def _completion_prompt(body: dict):
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], str):
            return _completion_prompt({"prompt": prompt[0]})
        if len(prompt) == 1 and isinstance(prompt[0], list):
            return _completion_prompt({"prompt": prompt[0]})
        if all(isinstance(p, (str, list)) for p in prompt):
            raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    raise APIError(400, "'prompt' must be a string, a list of token ids, or a list with one string",
                   param="prompt", code="invalid_type")


def _chat_messages(body: dict) -> tuple:
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise APIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]", code="invalid_type")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}",
                           param=f"messages[{i}].role")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content",
                           code="invalid_type")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"] for m in out):
        raise APIError(400, "'messages' contain no text", param="messages")
    return tuple(out)


class _Delta:
    """Turns cumulative output text into safe-to-send increments.

    Text that might still change is held back: an incomplete UTF-8 character at the end (decoded
    as U+FFFD until its last byte arrives) and, with ``stop`` strings, the last ``len(stop) - 1``
    characters, which could be the start of a stop string that will be cut off.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.sent = ""
        self.hold = max((len(s) for s in stops), default=1) - 1

    def __call__(self, text: str, finished: bool) -> str:
        if finished:
            safe = text
        else:
            safe = text[:len(text) - self.hold] if self.hold else text
            safe = safe.rstrip("\ufffd")
        if not safe.startswith(self.sent):
            return ""  # the decoded prefix changed (rare); never resend what was sent
        piece, self.sent = safe[len(self.sent):], safe
        return piece


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

    async def read_json(request: Request) -> dict:
        length = request.headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > max_body_bytes
            except ValueError:
                raise APIError(400, "invalid Content-Length header") from None
            if too_big:
                raise APIError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large")
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise APIError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
        try:
            body = json.loads(b"".join(chunks))
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

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

    async def wait_disconnect(request: Request) -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    async def start(request_id: str, prompt, params, tenant: str, request: Request):
        """Submit and wait until the engine accepted (or rejected) the request."""
        try:
            return await runner.open(request_id, prompt, params, tenant)
        except RequestRejected as exc:
            raise APIError(400, str(exc)) from None
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None

    async def run_to_end(stream, request: Request):
        """The final output of a non-streaming request; aborts it if the client goes away."""
        async def collect():
            last = None
            async for out in stream:
                last = out
            return last
        task = asyncio.ensure_future(collect())
        watcher = asyncio.ensure_future(wait_disconnect(request))
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                raise _ClientGone()
            try:
                return task.result()
            except EngineUnavailable as exc:
                raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None
        finally:
            for t in (task, watcher):
                if not t.done():
                    t.cancel()
            await asyncio.gather(task, watcher, return_exceptions=True)
            await stream.aclose()

    def sse(obj: Any) -> str:
        return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"

    async def handle(request: Request, chat: bool):
        tenant = tenant_of(request)
        body = await read_json(request)
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


# ---------------------------------------------------------------------------------------- in-process server
class BackgroundServer:
    """uvicorn serving ``app`` from a thread of this process, on loopback and a free port.

    The listening socket is bound before the thread starts (no port race), uvicorn's logging
    config is left alone (no handlers added: nothing reaches a notebook's stderr) and ``stop()``
    shuts down gracefully (the app's lifespan stops the engine thread)::

        with BackgroundServer(app) as srv:
            httpx.get(srv.base_url + "/models", headers=...)
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 access_log: bool = False):
        self.app, self.host, self.port = app, host, port
        self.log_level, self.access_log = log_level, access_log
        self._server = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        import uvicorn

        if self._thread is not None:
            return self
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._sock = sock
        config = uvicorn.Config(self.app, log_config=None, log_level=self.log_level,
                                access_log=self.access_log, lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="minikv-uvicorn", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        self._thread = self._server = self._sock = None

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
