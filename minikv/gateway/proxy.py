"""Forwarding one salted request to an upstream, and passing its answer back unchanged.

The proxy is deliberately dumb: the request it sends is built from scratch, never copied
from the client's.  Only three headers go out -- ``Content-Type``, the gateway's *own*
upstream key (the client's API key must never reach the engine operator's logs), and with
``--salt-header`` the salt as ``X-Cache-Salt`` (PR #57609's header, which wins over the body
where it is implemented; vLLM 0.32 ignores it, so the body field is always set too).  A
client's ``X-Cache-Salt`` is therefore dropped simply by not being copied.

**Fail closed.**  :func:`forward` refuses to send anything without a salt -- the one way a
bug upstream of it could turn into an unsalted request, i.e. into the shared cache.

**Cancellation.**  A request whose client has gone must stop decoding upstream, or it keeps
holding KV blocks and batch slots other tenants need.  Streaming: when the client disconnects,
Starlette cancels the response; closing the upstream response then closes that connection,
which vLLM (and ``minikv serve``) treat as an abort.  Non-streaming: :func:`race_disconnect`
races the upstream call against ``http.disconnect`` and cancels the call if the client wins.

Upstream failures are the gateway's to explain: a connection that cannot be made is a 502
naming the upstream (and nothing was processed); a timeout is a 504.  An upstream's own HTTP
errors (a 400 for a prompt over its context, say) pass through as they are.
"""
from __future__ import annotations

import asyncio
import json
from typing import Awaitable, Callable

import httpx

from ..serve.protocol import APIError

STREAM_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def upstream_headers(salt: str, upstream_key: str | None, salt_header: bool, tenant: str | None = None) -> dict:
    """The complete header set of an upstream request (nothing of the client's).  ``tenant``:
    the tenant the gateway calls for, sent as ``X-Minikv-Tenant`` to a ``minikv serve`` that
    knows the gateway's key as a gateway key (:mod:`minikv.serve.identity`), so that the
    upstream's per-tenant limits see tenants, not one gateway."""
    headers = {"Content-Type": "application/json"}
    if upstream_key:
        headers["Authorization"] = f"Bearer {upstream_key}"
    if salt_header:
        headers["X-Cache-Salt"] = salt
    if tenant is not None:
        headers["X-Minikv-Tenant"] = tenant
    return headers


def passed_headers(response: httpx.Response) -> dict:
    """The upstream headers a client needs from an answer: ``Retry-After`` of a 429 or 503."""
    value = response.headers.get("retry-after")
    return {"Retry-After": value} if value is not None else {}


def salted(body: dict, salt: str) -> dict:
    """``body`` with the client's ``cache_salt`` (whatever it was) replaced by ``salt``."""
    if not isinstance(salt, str) or not salt:
        raise APIError(500, "internal error: no salt for this request; refusing to forward it unsalted",
                       "server_error", code="unsalted_request_refused")
    out = {k: v for k, v in body.items() if k != "cache_salt"}
    out["cache_salt"] = salt
    return out


def upstream_error(exc: httpx.HTTPError, upstream: str) -> APIError:
    """A 502/504 that says which upstream failed and that the request was not served."""
    if isinstance(exc, httpx.TimeoutException):
        return APIError(504, f"upstream {upstream} timed out ({type(exc).__name__})", "server_error",
                        code="upstream_timeout")
    return APIError(502, f"upstream {upstream} is unavailable ({type(exc).__name__}); the request "
                         "was not served", "server_error", code="upstream_unavailable")


async def race_disconnect(request, work: Awaitable):
    """Await ``work`` unless the client disconnects first; then cancel it and return None."""
    task = asyncio.ensure_future(work)

    async def hung_up():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return
    watcher = asyncio.ensure_future(hung_up())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    return None


def cached_tokens_of(payload) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` of a response object, if it has one."""
    if not isinstance(payload, dict):
        return None
    details = (payload.get("usage") or {}).get("prompt_tokens_details") or {}
    value = details.get("cached_tokens")
    return value if isinstance(value, int) else None


def usage_from_sse(chunk: bytes, seen: dict) -> None:
    """Pick ``usage`` out of server-sent events as they pass (the last chunk carries it when
    the client asked for ``stream_options.include_usage``); ``seen`` keeps the partial line."""
    buf = seen.get("buf", b"") + chunk
    *lines, seen["buf"] = buf.split(b"\n")
    for line in lines:
        if line.startswith(b"data: {") and b'"usage"' in line:
            try:
                payload = json.loads(line[6:])
            except ValueError:
                continue
            if payload.get("usage"):
                seen["usage"] = payload["usage"]


async def open_stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> httpx.Response:
    """Send a streaming request and return the response with its body still unread."""
    req = client.build_request("POST", url, json=body, headers=headers)
    return await client.send(req, stream=True)


def relay(response: httpx.Response, on_usage: Callable[[dict | None], None]):
    """The upstream's raw bytes, as they come; ``on_usage`` gets the final usage (or None)."""
    async def body():
        seen: dict = {}
        try:
            async for chunk in response.aiter_raw():
                usage_from_sse(chunk, seen)
                yield chunk
        finally:
            on_usage(seen.get("usage"))
    return body()
