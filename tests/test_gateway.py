"""``minikv gateway`` over HTTP, against ``minikv serve --trust-client-salt`` (tiny-random) and a
recording fake upstream.  Fast: no vLLM needed (tests/test_vllm_gateway.py has those).

Isolation is checked in both directions every time: the other tenant gets no cached tokens
AND the same tenant does, so a gateway that merely switched caching off could not pass.
"""
from __future__ import annotations

import argparse
import json
import socket
import time

import httpx
import pytest

from minikv import LLM
from minikv.gateway.cli import start_checks
from minikv.gateway.probe import UnverifiedUpstream, probe_upstream
from minikv.gateway.salt import Identity, derive_salt
from minikv.serve.app import create_app
from minikv.serve.background import BackgroundServer
from minikv.serve.limits import ServeLimits

from gateway_helpers import complete, fake_upstream, start_gateway

KEYS = {"sk-alice-1": "alice", "sk-alice-2": "alice", "sk-bob": "bob"}
UPSTREAM_KEY = {"sk-gateway": "gateway"}     # the gateway is ONE tenant of the upstream


def prompt(tag: str, n: int = 120) -> str:
    return (f"{tag}: " + "the rain in spain stays mainly in the plain; " * 10)[:n]


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(tiny_path, enable_prefix_caching=True)


@pytest.fixture(scope="module")
def upstream(llm):
    app = create_app(llm, UPSTREAM_KEY, model_name="tiny-random", report_cached_tokens=True,
                     trust_client_salt=True,
                     limits=ServeLimits(requests_per_s=None, max_concurrent=None, max_tokens_in_flight=None))
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def gateway(upstream, tiny_path, tmp_path_factory):
    trail = tmp_path_factory.mktemp("gw") / "trail.jsonl"
    srv = start_gateway([upstream.base_url], KEYS, model_dir=tiny_path, upstream_key="sk-gateway",
                        trail_path=trail, max_tokens_cap=8)
    srv.trail_path = trail
    yield srv
    srv.stop()


def test_serve_trust_client_salt_isolates_by_salt_both_directions(upstream):
    p = prompt("serve-salt")
    assert complete(upstream.base_url, "sk-gateway", p, cache_salt="s1")[:2] == (200, 0)
    assert complete(upstream.base_url, "sk-gateway", p, cache_salt="s1")[1] > 0      # same salt hits
    assert complete(upstream.base_url, "sk-gateway", p, cache_salt="s2")[1] == 0     # other salt misses
    assert complete(upstream.base_url, "sk-gateway", p)[1] == 0                     # no salt: the tenant's own
    status, _, body = complete(upstream.base_url, "sk-gateway", p, cache_salt=17)
    assert status == 400 and "cache_salt" in body["error"]["message"]


@pytest.fixture
def own_llm(tiny_path):
    """An engine of this test's own: the module's ``llm`` is already served by ``upstream``, and
    an engine is stepped by one runner only (a second live app on it is refused)."""
    return LLM(tiny_path, enable_prefix_caching=True)


def test_serve_ignores_cache_salt_by_default(own_llm):
    app = create_app(own_llm, UPSTREAM_KEY, model_name="tiny-random", report_cached_tokens=True)
    with BackgroundServer(app) as srv:
        p = prompt("serve-default")
        complete(srv.base_url, "sk-gateway", p, cache_salt="s1")
        assert complete(srv.base_url, "sk-gateway", p, cache_salt="s2")[1] > 0   # the salt changed nothing


def test_gateway_isolates_tenants_both_directions(gateway):
    p = prompt("iso")
    assert complete(gateway.base_url, "sk-alice-1", p)[:2] == (200, 0)
    assert complete(gateway.base_url, "sk-alice-2", p)[1] > 0      # same tenant, other key: hit
    assert complete(gateway.base_url, "sk-bob", p)[1] == 0         # other tenant: miss
    assert complete(gateway.base_url, "sk-bob", p)[1] > 0          # ... and bob hits his own


def test_a_copied_salt_buys_nothing(gateway):
    victim_salt = derive_salt(gateway.secret, Identity("alice"))   # the worst case: bob learnt it
    p = prompt("copy")
    complete(gateway.base_url, "sk-alice-1", p)
    status, cached, _ = complete(gateway.base_url, "sk-bob", p, cache_salt=victim_salt,
                                 headers={"X-Cache-Salt": victim_salt})
    assert (status, cached) == (200, 0)


def test_user_scope_separates_users_of_a_tenant(upstream, tiny_path):
    keys = {"sk-1": "acme/bob", "sk-2": "acme/bob", "sk-3": "acme/eve"}
    srv = start_gateway([upstream.base_url], keys, upstream_key="sk-gateway", salt_scope="user")
    try:
        p = prompt("users")
        complete(srv.base_url, "sk-1", p)
        assert complete(srv.base_url, "sk-2", p)[1] > 0    # the same user, another key
        assert complete(srv.base_url, "sk-3", p)[1] == 0   # another user of the same tenant
    finally:
        srv.stop()


def test_bad_input_gets_clear_errors_and_the_gateway_keeps_serving(gateway):
    p = prompt("bad")
    status, _, body = complete(gateway.base_url, None, p)
    assert status == 401 and "API key" in body["error"]["message"]
    status, _, body = complete(gateway.base_url, "sk-mallory", p)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    r = httpx.post(f"{gateway.base_url}/completions", content=b"x" * (2 << 20),
                   headers={"Authorization": "Bearer sk-bob", "Content-Type": "application/json"})
    assert r.status_code == 413 and "exceeds" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway.base_url}/completions", content=b"{not json",
                   headers={"Authorization": "Bearer sk-bob"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    status, _, body = complete(gateway.base_url, "sk-bob", p, max_tokens=9)
    assert status == 400 and "cap of 8" in body["error"]["message"]
    status, _, body = complete(gateway.base_url, "sk-bob", p, max_tokens=-1)
    assert status == 400 and "positive integer" in body["error"]["message"]
    assert complete(gateway.base_url, "sk-bob", p)[0] == 200      # still serving


def test_operator_endpoints_need_an_operator_key(gateway):
    for key in (None, "sk-bob"):
        r = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": f"Bearer {key}"} if key else {})
        assert r.status_code == 401
    r = httpx.get(f"{gateway.url}/metrics", headers={"Authorization": "Bearer sk-op"})
    assert r.status_code == 200 and "minikv_gateway_client_salts_replaced" in r.text
    r = httpx.get(f"{gateway.url}/admin/findings", headers={"Authorization": "Bearer sk-op"})
    assert r.status_code == 200 and isinstance(r.json()["findings"], list)


def test_trail_has_keyed_fingerprints_and_no_prompt_text(gateway):
    secret_text = "zebra-violet-secret " * 5
    assert complete(gateway.base_url, "sk-bob", secret_text)[0] == 200
    gateway.trail.trail.flush()
    text = gateway.trail_path.read_text()
    assert "zebra" not in text
    last = [json.loads(line) for line in text.splitlines() if '"summary"' in line][-1]
    assert last["tenant"] == "bob" and last["num_prompt_tokens"] >= 100
    assert len(last["prefix_fps"]) == last["num_prompt_tokens"] // 16    # the upstream's block size


def test_the_detector_flags_probing_through_the_gateway(gateway):
    base = prompt("probe-victim", 64)       # 4 blocks of 16
    for i in range(9):
        assert complete(gateway.base_url, "sk-alice-1", base + f" guess {i:02d}")[0] == 200
    r = httpx.get(f"{gateway.url}/admin/findings", headers={"Authorization": "Bearer sk-op"})
    assert any(f["kind"] == "probing" and f["tenant"] == "alice" for f in r.json()["findings"])


def test_per_tenant_rate_and_concurrency_limits(upstream):
    srv = start_gateway([upstream.base_url], KEYS, upstream_key="sk-gateway",
                        limits=ServeLimits(requests_per_s=0.01, burst=2))
    try:
        p = prompt("rate")
        assert [complete(srv.base_url, "sk-bob", p)[0] for _ in range(2)] == [200, 200]
        r = httpx.post(f"{srv.base_url}/completions", json={"prompt": p}, headers={"Authorization": "Bearer sk-bob"})
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1
        assert "rate" in r.json()["error"]["message"]
        assert complete(srv.base_url, "sk-alice-1", p)[0] == 200      # another tenant is unaffected
    finally:
        srv.stop()


def test_forwarded_request_is_built_fresh(tiny_path):
    up = fake_upstream()
    srv = start_gateway([up.base_url], KEYS, upstream_key="sk-up", salt_header=True, max_tokens_cap=5)
    try:
        status, _, _ = complete(srv.base_url, "sk-bob", "hi", cache_salt="chosen-by-client",
                                headers={"X-Cache-Salt": "also-chosen", "X-Other": "1"}, max_tokens=None)
        assert status == 200
        _, headers, body = up.seen[-1]
        salt = derive_salt(srv.secret, Identity("bob"))
        assert body["cache_salt"] == salt and headers["x-cache-salt"] == salt
        assert headers["authorization"] == "Bearer sk-up"           # never the client's key
        assert "x-other" not in headers
        assert body["max_tokens"] == 5                               # absent -> the cap
    finally:
        srv.stop()
        up.stop()


def test_upstream_down_is_a_clear_502_and_nothing_is_sent():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    srv = start_gateway([dead], KEYS)
    try:
        status, _, body = complete(srv.base_url, "sk-bob", "hi")
        assert status == 502 and dead in body["error"]["message"] and "not served" in body["error"]["message"]
        assert complete(srv.base_url, "sk-bob", "hi")[0] == 502     # and it keeps answering
    finally:
        srv.stop()


def test_second_upstream_serves_when_the_first_cannot_connect():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    up = fake_upstream()
    srv = start_gateway([dead, up.base_url], KEYS)
    try:
        assert all(complete(srv.base_url, "sk-bob", f"p{i}")[0] == 200 for i in range(6))
        assert all(b["cache_salt"] for _, _, b in up.seen)
    finally:
        srv.stop()
        up.stop()


def _wait(event, timeout=10.0) -> bool:
    return event.wait(timeout)


def test_client_disconnect_mid_stream_cancels_the_upstream_request():
    up = fake_upstream()
    srv = start_gateway([up.base_url], KEYS)
    try:
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", f"{srv.base_url}/completions", json={"prompt": "go", "stream": True},
                          headers={"Authorization": "Bearer sk-bob"}) as r:
                assert r.status_code == 200
                next(r.iter_raw())          # the stream is flowing
        assert _wait(up.cancelled), "the upstream stream was not cancelled after the client left"
        assert complete(srv.base_url, "sk-bob", "after")[0] == 200
    finally:
        srv.stop()
        up.stop()


def test_client_disconnect_before_a_whole_answer_cancels_the_upstream_request():
    up = fake_upstream()
    srv = start_gateway([up.base_url], KEYS)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{srv.base_url}/completions", json={"prompt": "slow"},
                       headers={"Authorization": "Bearer sk-bob"}, timeout=httpx.Timeout(1.5, connect=5))
        assert _wait(up.cancelled), "the upstream request was not cancelled after the client left"
    finally:
        srv.stop()
        up.stop()


def test_probe_verifies_a_salting_upstream_and_measures_its_block_size(upstream):
    result = probe_upstream(upstream.base_url, "tiny-random", "sk-gateway", seed=1)
    assert result.verified and result.method == "cached_tokens" and result.block_size == 16


def test_probe_refuses_an_upstream_that_ignores_the_salt(own_llm):
    app = create_app(own_llm, UPSTREAM_KEY, model_name="tiny-random", report_cached_tokens=True)  # no salt trust
    with BackgroundServer(app) as srv:
        result = probe_upstream(srv.base_url, "tiny-random", "sk-gateway", seed=2)
        assert result.same_salt_hit and result.other_salt_hit and not result.verified
        args = argparse.Namespace(upstream=[srv.base_url], allow_unverified_upstream=False, salt_header=False,
                                  block_size=None, public_prefix=None, tokenizer="tiny-random")
        with pytest.raises(UnverifiedUpstream, match="does NOT isolate by salt"):
            start_checks(args, "sk-gateway")
        args.allow_unverified_upstream = True                                  # the explicit override
        assert start_checks(args, "sk-gateway")["kinds"] == ["minikv"]


def test_probe_refuses_an_upstream_without_caching(tiny_path):
    app = create_app(LLM(tiny_path, enable_prefix_caching=False), UPSTREAM_KEY, model_name="tiny-random",
                     report_cached_tokens=True, trust_client_salt=True)
    with BackgroundServer(app) as srv:
        result = probe_upstream(srv.base_url, "tiny-random", "sk-gateway", seed=3)
        assert not result.same_salt_hit and not result.verified and "no cache hits" in result.describe()


def test_public_prefix_only_for_minikv_upstreams_that_share_it(tiny_path):
    public = "You are the helpful assistant of Example Corp. " * 3
    app = create_app(LLM(tiny_path, enable_prefix_caching=True, shared_prefixes=(public,)), UPSTREAM_KEY,
                     model_name="tiny-random", report_cached_tokens=True, trust_client_salt=True)
    up = fake_upstream()
    with BackgroundServer(app) as srv:
        args = argparse.Namespace(upstream=[srv.base_url], allow_unverified_upstream=False, salt_header=False,
                                  block_size=None, public_prefix=public, tokenizer="tiny-random")
        assert start_checks(args, "sk-gateway")["block_size"] == 16
        args.public_prefix = "a prefix this upstream was never told about " * 3
        with pytest.raises(UnverifiedUpstream, match="does not share the public prefix"):
            start_checks(args, "sk-gateway")
    try:
        args = argparse.Namespace(upstream=[up.base_url], allow_unverified_upstream=True, salt_header=False,
                                  block_size=None, public_prefix=public, tokenizer="tiny-random")
        with pytest.raises(UnverifiedUpstream, match="block 0"):
            start_checks(args, None)
    finally:
        up.stop()


def test_chat_requests_are_salted_and_bad_messages_refused(gateway):
    url, auth = f"{gateway.base_url}/chat/completions", {"Authorization": "Bearer sk-bob"}
    messages = [{"role": "system", "content": prompt("chat", 100)}, {"role": "user", "content": "hi"}]
    first = httpx.post(url, json={"messages": messages, "max_tokens": 2}, headers=auth, timeout=60)
    again = httpx.post(url, json={"messages": messages, "max_tokens": 2}, headers=auth, timeout=60)
    other = httpx.post(url, json={"messages": messages, "max_tokens": 2}, timeout=60,
                       headers={"Authorization": "Bearer sk-alice-1"})
    cached = [r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in (first, again, other)]
    assert cached[0] == 0 and cached[1] > 0 and cached[2] == 0
    r = httpx.post(url, json={"messages": [{"content": 5}]}, headers=auth, timeout=60)
    assert r.status_code == 400 and "messages[0]" in r.json()["error"]["message"]


def test_per_tenant_concurrency_limit_is_a_clear_429():
    up = fake_upstream()
    srv = start_gateway([up.base_url], KEYS, limits=ServeLimits(max_concurrent=1, max_queued=0))
    try:
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", f"{srv.base_url}/completions", json={"prompt": "go", "stream": True},
                          headers={"Authorization": "Bearer sk-bob"}) as held:
                chunks = held.iter_raw()                    # keep it: a dropped iterator closes the stream
                next(chunks)                                # bob's one slot is taken
                status, _, body = complete(srv.base_url, "sk-bob", "second")
                assert status == 429 and "running" in body["error"]["message"]
                assert complete(srv.base_url, "sk-alice-1", "other tenant")[0] == 200
        assert complete(srv.base_url, "sk-bob", "after")[0] == 200    # the slot came back
    finally:
        srv.stop()
        up.stop()


def test_gateway_command_refuses_bad_keys_and_dead_upstreams(tmp_path, capsys):
    from minikv.cli import main

    keys = tmp_path / "keys.json"
    keys.write_text('{"sk-a": "alice", "sk-a": "bob"}')
    assert main(["gateway", "--upstream", "http://127.0.0.1:9/v1", "--api-keys", str(keys)]) == 1
    assert "repeats the key of entry 1" in capsys.readouterr().err
    keys.write_text('{"sk-a": "alice"}')
    assert main(["gateway", "--upstream", "http://127.0.0.1:9/v1", "--api-keys", str(keys)]) == 1
    assert "did not list its models" in capsys.readouterr().err
