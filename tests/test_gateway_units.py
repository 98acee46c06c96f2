"""The gateway's pieces on their own: salts, identities, routing, serve's client-salt domains.

No server is started here; tests/test_gateway.py drives the whole gateway over HTTP.
"""
from __future__ import annotations

import base64
import hmac
import json

import pytest

from minikv.gateway.probe import infer_block_size
from minikv.gateway.routing import SaltAwareRouter
from minikv.gateway.salt import GatewayKeys, Identity, derive_salt, load_gateway_keys, parse_identity
from minikv.serve.auth import ApiKeys
from minikv.serve.client_salt import check_tenant_names, client_salt, salted_domain
from minikv.serve.protocol import APIError

SECRET = bytes(range(32))


def _field(text: str) -> bytes:
    """One str field of the wire format, written out by hand: tag 2, 8-byte big-endian length."""
    data = text.encode()
    return bytes([2]) + len(data).to_bytes(8, "big") + data


def test_salt_pinned_vector():
    # Frozen: a change here changes every tenant's salt (all caches go cold) -- bump the label.
    assert derive_salt(SECRET, Identity("alice")) == "VnrQqMSfdxP-ZHhziy6I-eQPUI2hIrqgnw8MIZUtG_w"
    assert derive_salt(SECRET, Identity("acme", "bob"), "user") == "IlDuyRg-JbcO-zUtok53MIV-Z5PEuCXZnvcqozv1x0w"
    # ... and the construction, recomputed from the bytes the module doc promises.
    msg = _field("minikv/gateway-salt/v1") + _field("user") + _field("acme") + _field("bob")
    mac = hmac.digest(SECRET, msg, "sha256")
    assert base64.urlsafe_b64encode(mac).rstrip(b"=").decode() == derive_salt(SECRET, Identity("acme", "bob"), "user")


def test_salt_is_length_prefixed_keyed_and_scoped():
    # ("ab", "c") and ("a", "bc") concatenate alike; length prefixes keep them apart.
    assert derive_salt(SECRET, Identity("ab", "c"), "user") != derive_salt(SECRET, Identity("a", "bc"), "user")
    # the tenant-scope salt of a tenant is not any user-scope salt of it
    assert derive_salt(SECRET, Identity("acme", "bob")) != derive_salt(SECRET, Identity("acme", "bob"), "user")
    # tenant scope ignores the user: every user of a tenant shares the tenant's domain
    assert derive_salt(SECRET, Identity("acme", "bob")) == derive_salt(SECRET, Identity("acme", "eve"))
    # keyed: another secret, another salt; and deterministic for one secret
    assert derive_salt(bytes(32), Identity("alice")) != derive_salt(SECRET, Identity("alice"))
    assert derive_salt(SECRET, Identity("alice")) == derive_salt(SECRET, Identity("alice"))


def test_salt_bad_input():
    with pytest.raises(ValueError, match="at least 16 bytes"):
        derive_salt(b"short", Identity("alice"))
    with pytest.raises(ValueError, match="has no user"):
        derive_salt(SECRET, Identity("alice"), "user")
    with pytest.raises(ValueError, match="'team'"):
        derive_salt(SECRET, Identity("alice"), "team")
    with pytest.raises(TypeError, match="Identity"):
        derive_salt(SECRET, "alice")


def test_identities_come_from_the_keys_file(tmp_path):
    assert parse_identity("acme/bob") == Identity("acme", "bob")
    assert parse_identity("acme") == Identity("acme", None)
    for bad in ("/bob", "acme/"):
        with pytest.raises(ValueError, match="tenant/user"):
            parse_identity(bad)
    keys = GatewayKeys(ApiKeys({"sk-1": "acme/bob", "sk-2": "acme/eve", "sk-3": "zeta"}))
    assert keys.resolve("Bearer sk-1") == Identity("acme", "bob")
    assert keys.resolve("Bearer sk-9") is None and keys.resolve(None) is None
    assert keys.tenants == ("acme", "zeta")
    with pytest.raises(ValueError, match="'zeta' has no user"):
        GatewayKeys(ApiKeys({"sk-1": "acme/bob", "sk-3": "zeta"}), "user")


def test_keys_file_uses_serves_strict_loader(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"sk-a": "alice", "sk-a": "mallory"}')
    with pytest.raises(ValueError, match="repeats the key of entry 1"):
        load_gateway_keys(path)
    path.write_text(json.dumps({"sk-a": "alice", "sk-b": "bob"}))
    assert load_gateway_keys(path).tenants == ("alice", "bob")


def test_routing_is_stable_per_salt_and_keyed_by_it():
    ups = [f"http://10.0.0.{i}:8000/v1" for i in range(4)]
    r = SaltAwareRouter(ups, prefix_tokens=4)
    head = [5, 6, 7, 8, 99]
    assert r.route("salt-a", head) == r.route("salt-a", head[:4] + [1])   # only the head counts
    # The same prompt head under different salts lands on different upstreams for some salts
    # (with 4 upstreams, 32 salts all on one upstream has probability 4**-31).
    assert len({r.route(f"salt-{i}", head) for i in range(32)}) > 1
    # No state: what others routed before cannot change my route.
    before = r.route("victim", head)
    for i in range(100):
        r.route(f"other-{i}", head)
    assert r.route("victim", head) == before


def test_routing_moves_only_the_keys_of_a_removed_upstream():
    ups = [f"http://u{i}/v1" for i in range(4)]
    full, less = SaltAwareRouter(ups), SaltAwareRouter(ups[:3])
    for i in range(200):
        salt = f"s{i}"
        if full.route(salt, [i]) != ups[3]:
            assert less.route(salt, [i]) == full.route(salt, [i])


def test_routing_refuses_unsalted_requests_and_bad_config():
    with pytest.raises(ValueError, match="unsalted"):
        SaltAwareRouter(["http://a/v1"]).route("", [1])
    with pytest.raises(ValueError, match="distinct"):
        SaltAwareRouter(["http://a/v1", "http://a/v1"])
    with pytest.raises(ValueError, match="at least one"):
        SaltAwareRouter([])


def test_block_size_inference_from_probe_counts():
    assert infer_block_size({473: 384, 489: 384}) == 128      # vLLM's CPU build
    assert infer_block_size({473: 464, 489: 480}) == 16       # minikv's default
    assert infer_block_size({473: 448, 489: 480}) == 32
    assert infer_block_size({473: 0, 489: 0}) is None          # nothing cached: cannot tell


def test_serve_client_salt_domains():
    assert salted_domain("alice", None) == "alice"
    a = salted_domain("alice", "s1")
    assert a.startswith("alice#salt-") and "s1" not in a[len("alice"):]    # only a hash of the salt
    assert a == salted_domain("alice", "s1") != salted_domain("alice", "s2")
    # the same salt under another tenant is another domain: a salt narrows, never widens
    assert salted_domain("bob", "s1") != a
    assert salted_domain("ab", "c") != salted_domain("a", "bc")
    assert client_salt({}) is None and client_salt({"cache_salt": "x"}) == "x"
    for bad in ("", 7, ["x"]):
        with pytest.raises(APIError, match="non-empty string"):
            client_salt({"cache_salt": bad})
    with pytest.raises(APIError, match="at most"):
        client_salt({"cache_salt": "x" * 5000})
    with pytest.raises(ValueError, match="^--api-keys: tenant name 'eve#salt-0123'.* reserves"):
        check_tenant_names(api_keys=["alice", "eve#salt-0123"])


def test_tokenizer_follows_the_upstream_model():
    import argparse

    from minikv.gateway.cli import tokenizer_name
    auto = argparse.Namespace(tokenizer="auto")
    assert tokenizer_name(auto, ["smollm2-135m-instruct", "smollm2-135m-instruct"]) == "smollm2-135m-instruct"
    with pytest.raises(ValueError, match="different models"):
        tokenizer_name(auto, ["smollm2-135m-instruct", "tiny-random"])
    assert tokenizer_name(argparse.Namespace(tokenizer="/models/x"), ["a", "b"]) == "/models/x"
