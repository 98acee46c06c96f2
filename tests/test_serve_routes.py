"""The generation routes both servers share (:mod:`minikv.serve.routes`), on a bare app.

The handler here is a stub that records what it was given, so these tests see only the
admission: who the request is from, the cheapest-first order of the checks, and that the
tenant's concurrency slot comes back however the handler ends -- returned, raised, or handed
to a stream that ends later.  tests/test_serve*.py and tests/test_gateway.py drive the same
routes through the real servers.
"""
from __future__ import annotations

import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from minikv.serve.limits import ServeLimits, TenantLimiter
from minikv.serve.middleware import install_error_handlers
from minikv.serve.protocol import APIError
from minikv.serve.routes import add_openai_routes

KEYS = {"Bearer sk-a": "alice", "Bearer sk-b": "bob"}
ALICE, BOB = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}


def identify(request: Request) -> str:
    tenant = KEYS.get(request.headers.get("authorization", ""))
    if tenant is None:
        raise APIError(401, "bad key", code="invalid_api_key")
    request.state.tenant = tenant
    return tenant


def make_app(limits: ServeLimits):
    """A bare app with the shared routes; ``calls`` records each admitted request, and the
    handler does what the body's ``do`` says: answer, fail, or hand its lease to ``kept``."""
    app, limiter = FastAPI(), TenantLimiter(limits)
    install_error_handlers(app)
    calls, kept = [], []

    async def handle(request: Request, chat: bool, who, lease):
        body = await request.json()
        calls.append((request.url.path, chat, who, limiter.snapshot(who)["active"]))
        if body["do"] == "fail":
            raise APIError(400, "the handler refused")
        if body["do"] == "crash":
            raise RuntimeError("a bug in the handler")
        if body["do"] == "stream":
            kept.append(lease.hand_off())
        return {"ok": True}

    add_openai_routes(app, limiter, limits.max_body_bytes, identify, handle)
    return TestClient(app, raise_server_exceptions=False), limiter, calls, kept


def test_both_routes_reach_the_handler_with_who_and_chat():
    client, limiter, calls, _ = make_app(ServeLimits())
    assert client.post("/v1/completions", json={"do": "ok"}, headers=ALICE).json() == {"ok": True}
    assert client.post("/v1/chat/completions", json={"do": "ok"}, headers=BOB).status_code == 200
    # the handler ran holding one slot of the right tenant; both were given back afterwards
    assert calls == [("/v1/completions", False, "alice", 1), ("/v1/chat/completions", True, "bob", 1)]
    assert limiter.snapshot("alice")["active"] == limiter.snapshot("bob")["active"] == 0


@pytest.mark.parametrize("do, status", [("fail", 400), ("crash", 500)])
def test_the_slot_comes_back_when_the_handler_raises(do, status):
    client, limiter, calls, _ = make_app(ServeLimits(max_concurrent=1, max_queued=0))
    for _ in range(3):  # with a leaked slot, the second request would be refused (429)
        assert client.post("/v1/completions", json={"do": do}, headers=ALICE).status_code == status
    assert len(calls) == 3 and limiter.snapshot("alice")["active"] == 0


def test_a_handed_off_slot_is_held_until_the_stream_releases_it():
    client, limiter, calls, kept = make_app(ServeLimits(max_concurrent=1, max_queued=0))
    assert client.post("/v1/completions", json={"do": "stream"}, headers=ALICE).status_code == 200
    assert limiter.snapshot("alice")["active"] == 1  # the handler returned; the "stream" holds it
    r = client.post("/v1/completions", json={"do": "ok"}, headers=ALICE)
    assert r.status_code == 429 and len(calls) == 1  # refused before the handler ran ...
    assert client.post("/v1/completions", json={"do": "ok"}, headers=BOB).status_code == 200  # ... for alice only
    release = kept.pop()
    release()  # the stream ends
    release()  # a second end (cancelled after it finished) gives back nothing more
    assert limiter.snapshot("alice")["active"] == 0
    assert client.post("/v1/completions", json={"do": "ok"}, headers=ALICE).status_code == 200


def test_cheapest_check_first():
    client, limiter, calls, _ = make_app(ServeLimits(requests_per_s=0.001, burst=1, max_body_bytes=64))
    big = {"do": "ok", "pad": "x" * 100}
    # a bad key is refused before anything counts against a tenant
    assert client.post("/v1/completions", json=big, headers={"Authorization": "Bearer nope"}).status_code == 401
    # alice's one request of the burst: refused for its size (413), but the rate was taken first ...
    assert client.post("/v1/completions", json=big, headers=ALICE).status_code == 413
    # ... so the next is a 429 for the rate, even though its body would be fine
    r = client.post("/v1/completions", json={"do": "ok"}, headers=ALICE)
    assert r.status_code == 429 and "Retry-After" in r.headers
    assert calls == [] and limiter.snapshot("alice")["active"] == 0  # no slot was ever taken
    assert client.post("/v1/completions", json={"do": "ok"}, headers=BOB).status_code == 200  # bob's own bucket
