"""Helpers shared by the gateway tests: a gateway in a thread, a recording fake upstream,
and one completion call that returns (status, cached_tokens)."""
from __future__ import annotations

import asyncio
import threading

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from minikv.gateway import lab
from minikv.serve.background import BackgroundServer

OPERATOR = {"sk-op": "ops"}


def start_gateway(upstreams, keys: dict, **kw):
    """:func:`minikv.gateway.lab.start_gateway` with the operator key ``sk-op``."""
    return lab.start_gateway(upstreams, keys, operator_keys=OPERATOR, **kw)


def complete(base_url: str, key: str | None, prompt, max_tokens: int = 1, timeout: float = 120.0, **extra):
    """POST /completions; returns (status, cached_tokens or None, json or text)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    headers.update(extra.pop("headers", {}))
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(f"{base_url}/completions", json=body, headers=headers, timeout=timeout)
    try:
        payload = r.json()
    except ValueError:
        return r.status_code, None, r.text
    details = ((payload.get("usage") or {}).get("prompt_tokens_details") or {}) if isinstance(payload, dict) else {}
    return r.status_code, details.get("cached_tokens"), payload


def fake_upstream(model: str = "fake", stream_chunks: int = 1000, chunk_delay: float = 0.01):
    """An OpenAI-shaped upstream that records every request (body + headers) and whether a
    stream was cancelled.  ``srv.seen`` (list of (path, headers, body)), ``srv.cancelled``."""
    app = FastAPI()
    seen: list = []
    cancelled = threading.Event()
    started = threading.Event()

    def usage(body):
        return {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4,
                "prompt_tokens_details": {"cached_tokens": 0}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model, "object": "model", "owned_by": "fake"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        seen.append(("/v1/chat/completions", dict(request.headers), body))
        return {"id": "x", "object": "chat.completion", "model": model, "usage": usage(body),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "length"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(("/v1/completions", dict(request.headers), body))
        if body.get("prompt") == "slow":     # like vLLM: a whole-answer request watches its client
            started.set()
            for _ in range(300):
                if await request.is_disconnected():
                    cancelled.set()
                    return {}
                await asyncio.sleep(0.1)
        if not body.get("stream"):
            return {"id": "x", "object": "text_completion", "model": model,
                    "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}], "usage": usage(body)}

        async def events():
            try:
                for i in range(stream_chunks):
                    started.set()
                    yield f'data: {{"choices": [{{"index": 0, "text": "t{i}"}}]}}\n\n'
                    await asyncio.sleep(chunk_delay)
                yield "data: [DONE]\n\n"
            except (asyncio.CancelledError, GeneratorExit):
                cancelled.set()
                raise
        return StreamingResponse(events(), media_type="text/event-stream")

    srv = BackgroundServer(app).start()
    srv.seen, srv.cancelled, srv.started = seen, cancelled, started
    return srv
