"""The gateway passes tenants through to ``minikv serve`` (``--gateway-keys``, ``X-Minikv-Tenant``),
every route counts against a tenant's rate, every limit flag of the gateway is enforced, and
``/metrics`` labels stay per API-key tenant however many salts clients send."""
from __future__ import annotations

import argparse

import httpx
import pytest

from minikv import LLM
from minikv.serve import identity
from minikv.serve.app import create_app
from minikv.serve.background import BackgroundServer
from minikv.serve.limits import ServeLimits

from gateway_helpers import complete, fake_upstream, start_gateway

KEYS = {"sk-alice": "alice", "sk-mallory": "mallory"}
GATEWAY = {"sk-gateway": "gw"}
DIRECT = {"sk-direct": "direct"}


def bearer(key: str, tenant: str | None = None) -> dict:
    return {"Authorization": f"Bearer {key}", **({"X-Minikv-Tenant": tenant} if tenant is not None else {})}


@pytest.fixture(scope="module")
def llm(tiny_path):
    return LLM(tiny_path, enable_prefix_caching=True)


@pytest.fixture()
def upstream(llm):
    """``minikv serve`` with a small request burst per tenant: three requests, then 429."""
    app = create_app(llm, DIRECT, model_name="tiny-random", report_cached_tokens=True, trust_client_salt=True,
                     gateway_keys=GATEWAY, operator_keys={"sk-op": "ops"},
                     limits=ServeLimits(requests_per_s=0.01, burst=3))
    with BackgroundServer(app) as srv:
        yield srv


# ------------------------------------------------------------------ serve: who may assert a tenant
def test_only_a_gateway_key_may_name_a_tenant(upstream):
    models = f"{upstream.base_url}/models"
    r = httpx.get(models, headers=bearer("sk-direct", "alice"))
    assert r.status_code == 403 and r.json()["error"]["code"] == "tenant_assertion_refused"
    assert httpx.get(models, headers=bearer("sk-gateway", "alice")).status_code == 200
    assert httpx.get(models, headers=bearer("sk-nope", "alice")).status_code == 401
    for bad in ("", "x" * 129, "a#salt-b", "tab\there"):
        r = httpx.get(models, headers=bearer("sk-gateway", bad))
        assert r.status_code == 400 and "X-Minikv-Tenant" in r.json()["error"]["message"], bad
    limiter = upstream.app.state.limiter
    assert "gw/alice" in limiter._tenants and "alice" not in limiter._tenants   # under the gateway's name


def test_asserted_tenants_are_bounded(upstream, monkeypatch):
    monkeypatch.setattr(identity, "MAX_ASSERTED_TENANTS", 2)
    resolve = identity.TenantResolver(upstream.app.state.api_keys, upstream.app.state.api_keys.__class__(GATEWAY))
    headers = lambda t: [(b"authorization", b"Bearer sk-gateway"), (b"x-minikv-tenant", t.encode())]
    assert resolve(headers("a")) == "gw/a" and resolve(headers("b")) == "gw/b" and resolve(headers("a")) == "gw/a"
    with pytest.raises(Exception, match="more than 2 distinct tenants"):
        resolve(headers("c"))


def test_every_route_counts_against_the_tenants_rate(upstream):
    """/v1/models used to be free: 200 requests in a burst all reached the server."""
    codes = [httpx.get(f"{upstream.base_url}/models", headers=bearer("sk-direct")).status_code for _ in range(4)]
    assert codes == [200, 200, 200, 429]
    r = httpx.get(f"{upstream.base_url}/models/tiny-random", headers=bearer("sk-direct"))
    assert r.status_code == 429 and "rate" in r.json()["error"]["message"]
    assert httpx.get(f"{upstream.base_url}/models", headers=bearer("sk-gateway", "other")).status_code == 200
    up = fake_upstream()
    gw = start_gateway([up.base_url], KEYS, limits=ServeLimits(requests_per_s=0.01, burst=2))
    try:
        codes = [httpx.get(f"{gw.base_url}/models", headers=bearer("sk-mallory")).status_code for _ in range(3)]
        assert codes == [200, 200, 429]
        assert httpx.get(f"{gw.base_url}/models", headers=bearer("sk-alice")).status_code == 200
    finally:
        gw.stop()
        up.stop()


# ------------------------------------------------------------------ through the gateway
def _flood_then_victim(gateway_url: str) -> tuple[list[int], list[int]]:
    mallory = [complete(gateway_url, "sk-mallory", f"flood {i}")[0] for i in range(6)]
    alice = [complete(gateway_url, "sk-alice", f"victim {i}")[0] for i in range(3)]
    return mallory, alice


def test_through_the_gateway_one_tenants_flood_never_gets_another_a_429(upstream):
    unlimited = ServeLimits(requests_per_s=None, max_concurrent=None, max_tokens_in_flight=None)
    gw = start_gateway([upstream.base_url], KEYS, upstream_key="sk-gateway", limits=unlimited,
                       tenant_upstreams=(upstream.base_url,))
    try:
        mallory, alice = _flood_then_victim(gw.base_url)
        assert mallory == [200] * 3 + [429] * 3      # mallory meets the upstream's limit: her own
        assert alice == [200] * 3                    # and alice does not
        r = httpx.post(f"{gw.base_url}/completions", json={"prompt": "x", "max_tokens": 1},
                       headers=bearer("sk-mallory"))
        assert r.status_code == 429 and int(r.headers["Retry-After"]) >= 1   # the upstream's, passed on
    finally:
        gw.stop()
    # The same gateway without the tenant header: every tenant is the gateway, and alice pays.
    gw = start_gateway([upstream.base_url], KEYS, upstream_key="sk-gateway", limits=unlimited)
    try:
        mallory, alice = _flood_then_victim(gw.base_url)
        assert mallory == [200] * 3 + [429] * 3 and alice == [429] * 3
    finally:
        gw.stop()


def test_the_gateway_refuses_to_start_when_a_minikv_upstream_refuses_its_tenant_header(upstream):
    from minikv.gateway.cli import check_tenant_header
    check_tenant_header(upstream.base_url, "sk-gateway", "alice")
    with pytest.raises(RuntimeError, match="refused the gateway's X-Minikv-Tenant .*--gateway-keys"):
        check_tenant_header(upstream.base_url, "sk-direct", "alice")


# ------------------------------------------------------------------ every limit flag of the gateway
def _parse(argv: list[str]) -> argparse.Namespace:
    from minikv.gateway.cli import add_gateway_parser
    parser = argparse.ArgumentParser()
    add_gateway_parser(parser.add_subparsers())
    return parser.parse_args(["gateway", "--upstream", "http://127.0.0.1:9/v1", "--api-keys", "k.json", *argv])


FLAGS = [("--requests-per-s", "2.5", "requests_per_s", 2.5), ("--burst", "7", "burst", 7),
         ("--max-concurrent", "3", "max_concurrent", 3), ("--max-queued", "0", "max_queued", 0),
         ("--max-tokens-in-flight", "100", "max_tokens_in_flight", 100),
         ("--max-body-bytes", "1000", "max_body_bytes", 1000),
         ("--max-prompt-chars", "100", "max_prompt_chars", 100), ("--max-messages", "2", "max_messages", 2)]


@pytest.mark.parametrize("flag, value, field, want", FLAGS, ids=[f[0] for f in FLAGS])
def test_each_limit_flag_reaches_the_gateways_limits(flag, value, field, want):
    from minikv.serve.cli import limits_from_args
    assert getattr(limits_from_args(_parse([flag, value])), field) == want


@pytest.fixture(scope="module")
def fake():
    up = fake_upstream()
    yield up
    up.stop()


def _gateway(fake, **limits):
    return start_gateway([fake.base_url], KEYS, limits=ServeLimits(**limits))


def _chat(url: str, messages, key="sk-alice", **extra):
    return httpx.post(f"{url}/chat/completions", json={"messages": messages, "max_tokens": 1, **extra},
                      headers=bearer(key), timeout=30)


def test_max_prompt_chars_and_max_messages_are_enforced(fake):
    gw = _gateway(fake, max_prompt_chars=100, max_messages=2)
    try:
        assert complete(gw.base_url, "sk-alice", "a" * 100)[0] == 200
        status, _, body = complete(gw.base_url, "sk-alice", "a" * 1000)
        assert status == 400 and "--max-prompt-chars" in body["error"]["message"]
        assert complete(gw.base_url, "sk-alice", [5] * 101)[0] == 400            # token ids count one each
        msg = lambda n: {"role": "user", "content": "b" * n}
        assert _chat(gw.base_url, [msg(40), msg(60)]).status_code == 200
        r = _chat(gw.base_url, [msg(60), {"role": "user", "content": [{"type": "text", "text": "c" * 41}]}])
        assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"]
        r = _chat(gw.base_url, [msg(1)] * 3)
        assert r.status_code == 400 and "3 messages" in r.json()["error"]["message"] and \
            "--max-messages" in r.json()["error"]["message"]
    finally:
        gw.stop()


def test_max_body_bytes_and_max_tokens_in_flight_are_enforced(fake):
    gw = _gateway(fake, max_body_bytes=1000, max_tokens_in_flight=10)
    try:
        status, _, body = complete(gw.base_url, "sk-alice", "d" * 2000)
        assert status == 413
        status, _, body = complete(gw.base_url, "sk-alice", "fits", max_tokens=11)
        assert status == 400 and "budget of 10" in body["error"]["message"]
        assert complete(gw.base_url, "sk-alice", "fits", max_tokens=10)[0] == 200
    finally:
        gw.stop()


# ------------------------------------------------------------------ /metrics stays bounded
def test_fresh_salts_do_not_grow_metrics(llm):
    """300 fresh salts grew /metrics from 11 KB to 224 KB when labels were per salted domain."""
    app = create_app(llm, DIRECT, model_name="tiny-random", trust_client_salt=True, gateway_keys=GATEWAY,
                     operator_keys={"sk-op": "ops"})
    with BackgroundServer(app) as srv:
        _check_metrics_stay(srv)


def _check_metrics_stay(upstream):
    def scrape() -> list[str]:
        r = httpx.get(f"{upstream.url}/metrics", headers=bearer("sk-op"))
        assert r.status_code == 200
        return [line.rsplit(" ", 1)[0] for line in r.text.splitlines() if line and not line.startswith("#")]

    def ask(salt: str):
        r = httpx.post(f"{upstream.base_url}/completions", headers=bearer("sk-gateway", "salty"), timeout=60,
                       json={"prompt": "salted", "max_tokens": 1, "cache_salt": salt})
        assert r.status_code == 200, r.text
    ask("first")
    scrape()                                            # the scrape itself is a series of its own
    before = scrape()
    for i in range(3):
        ask(f"fresh-{i}")
    after = scrape()
    assert sorted(after) == sorted(before)              # the same series, only their values moved
    assert any('tenant="gw/salty"' in s for s in after) and not any("#salt-" in s for s in after)
