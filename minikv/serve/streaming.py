"""Delivering one request's outputs to its HTTP client: in one response, or as server-sent events.

Two things can go wrong between the engine and the client, and both are handled here:

* **The client goes away.**  A request whose client has disconnected must not keep decoding:
  it would hold KV-cache blocks (and batch slots) that other tenants need, for output nobody
  reads.  :func:`run_to_end` races the request against ``http.disconnect`` and, if the client
  wins, closes the stream -- which aborts the request in the engine
  (:class:`~minikv.serve.runner.RequestStream`).  Streaming responses get the same effect from
  Starlette cancelling the response task.
* **Text that is not final yet.**  Outputs are cumulative, and their tail can still change:
  :class:`_Delta` only ever sends the part that cannot (see its docstring), so a stream never
  shows a broken character or the beginning of a stop string that will be cut off.
"""
from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from .protocol import APIError
from .runner import EngineUnavailable

if TYPE_CHECKING:
    from starlette.requests import Request


class _ClientGone(Exception):
    """The client disconnected before a non-streaming request finished."""


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


def sse(obj: Any) -> str:
    """One server-sent event carrying ``obj`` as compact JSON."""
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def wait_disconnect(request: Request) -> None:
    """Return once the client has hung up (ASGI ``http.disconnect``)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


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
