"""The Redis tier on a real Redis: two engines sharing it, its isolation, integrity and secrecy.

"Instance A" and "instance B" are two engines (a fork: its own pool, scheduler, tier objects and
Redis connection, the same weights) sharing one Redis database and one operator secret, as two
``minikv serve --kv-tier redis://... --engine-secret-file F`` processes would
(tests/test_kv_tiers_serve.py runs exactly that).  Every test starts from an empty database.
"""
from __future__ import annotations

import re
import warnings

import pytest

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.attacks.kv_inversion import layer0_kv_table
from minikv.attacks.tier_dump import dump_store, tokens_in_dump

pytestmark = pytest.mark.redis

P = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
SECRET = b"s" * 32
VICTIM = list(range(10, 30))  # 20 byte tokens: 5 full blocks are stored; 4 can be hit (the last token is computed)
DB = 1  # this module's Redis database (test_kv_tiers_serve.py uses another)


@pytest.fixture
def store(redis_base):
    from redis_helpers import fresh_db
    client = fresh_db(redis_base, DB)
    yield f"{redis_base}/{DB}", client
    client.flushdb()


def instance(url, quiet=True, **kw) -> LLM:
    base = dict(device="cpu", dtype="float32", num_blocks=32, block_size=4, enable_prefix_caching=True,
                kv_tiers=[url], engine_secret=SECRET)
    with warnings.catch_warnings():
        if quiet:  # the UNSAFE cases are asserted where set
            warnings.simplefilter("ignore", UnsafeSettingWarning)
        return LLM("tiny-random", **(base | kw))


def pair(url, **kw):
    a = instance(url, **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        return a, a.fork()


def send(llm, tenant, prompt=VICTIM):
    return llm.generate([prompt], P, tenant=tenant)[0]


@pytest.mark.parametrize("writer,other", [("alice", "bob"), ("bob", "alice")])
def test_a_tenant_hits_its_own_blocks_on_another_instance_and_nobody_elses(store, writer, other):
    url, _ = store
    a, b = pair(url)
    first = send(a, writer)
    assert a.engine.tiers.tiers[0].stats["puts"] == 5  # stored as soon as full (the Redis tier's "store")
    stranger = send(b, other)
    assert stranger.num_cached_tokens == 0 and b.engine.tiers.stats["onloaded"] == 0
    same = send(b, writer)  # the same-tenant control: positive across instances
    assert same.num_cached_tokens == 16 and b.engine.stats["tier_tokens"] == 16
    assert same.outputs[0].token_ids == first.outputs[0].token_ids


def test_unsafe_content_keys_leak_across_instances_and_tenants(store):
    url, _ = store
    with pytest.warns(UnsafeSettingWarning, match="kv_tier_keys='content'"):
        instance(url, quiet=False, kv_tier_keys="content")
    a, b = pair(url, kv_tier_keys="content")
    send(a, "alice")
    leaked = send(b, "mallory")  # B's pool is tenant-keyed; the shared store is not
    assert leaked.num_cached_tokens == 16 and b.engine.tiers.stats["onloaded"] == 4
    bob_keyed = b.engine.block_manager.hash_table  # mallory's blocks in B's pool: under mallory's key
    assert not set(bob_keyed) & set(a.engine.block_manager.hash_table)
    assert send(a, "mallory").num_cached_tokens == 16  # and the other direction: A serves B's copy too


def _keys(client):
    return sorted(k for k in client.keys(b"minikv/kv/v2/*"))


@pytest.mark.parametrize("encrypt", [True, False], ids=["sealed", "cleartext"])  # cleartext: the MAC alone
@pytest.mark.parametrize("attack", ["outside write", "bit flip", "swap", "other model", "other dtype"])
def test_a_bad_value_in_redis_is_refused_and_recomputed(store, attack, encrypt):
    url, client = store
    a, b = pair(url, kv_tier_encrypt=encrypt)
    reference = send(a, "alice").outputs[0].token_ids
    keys = _keys(client)
    assert len(keys) == 5
    values = [client.get(k) for k in keys]  # every value is hit, so block 0's is bad whichever it is
    if attack == "outside write":  # someone with write access but without the operator secret
        for k in keys:
            client.set(k, b"MKV2" + bytes([encrypt]) + bytes(range(256)) * 8)
    elif attack == "bit flip":
        for k, v in zip(keys, values):
            v = bytearray(v)
            v[len(v) // 2] ^= 0x10
            client.set(k, bytes(v))
    elif attack == "swap":  # genuine values, each under another block's key
        for k, v in zip(keys, values[1:] + values[:1]):
            client.set(k, v)
    else:  # another model's (or dtype's) genuine values, filed under this model's names
        client.flushdb()
        if attack == "other model":
            other = a.fork()  # same geometry and dtype; only the weights' fingerprint it seals with differs
            other.engine.tiers.model = "f" * 64
        else:  # a bfloat16 instance of the same model shares the store and the secret
            other = instance(url, dtype="bfloat16", kv_tier_encrypt=encrypt)
        send(other, "alice")
        theirs, ours = other.engine.tiers.space, a.engine.tiers.space
        assert theirs != ours  # left alone, they would sit in a space of their own (see below)
        for k in _keys(client):  # a store writer, or a fleet tool copying between spaces, relabels them
            client.rename(k, k.replace(theirs, ours))
    assert len(_keys(client)) == 5
    out = send(b, "alice")
    assert b.engine.tiers.stats["refused"] == 1 and b.engine.tiers.stats["onloaded"] == 0
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == reference


def test_models_and_dtypes_share_one_store_without_touching_each_others_values(store):
    """A mixed fleet: fp32 and bf16 engines of one model on one Redis.  Each files its blocks in its
    own space (model fingerprint, dtype, geometry), so neither looks up, refuses or deletes the
    other's, and each one's second instance hits its own kind."""
    url, client = store
    a32, a16 = instance(url), instance(url, dtype="bfloat16")
    send(a32, "alice")
    send(a16, "alice")
    keys = _keys(client)
    assert len(keys) == 10 and len({k.split(b"/")[3] for k in keys}) == 2
    for llm in (a32, a16):
        b = llm.fork()
        assert send(b, "alice").num_cached_tokens == 16
        assert b.engine.tiers.stats["refused"] == 0 and b.engine.tiers.stats["onloaded"] == 4
    assert _keys(client) == keys  # nothing refused, so nothing dropped


def test_a_dump_of_redis_holds_no_kv_the_inversion_can_read(store):
    url, client = store
    a = instance(url)
    table = layer0_kv_table(a.engine.model)
    geometry = a.engine.tiers.geometry
    send(a, "alice")
    sealed = dump_store(client, b"minikv/kv/*")
    assert len(sealed) == 5 and tokens_in_dump(sealed, geometry, a.engine.pool.dtype, table) == set()
    client.flushdb()
    with pytest.warns(UnsafeSettingWarning, match="kv_tier_encrypt=False"):
        clear = instance(url, quiet=False, kv_tier_encrypt=False)
    send(clear, "alice")
    recovered = tokens_in_dump(dump_store(client, b"minikv/kv/*"), geometry, clear.engine.pool.dtype, table)
    assert recovered == set(VICTIM)  # every prompt token, read off the dump


def test_keys_name_no_tokens_or_tenants_and_values_expire(store):
    url, client = store
    a = instance(url + "?ttl=120")
    send(a, "alice")
    keys = client.keys(b"*")
    kv = [k for k in keys if k.startswith(b"minikv/kv/v2/")]
    space = a.engine.tiers.space
    assert len(kv) == 5 and all(re.fullmatch(rb"minikv/kv/v2/" + space + rb"/[0-9a-f]{64}", k) for k in kv)
    assert not any(b"alice" in k for k in keys)  # the budget counter is under an opaque tag
    assert all(0 < client.ttl(k) <= 120 for k in keys)


def test_a_tenant_over_its_quota_displaces_its_own_oldest_blocks_never_another_tenants(store):
    url, client = store
    value = 5 + 12 + 12 + 2 * 4 * 2 * 2 * 16 * 4 + 16  # header, nonce, writer, one block, GCM tag (the MAC)
    a = instance(url + f"?budget_mib={2.5 * value / 2**20}")
    send(a, "bob", list(range(40, 60)))  # 5 blocks; the quota holds 2
    redis_tier = a.engine.tiers.tiers[0]
    bob_tag = a.engine.tiers.sealer.tenant_tag("bob")
    bob_keys = set(client.zrange(f"minikv/quota/v1/{bob_tag}/keys", 0, -1))
    assert redis_tier.stats["puts"] == 5 and redis_tier.stats["displaced"] == 3 and len(bob_keys) == 2
    assert redis_tier.used(bob_tag) == 2 * value and len(_keys(client)) == 2
    send(a, "alice")  # alice, at her quota, displaces her own blocks only
    assert redis_tier.stats["puts"] == 10 and redis_tier.stats["displaced"] == 6
    assert bob_keys <= set(_keys(client)) and len(_keys(client)) == 4
    assert redis_tier.used(a.engine.tiers.sealer.tenant_tag("alice")) == 2 * value
