"""What wraps every request of the server: counting, query-string hygiene, error shapes.

Kept apart from the routes (:mod:`minikv.serve.app`) because none of it depends on what an
endpoint does:

* :class:`MetricsMiddleware` counts requests per endpoint and status.
* :class:`QueryStringGuard` refuses any query string and blanks it before it can be logged.
  No endpoint here takes query parameters, but clients do put API keys in URLs
  (``?api_key=sk-...``) -- and access logs write URLs in full, so the key of whoever made that
  mistake would sit in every log archive and log shipper.  The guard answers 400 and replaces
  the query string with ``redacted`` in the ASGI scope, which is what uvicorn's access log reads.
* :func:`install_error_handlers` gives every error the OpenAI shape
  ``{"error": {"message", "type", "param", "code"}}``: an :class:`APIError` with its status,
  429 with ``Retry-After``, 499 (no body, one info line) when the client hung up mid-upload, and
  a bare 500 -- without details for the client -- for real server bugs.
* :class:`GuardedStreamingResponse` runs a cleanup however a streaming response ends (a
  generator that never started, client gone before the first byte, never runs its ``finally``),
  and ends the moment its client hangs up, not at its next event.

All are pure ASGI (not ``BaseHTTPMiddleware``, which breaks streaming disconnect detection).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .limits import TooManyRequests
from .protocol import APIError, ClientGone, error_body

log = logging.getLogger("minikv.serve")

ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class MetricsMiddleware:
    """Counts requests per endpoint and status code."""

    def __init__(self, app, metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/")
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


class QueryStringGuard:
    """Refuse (400) and redact any query string; see the module docstring."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope.get("query_string"):
            return await self.app(scope, receive, send)
        scope["query_string"] = b"redacted"  # the access log reads the scope: never the key
        body = json.dumps(error_body("query parameters are not accepted; send the API key as "
                                     "'Authorization: Bearer <key>', never in a URL",
                                     code="query_string_refused")).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


def error_response(exc: APIError) -> JSONResponse:
    # No "Connection: close" on refusals, measured: with it, a flooder that ignores Retry-After
    # reconnects at ~700 requests/s and the victim's token gaps rose to 3.4x (1.4x keeping the
    # connection, where each refused body at least costs the flooder its upload).
    headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else None
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=headers)


def install_error_handlers(app, metrics=None) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(TooManyRequests)
    async def _too_many(request, exc: TooManyRequests):
        tenant = getattr(request.state, "tenant", None)
        if metrics is not None and tenant is not None:
            metrics.rejected.labels(tenant=tenant, limit=exc.limit).inc()
        return JSONResponse(error_body(str(exc), "rate_limit_error", code=f"{exc.limit}_limit_exceeded"),
                            status_code=429, headers={"Retry-After": str(exc.retry_after)})

    @app.exception_handler(ClientGone)
    async def _client_gone(request, exc: ClientGone):
        log.info("client disconnected while sending %s", request.url.path)
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.error("internal error on %s: %s", request.url.path, type(exc).__name__)
        return JSONResponse(error_body("internal server error", "server_error"), status_code=500)


class GuardedStreamingResponse(StreamingResponse):
    """A ``StreamingResponse`` that always awaits ``cleanup()`` once it is done or cancelled, and
    that ends as soon as its client hangs up, even while no event is due.

    Why not Starlette's own: under ASGI 2.4 (what uvicorn speaks) it learns of a hang-up only when
    a send fails, that is at the next event.  A stream whose next event is far away -- a long
    prompt prefilled in many small chunks before its first token -- would keep its blocks and
    its share of every step for a client that is gone.  So the response always races the body
    against ``http.disconnect``, the way Starlette does for older ASGI servers.
    """

    def __init__(self, content, cleanup, **kwargs):
        super().__init__(content, **kwargs)
        self._cleanup = cleanup

    async def __call__(self, scope, receive, send):
        try:
            if scope["type"] != "http":
                return await super().__call__(scope, receive, send)
            finished = await until_hangup(self._stream(send), receive)
            if finished is not None:
                finished.result()  # a real error while streaming still surfaces
        finally:
            await self._cleanup()

    async def _stream(self, send) -> None:
        with contextlib.suppress(OSError):  # the client left between two events
            await self.stream_response(send)


async def until_hangup(work, receive) -> asyncio.Future | None:
    """Run the awaitable ``work`` until it ends or the client hangs up (ASGI ``http.disconnect``
    on ``receive``), whichever comes first, and cancel the other.  Returns ``work``'s finished task
    (call ``.result()``), or None if the client left first."""
    async def hangup():
        while (await receive())["type"] != "http.disconnect":
            pass

    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(hangup())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        return task if task.done() else None
    finally:
        for t in (task, watcher):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
