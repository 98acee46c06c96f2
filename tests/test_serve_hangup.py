"""A streaming response ends when its client hangs up, even while it has nothing to send.

Starlette's ``StreamingResponse`` under ASGI 2.4 (what uvicorn speaks) notices a hang-up only
when a send fails, at the next event; a long prompt prefilled in small chunks sends nothing for
a long time, and would keep its blocks and its share of every step for a client that is gone.
These tests drive :class:`~minikv.serve.middleware.GuardedStreamingResponse` through bare ASGI
calls, so that "nothing to send" can be made to last for ever.  tests/test_serve.py checks the
same through a real server, after the first token.
"""
from __future__ import annotations

import asyncio

import pytest

from minikv.serve.middleware import GuardedStreamingResponse

SCOPE = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"}, "method": "POST", "path": "/"}


def _call(body, receive, spec="2.4", fail_after=None, timeout=5.0):
    """Run one response to its end; returns (cleanups, messages sent).  ``fail_after=n``: every
    body send after the first ``n`` messages raises OSError, as when the client's socket is gone."""
    cleanups, sent = [], []

    async def cleanup():
        cleanups.append(True)

    async def send(message):
        if fail_after is not None and message["type"] == "http.response.body" and len(sent) >= fail_after:
            raise OSError("connection reset")
        sent.append(message)

    async def main():
        response = GuardedStreamingResponse(body(), cleanup, media_type="text/event-stream")
        scope = {**SCOPE, "asgi": {"version": "3.0", "spec_version": spec}}
        await asyncio.wait_for(response(scope, receive, send), timeout)

    asyncio.run(main())
    return cleanups, sent


@pytest.mark.parametrize("spec", ["2.4", "2.3"])
def test_a_hangup_ends_a_stream_that_has_nothing_to_send(spec):
    """The body waits for ever (a prefill with no token yet); the client hangs up: the response
    ends at once and runs its cleanup (which aborts the request in the engine)."""
    async def body():
        await asyncio.sleep(3600)
        yield "data: never\n\n"

    async def receive():
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}

    cleanups, sent = _call(body, receive, spec)
    assert cleanups == [True]
    assert [m["type"] for m in sent] == ["http.response.start"], sent


def test_a_client_that_stays_gets_every_event_and_one_cleanup():
    """The other side of the race: while the client is connected, the whole body is sent."""
    async def body():
        for i in range(3):
            await asyncio.sleep(0.01)
            yield f"data: {i}\n\n"

    async def receive():
        await asyncio.sleep(3600)  # the client never leaves; the response must end on its own
        return {"type": "http.disconnect"}

    cleanups, sent = _call(body, receive)
    assert cleanups == [True]
    bodies = [m["body"] for m in sent if m["type"] == "http.response.body"]
    assert bodies == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b""], sent


def test_a_send_that_fails_mid_stream_still_cleans_up():
    """A hang-up seen first by a failing send (OSError), not by ``receive``: one cleanup, no error."""
    async def body():
        for i in range(5):
            yield f"data: {i}\n\n"

    async def receive():
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    cleanups, sent = _call(body, receive, fail_after=2)
    assert cleanups == [True] and len(sent) == 2
