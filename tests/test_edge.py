"""minikv.edge: engines sharing weights, routers, churn, fleet governance, prime-and-probe."""
from __future__ import annotations

import random
import warnings

import pytest

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.edge import (EdgeFleet, EdgeInstance, PrefixAffinityRouter, RoundRobinRouter,
                         bracket_verdict, merge_trails, prime_and_probe, shared_weights_engine)

SECRET = b"test operator secret, 32 bytes.."


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls on a shared CPU run far faster single-threaded; restored afterwards."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def donor(tiny_path):
    return LLM(str(tiny_path), num_blocks=4)


def tokens(seed: int, n: int, vocab: int = 259) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


# ----------------------------------------------------------------------------- weight sharing
def test_engines_share_weight_storage_not_pools(donor):
    a = shared_weights_engine(donor, enable_prefix_caching=True, num_blocks=16)
    b = shared_weights_engine(donor, enable_prefix_caching=True, num_blocks=24)
    d = donor.engine
    assert a.model is d.model and b.model is d.model
    assert a.tokenizer is d.tokenizer and a.hf_config is d.hf_config
    for eng in (a, b):
        assert eng.model.embed.data_ptr() == d.model.embed.data_ptr()
        assert eng.model.layers[0].qkv.data_ptr() == d.model.layers[0].qkv.data_ptr()
    assert a.pool.k_cache.data_ptr() != b.pool.k_cache.data_ptr()
    assert (a.num_blocks, b.num_blocks) == (16, 24)
    assert a.block_manager is not b.block_manager


def test_shared_engine_generates_like_its_donor(donor):
    eng = shared_weights_engine(donor, num_blocks=16)
    inst = EdgeInstance("x", eng)
    params = SamplingParams(max_tokens=5, temperature=0.0)
    prompt = tokens(1, 20)
    out, ttft = inst.run("a", prompt, params)
    ref = donor.generate([prompt], params)[0]
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert ttft > 0 and inst.served == 1


def test_shared_engine_rejects_model_override_and_drops_audit_log(donor, tmp_path):
    with pytest.raises(ValueError, match="model"):
        shared_weights_engine(donor, model="tiny-random")
    audited = shared_weights_engine(donor, audit_log=str(tmp_path / "a.jsonl"))
    child = shared_weights_engine(audited)  # must not append to the parent's trail
    assert audited.audit is not None and child.audit is None
    audited.audit.close()


# ----------------------------------------------------------------------------- routers
def test_prefix_affinity_is_deterministic():
    def decisions():
        r = PrefixAffinityRouter(3, block_size=16)
        out = []
        for i in range(12):
            head = tokens(i % 4, 16)
            out.append(r.route(head + tokens(100 + i, 5), tenant=f"t{i % 2}"))
        return out

    first, second = decisions(), decisions()
    assert first == second
    # the same first block always goes to the same instance, whatever follows it
    slots = {}
    for i, (slot, _) in enumerate(first):
        slots.setdefault(i % 4, set()).add(slot)
    assert all(len(s) == 1 for s in slots.values())
    assert [d for _, d in first[:4]] == ["fallback"] * 4
    assert all(d == "affinity" for _, d in first[4:])


def test_tenant_aware_router_separates_tenants():
    blind, aware = PrefixAffinityRouter(3), PrefixAffinityRouter(3, tenant_aware=True)
    p = tokens(7, 40)
    assert blind.key(p, "alice") == blind.key(p, "bob")
    assert aware.key(p, "alice") != aware.key(p, "bob")
    aware.route(p, "alice")
    assert aware.route(p, "bob")[1] == "fallback"
    assert aware.route(p, "alice")[1] == "affinity"


def test_router_forget_and_round_robin():
    r = PrefixAffinityRouter(2)
    p = tokens(3, 20)
    slot, _ = r.route(p)
    r.forget(slot)
    assert r.route(p)[1] == "fallback"
    rr = RoundRobinRouter(3)
    assert [rr.route(p)[0] for _ in range(5)] == [0, 1, 2, 0, 1]


def test_bracket_verdict_reads_the_fallback_pointer():
    r = PrefixAffinityRouter(3)
    victim = tokens(5, 40)
    r.route(victim, "acme")
    c1, _ = r.route(tokens(90, 8), "mallory")
    r.route(victim, "mallory")                       # recently sent by acme: affinity
    c2, _ = r.route(tokens(91, 8), "mallory")
    assert bracket_verdict(c1, c2, 3) == "seen recently"
    c1, _ = r.route(tokens(92, 8), "mallory")
    r.route(tokens(6, 40), "mallory")                # never sent: consumes a fallback decision
    c2, _ = r.route(tokens(93, 8), "mallory")
    assert bracket_verdict(c1, c2, 3) == "not seen"


# ----------------------------------------------------------------------------- keys across instances
def test_tenant_keys_identical_across_instances_with_shared_secret(donor):
    shared = EdgeFleet(donor, 3, "prefix", enable_prefix_caching=True, num_blocks=16, engine_secret=SECRET)
    separate = EdgeFleet(donor, 3, "prefix", enable_prefix_caching=True, num_blocks=16)
    e = [i.engine for i in shared.instances]
    assert e[0].tenant_key("alice") == e[1].tenant_key("alice") == e[2].tenant_key("alice")
    assert e[0].tenant_key("alice") != e[2].tenant_key("bob")
    s = [i.engine for i in separate.instances]
    assert s[0].tenant_key("alice") != s[1].tenant_key("alice")
    block = tuple(tokens(8, 16))
    h = lambda eng, t: eng.block_manager.hasher(None, block, (), eng.tenant_key(t))  # noqa: E731
    assert h(e[0], "alice") == h(e[2], "alice")
    # isolation across instances, both directions: no tenant's key matches another's anywhere
    for x in e:
        for y in e:
            assert h(x, "alice") != h(y, "bob") and h(x, "bob") != h(y, "alice")


def test_isolation_holds_on_every_instance_in_both_directions(donor):
    fleet = EdgeFleet(donor, 3, "prefix", enable_prefix_caching=True, num_blocks=32, engine_secret=SECRET)
    for i, inst in enumerate(fleet.instances):
        for j, (first, second, expect_hit) in enumerate(
                [("alice", "bob", False), ("bob", "alice", False), ("alice", "alice", True)]):
            prefix = tokens(1000 + 10 * i + j, 32)
            inst.run(f"{i}-{j}-a", prefix + [3], tenant=first)
            out, _ = inst.run(f"{i}-{j}-b", prefix + [4], tenant=second)
            assert (out.num_cached_tokens == 32) if expect_hit else (out.num_cached_tokens == 0), (i, first, second)
    # through the (tenant-blind) router too: bob lands on alice's instance and still misses
    p = tokens(77, 40)
    a = fleet.submit(p, tenant="alice")
    b = fleet.submit(p, tenant="bob")
    assert b.slot == a.slot and b.route == "affinity" and b.num_cached_tokens == 0
    assert fleet.submit(p, tenant="alice").num_cached_tokens == 32


# ----------------------------------------------------------------------------- lifecycle
def test_shutdown_scrubs_the_whole_pool(donor, tmp_path):
    fleet = EdgeFleet(donor, 2, "prefix", enable_prefix_caching=True, num_blocks=16,
                      engine_secret=SECRET, audit_dir=tmp_path)
    for k in range(4):
        fleet.submit(tokens(k, 40), tenant="alice")
    inst = fleet.instances[0]
    assert inst.pool_nonzero_blocks() > 0
    assert inst.shutdown() == 16
    assert inst.pool_nonzero_blocks() == 0
    assert not inst.engine.pool.k_cache.any() and not inst.engine.pool.v_cache.any()
    with pytest.raises(RuntimeError, match="shut down"):
        inst.run("late", tokens(1, 10))
    scrubs = [e for e in merge_trails(fleet.audit_paths) if e.get("hook") == "shutdown"]
    assert len(scrubs) == 16 and {e["instance"] for e in scrubs} == {"edge-0-g0"}
    assert inst.shutdown() == 0  # idempotent


def test_restart_scrubs_and_churn_resets_hits(donor):
    prompt = tokens(11, 48)
    # 32 blocks: the default quota (1/8 of the pool = 4 blocks) holds the 3-block prompt
    steady = EdgeFleet(donor, 1, "prefix", enable_prefix_caching=True, num_blocks=32, engine_secret=SECRET)
    hits = [steady.submit(prompt + [3 + k], tenant="a").num_cached_tokens for k in range(4)]
    assert hits == [0, 48, 48, 48]

    churned = EdgeFleet(donor, 1, "prefix", restart_every=1, enable_prefix_caching=True, num_blocks=16,
                        engine_secret=SECRET)
    old = churned.instances[0]
    hits = [churned.submit(prompt + [3 + k], tenant="a").num_cached_tokens for k in range(4)]
    assert hits == [0, 0, 0, 0]
    assert churned.restarts == 4 and churned.instances[0].generation == 4
    assert not old.alive and old.pool_nonzero_blocks() == 0
    assert churned.hit_rate() == 0.0 and steady.hit_rate() > 0.5


# ----------------------------------------------------------------------------- audit across nodes
def test_merged_trails_need_one_secret_to_show_spread_probing(donor, tmp_path):
    doc = tokens(21, 40)
    probes = [doc[:32] + tokens(200 + k, 5) for k in range(12)]

    def run(sub, **kw):
        fleet = EdgeFleet(donor, 3, "round-robin", enable_prefix_caching=True, num_blocks=32,
                          audit_dir=tmp_path / sub, **kw)
        fleet.submit(doc, tenant="acme")
        for p in probes:
            fleet.submit(p, tenant="mallory")
        fleet.shutdown()
        return fleet

    separate, shared = run("sep"), run("shared", engine_secret=SECRET)
    assert separate.detect() == []
    kinds = [f.kind for f in shared.detect()]
    assert kinds == ["probing"]
    ids = [e["request_id"] for e in shared.merged_trail() if e["event"] in ("request", "summary")]
    assert len(ids) == len(set(ids)) == 13  # request ids are unique across instances
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        drift = run("drift", engine_secret=SECRET, instance_overrides={0: {"cache_isolation": "shared"}})
    assert sorted(f.kind for f in drift.detect()) == ["cross_tenant_hit", "probing"]


# ----------------------------------------------------------------------------- prime and probe
def test_quota_closes_prime_and_probe(donor):
    sizes = dict(num_blocks=24, attacker_blocks=8, victim_blocks=2)
    full = 8 * 16
    off = dict(sizes, quota="unlimited")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        assert prime_and_probe(donor, 0, **off) == full
        without = [prime_and_probe(donor, v, **off) for v in (4, 10, 14)]
    with_quota = [prime_and_probe(donor, v, quota=8, **sizes) for v in (4, 10, 14)]
    assert without[0] == full and without[-1] < full and without[-1] == 0
    assert without == sorted(without, reverse=True)
    assert with_quota == [full] * 3
    # The default quota (24 // 8 = 3 blocks) keeps only 3 of the attacker's 8 primed blocks, and
    # the victim's load takes none of them: the probe reads the same whatever the victim did.
    assert {prime_and_probe(donor, v, **sizes) for v in (0, 4, 10, 14)} == {3 * 16}


def test_fleet_validates_arguments(donor):
    with pytest.raises(ValueError):
        EdgeFleet(donor, 2, restart_every=0)
    with pytest.raises(TypeError):
        EdgeFleet(object(), 2)
    with pytest.raises(ValueError):
        PrefixAffinityRouter(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        fleet = EdgeFleet(donor, 1, instance_overrides={0: {"cache_isolation": "shared"}}, num_blocks=8)
    assert fleet.instances[0].engine.config.cache_isolation == "shared"
