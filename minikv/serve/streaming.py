"""Delivering one request's outputs to its HTTP client: in one response, or as server-sent events.

:class:`RequestStream` is one request's outputs as an async iterator (closing it aborts the
request); :class:`Reply` turns them into OpenAI response objects, whole or streamed.

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
import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from fastapi.responses import JSONResponse, Response

from .middleware import GuardedStreamingResponse, until_hangup
from .protocol import APIError, error_body
from .errors import EngineUnavailable, RequestFailed

log = logging.getLogger("minikv.serve")

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


async def run_to_end(stream, request: Request):
    """The final output of a non-streaming request; aborts it if the client goes away."""
    async def collect():
        last = None
        async for out in stream:
            last = out
        return last
    try:
        finished = await until_hangup(collect(), request.receive)
        if finished is None:
            raise _ClientGone()
        try:
            return finished.result()
        except EngineUnavailable as exc:
            raise APIError(503, str(exc), "server_error", code="engine_unavailable") from None
    finally:
        await stream.aclose()


class RequestStream:
    """Async iterator over one request's outputs (cumulative ``RequestOutput`` s; the last one
    has ``finished=True``).  ``aclose()`` -- also called when iteration is cancelled -- aborts
    the request unless it already finished."""

    def __init__(self, runner: EngineRunner, request_id: str, queue: asyncio.Queue):
        self.runner, self.request_id, self._queue = runner, request_id, queue
        self.done = False

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self):
        if self.done:
            raise StopAsyncIteration
        try:
            kind, item = await self._queue.get()
        except BaseException:
            await self.aclose()
            raise
        if kind == "output":
            if item.finished:
                self.done = True
            return item
        self.done = True
        if kind == "error":
            raise item
        raise EngineUnavailable("the request was aborted")

    async def aclose(self) -> None:
        if not self.done:
            self.done = True
            self.runner.abort(self.request_id)


class Reply:
    """The OpenAI response objects of one request: ``whole`` (one JSON body) or ``streaming``
    (server-sent events), for completions (``chat=False``) and chat completions."""

    def __init__(self, request_id: str, model: str, chat: bool, usage: Callable[[Any], dict]):
        self.rid, self.model, self.chat, self.usage = request_id, model, chat, usage
        self.created = int(time.time())

    async def whole(self, stream, request: Request) -> Response:
        try:
            out = await run_to_end(stream, request)
        except _ClientGone:
            log.info("request %s: client disconnected, aborted", self.rid)
            return Response(status_code=499)
        except RequestFailed as exc:
            raise APIError(500, str(exc), "server_error", code="request_failed") from None
        comp = out.outputs[0]
        if comp.finish_reason == "abort":
            raise APIError(503, "the request was aborted", "server_error", code="aborted")
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": comp.finish_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": comp.text}
        else:
            choice["text"] = comp.text
        return JSONResponse({"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                             "created": self.created, "model": self.model, "choices": [choice],
                             "usage": self.usage(out)})

    def _chunk(self, text: str | None, finish: str | None, first: bool = False) -> dict:
        if self.chat:
            d: dict[str, Any] = {}
            if first:
                d["role"] = "assistant"
            if text is not None:
                d["content"] = text
            c: dict[str, Any] = {"index": 0, "delta": d, "logprobs": None, "finish_reason": finish}
        else:
            c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        return {"id": self.rid, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": [c]}

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    def streaming(self, stream, stop_strings: tuple, include_usage: bool,
                  on_close: Callable[[], None]) -> GuardedStreamingResponse:
        """An SSE response; ``on_close()`` runs once the response is over, however it ends."""
        delta = _Delta(stop_strings)

        async def events():
            last = None
            try:
                if self.chat:
                    yield sse(self._chunk("", None, first=True))
                async for out in stream:
                    last = out
                    comp = out.outputs[0]
                    piece = delta(comp.text, out.finished)
                    if out.finished:
                        if piece:
                            yield sse(self._chunk(piece, None))
                        yield sse(self._chunk(None if self.chat else "", comp.finish_reason))
                    elif piece:
                        yield sse(self._chunk(piece, None))
                if include_usage and last is not None:
                    yield sse({"id": self.rid, "object": self._chunk_object, "created": self.created,
                               "model": self.model, "choices": [], "usage": self.usage(last)})
            except EngineUnavailable as exc:
                yield sse(error_body(str(exc), "server_error", code="engine_unavailable"))
            except RequestFailed as exc:
                yield sse(error_body(str(exc), "server_error", code="request_failed"))
            yield "data: [DONE]\n\n"

        async def cleanup():
            # However the response ends -- finished, client gone, cancelled before the first
            # byte -- an unfinished request is aborted (its blocks freed) and the slot returned.
            await stream.aclose()
            on_close()

        return GuardedStreamingResponse(events(), cleanup, media_type="text/event-stream",
                                        headers={"Cache-Control": "no-cache", "X-Request-Id": self.rid})
