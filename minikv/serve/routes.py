"""``POST /v1/completions`` and ``POST /v1/chat/completions``, and the admission in front of them:
one definition for ``minikv serve`` (:mod:`minikv.serve.app`) and ``minikv gateway``
(:mod:`minikv.gateway.app`).

Both servers admit a generation request the same way, cheapest check first, before a byte of
its body is read: a tenant must not be able to slow the others down with requests that are
refused anyway (:mod:`minikv.serve.limits`)::

    API key -> who (401)  ->  tenant's request rate (429)  ->  Content-Length (413)
            ->  one of the tenant's concurrency slots (429 when too many already wait)

What happens next -- parse the body, run the engine or forward upstream -- is each server's own
``handle``.  The slot is a :class:`~minikv.serve.limits.Lease`, released when ``handle`` returns
or raises, however it ends; a streaming response outlives its handler, so ``handle`` then takes
the release with it (``lease.hand_off()`` as the stream's ``on_close``).  Forgetting a release
here would leak a slot per failed request until the tenant is locked out.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

from fastapi import FastAPI, Request

from .limits import Lease, TenantLimiter
from .protocol import check_content_length

#: ``handle(request, chat, who, lease)``: the server's work once the request is admitted
Handler = Callable[[Request, bool, Any, Lease], Awaitable[Any]]


def add_openai_routes(app: FastAPI, limiter: TenantLimiter, max_body_bytes: int,
                      identify: Callable[[Request], Any], handle: Handler) -> None:
    """Add the two generation routes to ``app``.

    ``identify(request)`` resolves the API key (raising a 401 ``APIError`` when it cannot) and
    returns who sent the request (``minikv serve``: the tenant name; the gateway: an
    ``Identity``); it sets ``request.state.tenant``, which the limits count against and the
    error handlers label their metrics with.  ``handle(request, chat, who, lease)`` serves the
    admitted request; ``chat`` tells the two routes apart.
    """

    async def admitted(request: Request, chat: bool):
        who = identify(request)
        tenant = request.state.tenant
        limiter.check_rate(tenant)
        check_content_length(request, max_body_bytes)
        lease = await limiter.acquire(tenant)
        try:
            return await handle(request, chat, who, lease)
        finally:
            lease.close()

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await admitted(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await admitted(request, chat=True)
