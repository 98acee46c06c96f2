"""KV tiers shared by tenants: quotas per API-key tenant, a stalled store, writers in the trail.

* A tenant's quota in a shared store is counted per API-key tenant: salted domains
  (``--trust-client-salt``) are its own, and buy no room (Redis).
* A flood displaces only the flooder's blocks, in a Redis under ``maxmemory`` whichever the
  eviction policy, and a write Redis refuses is not charged (Redis).
* A stalled store is called off the step thread, within its deadline: the step waits for it at most
  once, requests finish (recomputed), and no tier call runs on the step thread (a fake store that
  blocks on an event: no Redis, no clock).
* A block's writer travels inside its sealed value, so a cross-tenant tier hit under UNSAFE
  content keys is flagged by ``minikv audit detect`` on the reading instance's own trail, and
  tenant keys show none (an in-process shared store; the same on Redis).
"""
from __future__ import annotations

import threading
import warnings

import pytest

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.audit.detector import detect, load_trail
from minikv.cli import main as cli_main
from minikv.serve.client_salt import salted_domain
from minikv.tiers import HostTier

P = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
SECRET = b"t" * 32
VICTIM = list(range(10, 30))  # 20 byte tokens, blocks of 4: 5 stored, 4 can be hit


def engine(tiers, quiet=True, **kw) -> LLM:
    base = dict(device="cpu", dtype="float32", num_blocks=32, block_size=4, enable_prefix_caching=True,
                kv_tiers=tiers, engine_secret=SECRET)
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore", UnsafeSettingWarning)
        return LLM("tiny-random", **(base | kw))


def send(llm, tenant, prompt=VICTIM):
    return llm.generate([prompt], P, tenant=tenant)[0]


# ---------------------------------------------------------------- a stalled store
class StalledStore:
    """A blocking tier that answers nothing until ``go`` is set; it records the threads calling it."""

    name, when, blocking, deadline = "stalled", "store", True, 0.05

    def __init__(self):
        self.go, self.threads, self.calls = threading.Event(), set(), 0
        self.stats = {}

    def _wait(self):
        self.threads.add(threading.current_thread())
        self.calls += 1
        self.go.wait(timeout=20)  # bounded, so a store called on the step thread fails the test, not hangs

    def get(self, key):
        self._wait()
        return None

    def put(self, key, value, tenant_tag):
        self._wait()
        return True

    def evict(self, key):
        self._wait()


def test_a_stalled_store_costs_a_step_at_most_one_deadline_and_never_runs_on_the_step_thread():
    store = StalledStore()
    llm = engine(["host", store])
    reference = send(engine([]), "alice").outputs[0].token_ids
    eng = llm.engine
    eng.add_request("bob", list(range(60, 64)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    tenant="bob")
    eng.step()  # bob decodes from here on; alice's requests arrive while the store is stalled
    lates, done = [], {}
    for n in range(3):
        eng.add_request(f"alice-{n}", VICTIM, P, tenant="alice")
    while eng.has_unfinished_requests():
        before = store.stats["late"]
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        lates.append(store.stats["late"] - before)
    try:
        assert threading.main_thread() not in store.threads and store.threads
        assert max(lates) <= 1  # one deadline per step at most, however many blocks it stores or looks up
        assert store.stats["skipped"] >= 1  # later calls did not wait behind the stuck one
        assert all(done[f"alice-{n}"].outputs[0].token_ids == reference for n in range(3))  # recomputed
        assert len(done["bob"].outputs[0].token_ids) == 12
    finally:
        store.go.set()
        llm.engine.tiers.wait()


# ---------------------------------------------------------------- the writer, in the trail
def _fleet(tmp_path, keys, store):
    a = engine(["host", store], kv_tier_keys=keys, audit_log=str(tmp_path / f"a-{keys}.jsonl"))
    b = engine(["host", store], kv_tier_keys=keys, audit_log=str(tmp_path / f"b-{keys}.jsonl"))
    return a, b


def _cross(findings):
    return [(f.tenant, f.detail) for f in findings if f.kind == "cross_tenant_hit"]


@pytest.mark.parametrize("writer,reader", [("alice", "mallory"), ("mallory", "alice")])
def test_a_cross_tenant_tier_hit_under_content_keys_is_flagged_on_the_readers_trail(tmp_path, writer, reader):
    store = HostTier(1 << 20, name="store", when="store")
    a, b = _fleet(tmp_path, "content", store)
    send(a, writer)
    leaked = send(b, reader)
    assert leaked.num_cached_tokens == 16  # the UNSAFE setting leaks (tests/test_kv_tiers_redis.py)
    b.engine.audit.flush()
    cross = _cross(detect(load_trail(tmp_path / "b-content.jsonl")))
    assert len(cross) == 1 and cross[0][0] == reader and "tier-writer:" in cross[0][1], cross
    assert _cross(detect(load_trail(tmp_path / "a-content.jsonl"))) == []


def test_under_tenant_keys_the_same_fleet_shows_no_cross_tenant_hit_and_names_its_own_writer(tmp_path):
    store = HostTier(1 << 20, name="store", when="store")
    a, b = _fleet(tmp_path, "tenant", store)
    send(a, "alice")
    assert send(b, "mallory").num_cached_tokens == 0
    assert send(b, "alice").num_cached_tokens == 16  # the same tenant hits on the other instance
    onloaded = [blk for blk in b.engine.block_manager.blocks if blk.hash is not None and blk.writer_tenant == "alice"]
    assert len(onloaded) >= 4  # recorded as alice's: the writer came with the value
    for trail in ("a-tenant.jsonl", "b-tenant.jsonl"):
        assert _cross(detect(load_trail(tmp_path / trail))) == []


def test_a_tier_hit_on_the_same_instance_names_the_tenant_who_wrote_it(tmp_path):
    store = HostTier(1 << 20, name="store", when="store")
    llm = engine([store], kv_tier_keys="content", num_blocks=12, max_cached_blocks_per_tenant=12,
                 audit_log=str(tmp_path / "one.jsonl"))
    send(llm, "alice")
    send(llm, "flood", list(range(100, 144)))  # evicts alice's blocks from the pool
    assert send(llm, "bob").num_cached_tokens == 16
    llm.engine.audit.flush()
    cross = _cross(detect(load_trail(tmp_path / "one.jsonl")))
    assert [c[0] for c in cross] == ["bob"] and "'alice'" in cross[0][1], cross


# ---------------------------------------------------------------- a flood in a full host tier
def test_a_full_host_tier_evicts_the_biggest_holder_first():
    h = HostTier(10 * 8)  # room for ten 8-byte values
    for i in range(3):
        assert h.put(b"alice%d" % i, b"a" * 8, "tag-alice")
    for i in range(50):  # a flood: many more values than the tier holds
        assert h.put(b"mallory%d" % i, b"m" * 8, "tag-mallory")
    assert all(h.get(b"alice%d" % i) == b"a" * 8 for i in range(3))  # alice's survive
    assert h.nbytes == 80 and len(h) == 10 and h.stats["dropped"] == 43
    assert h.get(b"mallory49") and not h.get(b"mallory42")  # mallory loses her own oldest
    h.put(b"mallory50", b"m" * 8, "tag-mallory")
    assert h.get(b"mallory43") is None and h.get(b"alice0")  # ... still her own, one at a time
    h.evict(b"alice1")
    assert h.nbytes == 72 and h.get(b"alice1") is None
    for i in range(20):  # once alice holds the most, she is the one who pays
        h.put(b"alice-more%d" % i, b"a" * 8, "tag-alice")
    assert h.get(b"mallory50") and sum(h.get(b"mallory%d" % i) is not None for i in range(51)) == 5


def test_another_instances_flood_through_a_shared_store_leaves_alices_blocks():
    store = HostTier(1 << 20, name="store", when="store")
    a, b = engine(["host", store]), engine(["host", store])
    send(a, "alice")
    store.capacity = 12 * (store.nbytes // len(store))  # room for alice's 5 blocks and 7 more
    for i in range(6):  # mallory floods from the other instance, 5 fresh blocks a request
        send(b, "mallory", list(range(40 + 20 * i, 60 + 20 * i)))
    assert store.stats["dropped"] >= 18
    c = engine(["host", store])  # a third instance: every hit it gets comes from the store
    assert send(c, "alice").num_cached_tokens == 16  # alice's blocks survived the flood
    assert send(c, "mallory", list(range(140, 160))).num_cached_tokens == 16  # mallory keeps her newest...
    assert send(c, "mallory", list(range(40, 60))).num_cached_tokens == 0  # ...and lost her own oldest


# ---------------------------------------------------------------- bad tier specs
BAD = ["host?mib=inf", "host?mib=1e30", "host?mib=nan", "host?mib=0", "redis://127.0.0.1:6390/0?budget_mib=inf",
       "redis://127.0.0.1:6390/99", "redis://127.0.0.1:6390/abc", "redis://127.0.0.1:99999/0",
       "redis://127.0.0.1:6390/0?ttl=inf", "redis://127.0.0.1:6390/0?deadline_ms=0", "redis:///0"]


@pytest.mark.parametrize("spec", BAD)
def test_a_bad_tier_spec_is_refused_naming_the_value_and_the_flag(spec):
    with pytest.raises(ValueError, match=r"--kv-tier") as err:
        engine([spec])
    bad = spec.split("=")[-1] if "?" in spec else spec.rsplit("/", 1)[-1].split(":")[-1]
    assert bad in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("spec", ["host?mib=inf", "redis://127.0.0.1:6390/99"])
def test_the_cli_answers_a_bad_tier_spec_with_one_line(spec, capsys):
    rc = cli_main(["generate", "--model", "tiny-random", "--device", "cpu", "--kv-tier", spec, "hi"])
    err = capsys.readouterr().err.strip()
    assert rc == 1 and len(err.splitlines()) == 1 and spec in err and "--kv-tier" in err, err


# ---------------------------------------------------------------- Redis: quotas per tenant
redis = pytest.mark.redis
VALUE = 5 + 12 + 12 + 2 * 4 * 2 * 2 * 16 * 4 + 16  # header, nonce, writer, one block, GCM tag


@pytest.fixture
def store(redis_base):
    from redis_helpers import fresh_db
    client = fresh_db(redis_base, 4)  # this module's database
    policy = client.config_get("maxmemory-policy")["maxmemory-policy"]
    limit = client.config_get("maxmemory")["maxmemory"]
    yield f"{redis_base}/4", client
    client.config_set("maxmemory", limit)
    client.config_set("maxmemory-policy", policy)
    client.flushdb()


def _values(client):
    return sorted(client.keys(b"minikv/kv/v2/*"))


@redis
def test_rotating_salts_share_their_tenants_quota(store):
    url, client = store
    a = engine([url + f"?budget_mib={2.5 * VALUE / 2**20}"])
    for n in range(3):
        send(a, salted_domain("mallory", f"salt-{n}"))
    tier = a.engine.tiers.tiers[0]
    assert tier.stats["puts"] == 15 and len(_values(client)) == 2  # one quota of 2 blocks, not three
    assert tier.used(a.engine.tiers.sealer.tenant_tag("mallory")) == 2 * VALUE
    send(a, "alice")
    assert len(_values(client)) == 4  # alice's room was never mallory's


def _long(seed: int) -> list[int]:
    return [10 + (seed * 31 + i * 7) % 200 for i in range(321)]  # 5 full blocks of 64


@redis
@pytest.mark.parametrize("policy", ["allkeys-lru", "noeviction"])
def test_a_flood_under_maxmemory_leaves_another_tenants_blocks(store, policy):
    url, client = store
    block = 2 * 64 * 2 * 2 * 16 * 4  # 32 KiB of K/V per block of 64 tokens
    a = engine([url + f"?budget_mib={12 * block / 2**20}"], block_size=64)
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory-policy", policy)
    client.config_set("maxmemory", used + (1 << 20))  # room for 2 tenants' quotas (~0.8 MiB), not a flood (1.3 MiB)
    send(a, "alice", _long(0))
    for n in range(8):  # mallory's rotating salts, 40 blocks
        send(a, salted_domain("mallory", f"salt-{n}"), _long(100 + n))
    send(a, "alice", _long(1))  # alice can still store...
    b = a.fork()
    for p in (_long(0), _long(1)):  # ...and every block she stored is still there, on another instance
        assert send(b, "alice", p).num_cached_tokens == 320, a.engine.tiers.tiers[0].stats
    assert a.engine.tiers.tiers[0].stats["displaced"] > 0  # mallory's flood displaced her own blocks


@redis
def test_a_write_redis_refuses_is_not_charged(store):
    url, client = store
    a = engine([url])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 1024)  # under one value
    send(a, "alice")
    tier = a.engine.tiers.tiers[0]
    stored = len(_values(client))
    assert tier.stats["refused_store"] >= 1 and stored < 5
    assert tier.used(a.engine.tiers.sealer.tenant_tag("alice")) == stored * VALUE


@redis
def test_two_instances_on_one_redis_under_content_keys_flag_the_cross_tenant_hits(store, tmp_path, capsys):
    url, _ = store
    a = engine([url], kv_tier_keys="content", audit_log=str(tmp_path / "a.jsonl"))
    b = engine([url], kv_tier_keys="content", audit_log=str(tmp_path / "b.jsonl"))
    send(a, "alice")
    assert send(b, "mallory").num_cached_tokens == 16
    b.engine.audit.flush()
    assert cli_main(["audit", "detect", str(tmp_path / "b.jsonl")]) == 0
    out = capsys.readouterr().out
    assert "cross_tenant_hit" in out and "mallory" in out and "tier-writer:" in out, out
    t = engine([url], audit_log=str(tmp_path / "t.jsonl"))  # tenant keys: the same probe hits nothing
    send(engine([url]), "alice")
    assert send(t, "mallory").num_cached_tokens == 0
    t.engine.audit.flush()
    assert _cross(detect(load_trail(tmp_path / "t.jsonl"))) == []
