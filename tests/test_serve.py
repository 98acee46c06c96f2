"""The OpenAI-compatible server: endpoints, auth, errors, batching, disconnects, logs, metrics.

One tiny-random server (uvicorn in a thread of this process, 127.0.0.1, free port) serves the
whole module; tests that need a pristine engine build their own.
"""
from __future__ import annotations

import json
import logging
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from minikv import LLM
from minikv.serve import ApiKeys, BackgroundServer, create_app
from minikv.serve.metrics import ServerMetrics

KEYS = {"sk-alice": "alice", "sk-alice-2": "alice", "sk-bob": "bob"}
MODEL = "tiny"
ALICE = {"Authorization": "Bearer sk-alice"}
ALICE2 = {"Authorization": "Bearer sk-alice-2"}
BOB = {"Authorization": "Bearer sk-bob"}
OPERATORS = {"op-secret": "ops"}
OPERATOR = {"Authorization": "Bearer op-secret"}


@pytest.fixture(scope="module")
def server(tiny_path):
    llm = LLM(str(tiny_path), enable_prefix_caching=True, num_blocks=512, block_size=16, seed=0)
    app = create_app(llm, KEYS, model_name=MODEL, report_cached_tokens=True, operator_keys=OPERATORS)
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture()
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def complete(client, prompt="hello world", headers=ALICE, **kw):
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **kw}
    return client.post("/completions", json=body, headers=headers)


def wait_for(pred, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return False


def engine_call(server, fn):
    return server.app.state.runner.call(fn).result(timeout=30)


# ------------------------------------------------------------------ happy paths
def test_models_health_and_completion(client, server):
    r = client.get("/models", headers=ALICE)
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == [MODEL]
    assert client.get(f"/models/{MODEL}", headers=ALICE).json()["id"] == MODEL
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    r = complete(client, "The quick brown fox", max_tokens=5, ignore_eos=True)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == MODEL
    ch = out["choices"][0]
    assert ch["finish_reason"] == "length" and isinstance(ch["text"], str)
    u = out["usage"]
    assert u["completion_tokens"] == 5 and u["total_tokens"] == u["prompt_tokens"] + 5
    assert u["prompt_tokens_details"]["cached_tokens"] == 0


def test_prompt_forms_agree(client, server):
    """str, [str] and token ids are the same prompt (greedy => same text)."""
    text = "Paged attention stores keys and values in blocks"
    a = complete(client, text, max_tokens=6, ignore_eos=True).json()
    b = complete(client, [text], max_tokens=6, ignore_eos=True).json()
    ids = engine_call(server, lambda e: list(e.tokenizer(text).input_ids))
    c = complete(client, ids, max_tokens=6, ignore_eos=True).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"] == c["choices"][0]["text"]
    assert a["usage"]["prompt_tokens"] == c["usage"]["prompt_tokens"] == len(ids)


def test_seed_makes_sampling_reproducible(client):
    a = complete(client, "seeded", max_tokens=8, temperature=1.0, seed=7, ignore_eos=True).json()
    b = complete(client, "seeded", max_tokens=8, temperature=1.0, seed=7, ignore_eos=True).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]


def test_stop_string_is_cut(client):
    free = complete(client, "stop test", max_tokens=12, ignore_eos=True).json()["choices"][0]["text"]
    if len(free) < 4:
        pytest.skip("completion too short to pick a stop string")
    stop = free[2:4]
    idx = free.find(stop)
    out = complete(client, "stop test", max_tokens=12, ignore_eos=True, stop=[stop]).json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["text"] == free[:idx]


def test_chat_completion(client):
    body = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Hi there"}],
            "max_tokens": 4, "temperature": 0}
    r = client.post("/chat/completions", json=body, headers=ALICE)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"]["role"] == "assistant"
    # the chat template (ChatML) was applied: far more prompt tokens than the raw text
    assert out["usage"]["prompt_tokens"] > len("Be brief.Hi there")


def _sse(text: str) -> list:
    events = [line[len("data: "):] for line in text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_streaming_completion_matches_non_streaming(client):
    body = {"model": MODEL, "prompt": "stream me", "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    full = client.post("/completions", json=body, headers=ALICE).json()["choices"][0]["text"]
    r = client.post("/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                    headers=ALICE)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = _sse(r.text)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == full
    finals = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 10


def test_streaming_chat(client):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "stream"}], "max_tokens": 6,
            "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = _sse(client.post("/chat/completions", json=body, headers=ALICE).text)
    assert chunks[0]["object"] == "chat.completion.chunk"
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    full = client.post("/chat/completions", json={**body, "stream": False}, headers=ALICE).json()
    assert text == full["choices"][0]["message"]["content"]


# ------------------------------------------------------------------ tenants and keys
def test_tenant_isolation_and_keys(client):
    prompt = "tenant isolation check: " + "abcdefgh " * 8
    assert complete(client, prompt, headers=ALICE).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # another key of the same tenant hits; another tenant does not
    assert complete(client, prompt, headers=ALICE2).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert complete(client, prompt, headers=BOB).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_client_supplied_salt_and_tenant_are_ignored(client):
    """Copying alice's cache_salt / naming her as user gets bob nothing (vLLM #53347); a
    ``tenant`` field is not an OpenAI parameter, so it is refused outright."""
    r = complete(client, "x", headers=BOB, tenant="alice")
    assert r.status_code == 400 and r.json()["error"]["param"] == "tenant"
    for i, extra in enumerate(({"cache_salt": "s3cret"}, {"user": "alice"})):
        prompt = f"salted prompt {i}: " + "zyxwvuts " * 8  # new to bob each time
        r = complete(client, prompt, headers=ALICE, cache_salt="s3cret", user="alice")
        assert r.status_code == 200
        r = complete(client, prompt, headers=BOB, **extra)
        assert r.status_code == 200
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        # and alice hits her own cache whatever salt she sends
        r = complete(client, prompt, headers=ALICE, cache_salt=f"something-else-{i}")
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"}, {"Authorization": "sk-alice"},
                                     {"Authorization": "Basic sk-alice"}, {"Authorization": "Bearer"},
                                     {"Authorization": "Bearer sk-alicex"}, {"Authorization": "Bearer sk-alic"}])
def test_bad_keys_get_401(client, headers):
    for r in (complete(client, headers=headers), client.get("/models", headers=headers)):
        assert r.status_code == 401
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and set(err) == {"message", "type", "param", "code"}
    assert complete(client).status_code == 200


def test_api_keys_compare_every_key_in_constant_time():
    keys = ApiKeys({"k1": "a", "k2": "b"})
    assert keys.resolve("Bearer k1") == "a" and keys.resolve("bearer k2") == "b"
    assert keys.resolve("Bearer k3") is None and keys.resolve(None) is None
    assert "k1" not in repr(keys)
    import inspect
    src = inspect.getsource(ApiKeys.resolve)
    assert "compare_digest" in src and "return tenant" not in src  # no early exit
    with pytest.raises(ValueError):
        ApiKeys({})
    with pytest.raises(ValueError):
        ApiKeys({" padded ": "a"})


# ------------------------------------------------------------------ bad input
BAD_BODIES = [
    ("malformed json", b'{"model": "tiny", "prompt": ', 400),
    ("not an object", b'["hello"]', 400),
    ("not utf8", b'\xff\xfe{', 400),
    ("max_tokens 0", {"prompt": "x", "max_tokens": 0}, 400),
    ("max_tokens negative", {"prompt": "x", "max_tokens": -3}, 400),
    ("max_tokens string", {"prompt": "x", "max_tokens": "5"}, 400),
    ("max_tokens bool", {"prompt": "x", "max_tokens": True}, 400),
    ("max_tokens huge", {"prompt": "x", "max_tokens": 10**9}, 400),
    ("temperature negative", {"prompt": "x", "temperature": -0.5}, 400),
    ("temperature string", {"prompt": "x", "temperature": "hot"}, 400),
    ("top_p zero", {"prompt": "x", "top_p": 0}, 400),
    ("top_k", {"prompt": "x", "top_k": -5}, 400),
    ("seed string", {"prompt": "x", "seed": "x"}, 400),
    ("unknown model", {"prompt": "x", "model": "gpt-9"}, 404),
    ("model wrong type", {"prompt": "x", "model": 3}, 400),
    ("empty prompt", {"prompt": ""}, 400),
    ("empty list prompt", {"prompt": []}, 400),
    ("missing prompt", {"max_tokens": 3}, 400),
    ("prompt wrong type", {"prompt": 123}, 400),
    ("prompt dict", {"prompt": {"a": 1}}, 400),
    ("two prompts", {"prompt": ["a", "b"]}, 400),
    ("out-of-vocab id", {"prompt": [5, 999999]}, 400),
    ("negative id", {"prompt": [5, -1]}, 400),
    ("bool ids", {"prompt": [True, False]}, 400),
    ("n=2", {"prompt": "x", "n": 2}, 400),
    ("stream not bool", {"prompt": "x", "stream": "yes"}, 400),
    ("stop wrong type", {"prompt": "x", "stop": [1]}, 400),
    ("stop empty", {"prompt": "x", "stop": [""]}, 400),
    ("logprobs", {"prompt": "x", "logprobs": 3}, 400),
    ("echo", {"prompt": "x", "echo": True}, 400),
    ("too long prompt", {"prompt": list(range(3, 200)) * 12}, 400),
]


@pytest.mark.parametrize("name,body,status", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_completion_requests(client, name, body, status):
    if isinstance(body, dict):
        body = json.dumps({"model": MODEL, **body}).encode()
    r = client.post("/completions", content=body, headers={**ALICE, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    good = complete(client)
    assert good.status_code == 200, "the server must keep serving after a bad request"


BAD_CHATS = [
    ("no messages", {}, 400),
    ("empty messages", {"messages": []}, 400),
    ("messages not list", {"messages": "hi"}, 400),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, 400),
    ("content not str", {"messages": [{"role": "user", "content": 5}]}, 400),
    ("image part", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, 400),
    ("n=3", {"messages": [{"role": "user", "content": "hi"}], "n": 3}, 400),
]


@pytest.mark.parametrize("name,body,status", BAD_CHATS, ids=[b[0] for b in BAD_CHATS])
def test_bad_chat_requests(client, name, body, status):
    r = client.post("/chat/completions", json={"model": MODEL, **body}, headers=ALICE)
    assert r.status_code == status, r.text
    assert r.json()["error"]["message"]
    ok = client.post("/chat/completions", json={"model": MODEL, "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]}, headers=ALICE)
    assert ok.status_code == 200


def test_oversized_body_413(client):
    big = json.dumps({"model": MODEL, "prompt": "x" * (2 << 20)}).encode()
    r = client.post("/completions", content=big, headers={**ALICE, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(20):
            yield b"x" * (100 << 10)
    r = client.post("/completions", content=chunks(), headers=ALICE)
    assert r.status_code == 413
    assert complete(client).status_code == 200


def test_unknown_route_is_openai_shaped(client, server):
    r = client.get("/nope", headers=ALICE)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.base_url + "/completions", headers=ALICE)
    assert r.status_code == 405 and "error" in r.json()


# ------------------------------------------------------------------ concurrency
def test_concurrent_requests_share_a_batch(server, client):
    runner = server.app.state.runner
    engine_call(server, lambda e: setattr(runner, "max_batch_size", 0))
    n = 8

    def one(i):
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            return complete(c, f"concurrent request number {i}", max_tokens=24, ignore_eos=True)

    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(one, range(n)))
    assert all(r.status_code == 200 for r in results)
    assert all(r.json()["usage"]["completion_tokens"] == 24 for r in results)
    assert runner.max_batch_size > 1


def test_streaming_disconnect_aborts(server):
    runner = server.app.state.runner
    before = runner.num_aborted
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 2000, "ignore_eos": True,
            "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/completions", json=body, headers=ALICE) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    break  # got the first token; now hang up
    assert wait_for(lambda: runner.num_aborted > before), "the disconnected stream was not aborted"
    assert wait_for(lambda: engine_call(server, lambda e: not e.has_unfinished_requests()))


def test_non_streaming_disconnect_aborts(server):
    runner = server.app.state.runner
    before = runner.num_aborted
    body = json.dumps({"model": MODEL, "prompt": "another long story", "max_tokens": 2000,
                       "ignore_eos": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer sk-alice\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((server.host, server.port), timeout=10) as s:
        s.sendall(head + body)
        assert wait_for(lambda: engine_call(server, lambda e: e.has_unfinished_requests()), 10)
    assert wait_for(lambda: runner.num_aborted > before), "the dropped request was not aborted"
    assert complete(httpx.Client(base_url=server.base_url, timeout=60)).status_code == 200


# ------------------------------------------------------------------ logs and metrics
class _Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []  # emit() runs under the Handler's own lock

    def emit(self, record):
        try:
            msg = self.format(record)
        except Exception:  # noqa: BLE001
            msg = str(record.msg)
        self.lines.append(msg)


def test_logs_never_contain_prompt_text(tiny_path):
    secret = "PURPLE-ELEPHANT-7731"
    cap = _Capture()
    cap.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(cap)
    root.setLevel(logging.DEBUG)
    try:
        llm = LLM(str(tiny_path), enable_prefix_caching=True, num_blocks=256)
        app = create_app(llm, KEYS, model_name=MODEL)
        with BackgroundServer(app, log_level="debug", access_log=True) as srv, \
                httpx.Client(base_url=srv.base_url, timeout=60) as c:
            assert complete(c, f"my password is {secret}").status_code == 200
            body = {"model": MODEL, "messages": [{"role": "user", "content": secret}], "max_tokens": 3,
                    "stream": True}
            assert c.post("/chat/completions", json=body, headers=ALICE).status_code == 200
            assert complete(c, f"{secret}", max_tokens=0).status_code == 400
            assert complete(c, f"{secret}", model="unknown").status_code == 404
            assert complete(c, secret, headers=BOB, stop=[secret]).status_code == 200
    finally:
        root.removeHandler(cap)
        root.setLevel(old_level)
    text = "\n".join(cap.lines)
    assert "minikv.serve" in text and "finished" in text  # the server did log the requests
    assert secret not in text


def test_metrics_endpoint(server, client):
    complete(client, "metrics please", max_tokens=3, ignore_eos=True)
    # A side channel: no key, or a tenant's key, gets nothing; an operator key gets the counters.
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/metrics", headers=ALICE).status_code == 401
    r = httpx.get(server.url + "/metrics", headers=OPERATOR)
    assert r.status_code == 200
    text = r.text
    for name in ("minikv_requests_total", "minikv_prompt_tokens_total", "minikv_cached_prompt_tokens_total",
                 "minikv_generation_tokens_total", "minikv_num_requests_running",
                 "minikv_num_requests_waiting", "minikv_time_to_first_token_seconds_bucket"):
        assert name in text, name
    assert 'minikv_requests_total{endpoint="/v1/completions",status="200"}' in text
    # Per-tenant counters: fine here, because only operators can read them.
    assert 'minikv_tenant_requests_finished_total{finish_reason="length",tenant="alice"}' in text


def test_each_app_has_its_own_registry(tiny_path):
    llm = LLM(str(tiny_path), num_blocks=64)
    a, b = create_app(llm, KEYS), create_app(llm, KEYS)  # would raise "Duplicated timeseries" if shared
    assert a.state.metrics.registry is not b.state.metrics.registry
    a.state.metrics.generated_tokens.inc(5)
    assert b"minikv_generation_tokens_total 0.0" in b.state.metrics.render()[0]
    assert isinstance(ServerMetrics().render()[1], str)


def test_report_cached_tokens_off_omits_details(tiny_path):
    llm = LLM(str(tiny_path), enable_prefix_caching=True, num_blocks=128)
    with BackgroundServer(create_app(llm, KEYS, model_name=MODEL)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=60) as c:
        usage = complete(c).json()["usage"]
    assert "prompt_tokens_details" not in usage


def test_background_server_connections_send_without_nagle_delay():
    """Every connection BackgroundServer accepts has TCP_NODELAY set, as uvicorn's own sockets do.
    Without it (a listening socket made with proto 0, which asyncio does not recognise as TCP), a
    keep-alive response's body waited for the client's delayed ACK: ~45 ms per request on loopback,
    which made every lab, audit and lesson that talks HTTP to a BackgroundServer 10-100x slower.
    The option is read on the server's side of a live keep-alive connection (no timing involved)."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    app = Starlette(routes=[Route("/ping", lambda request: JSONResponse({"ok": True}))])
    with BackgroundServer(app) as srv, httpx.Client() as http:
        for _ in range(2):  # the second request reuses the connection
            assert http.get(srv.url + "/ping").json() == {"ok": True}
        conns = list(srv._server.server_state.connections)
        assert conns, "the server tracks no open connection"
        for proto in conns:
            sock = proto.transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0, "Nagle's algorithm is on"

