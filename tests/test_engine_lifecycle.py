"""The block lifecycle vocabulary (minikv/engine/lifecycle.py) and its one dispatch in the engine."""
from __future__ import annotations

import warnings

import pytest

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.engine import config
from minikv.engine.lifecycle import (LIFECYCLE, REUSE_RECORDS, REUSES, BlockIdentity, State, Transition, VerifyHits,
                                     crosses_tenants)
from minikv.security.hashing import HASHERS, UNSAFE_HASHES
from minikv.security.scrub import SCRUBBERS, ScrubOnFree

P = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


def test_the_table_names_every_transition_once():
    assert set(LIFECYCLE) == set(Transition)
    into_free = {t for t, e in LIFECYCLE.items() if e.target is State.FREE}
    out_of_free = {t for t, e in LIFECYCLE.items() if State.FREE in e.source}
    assert into_free == {Transition.FREE, Transition.EVICT}
    # An onload (KV tiers) leaves the free list too, without on_alloc: it overwrites every slot of the
    # block with verified K/V (minikv.tiers.link: TierLink.load), so nothing of the last owner survives to be scrubbed.
    assert out_of_free == {Transition.ALLOCATE, Transition.ONLOAD}
    # the two required hooks guard the free list; every other transition has an optional hook
    assert {LIFECYCLE[t].hook for t in into_free | {Transition.ALLOCATE}} == {"on_free", "on_alloc"}
    # + on_promote, on_isolate (selective sharing), on_offload, on_onload (KV tiers)
    assert len({e.hook for e in LIFECYCLE.values()}) == 9
    # an adoption is a hit found at commit: the same hook (a scrubber must treat both alike), its own record
    assert LIFECYCLE[Transition.ADOPT].hook == LIFECYCLE[Transition.HIT].hook == "on_hit"
    assert [LIFECYCLE[t].record for t in REUSES] == ["hit", "adopt"] and list(REUSE_RECORDS) == ["hit", "adopt"]
    assert [t for t, e in LIFECYCLE.items() if e.reach is None] == [Transition.CACHE]
    assert Transition.HIT == "hit" and f"{Transition.EVICT}" == "evict"


def test_crosses_tenants():
    assert crosses_tenants(("alice", "bob"), public=False)
    assert not crosses_tenants(("alice", "bob"), public=True)
    assert not crosses_tenants(("alice", "alice"), public=False)
    assert crosses_tenants((None, "alice"), public=False)  # the anonymous tenant is a tenant
    assert not crosses_tenants(("alice",), public=False)


def test_verify_hits_enum_at_the_config_door():
    assert [VerifyHits.of(v) for v in (True, "tokens", False)] == list(VerifyHits)
    assert [str(v) for v in VerifyHits] == ["True", "tokens", "False"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        cfg = config.EngineConfig(verify_hits="tokens")
    assert cfg.verify_hits is VerifyHits.TOKENS and cfg.unsafe_settings() == ["verify_hits='tokens'"]
    assert config.EngineConfig(verify_hits=VerifyHits.IDENTITY).verify_hits is VerifyHits.IDENTITY
    for bad in (1, 1.0, "yes", None):
        with pytest.raises(ValueError, match="verify_hits must be"):
            config.EngineConfig(verify_hits=bad)


def test_block_identity_admits():
    mine = BlockIdentity((1, 2), (3, 1), b"k")
    other_parent = BlockIdentity((1, 2), (3, 2), b"k")
    other_tokens = BlockIdentity((1, 9), (3, 1), b"k")
    assert mine.admits(mine, VerifyHits.IDENTITY) and not mine.admits(other_parent, VerifyHits.IDENTITY)
    assert mine.admits(other_parent, VerifyHits.TOKENS) and not mine.admits(other_tokens, VerifyHits.TOKENS)
    assert mine.admits(other_tokens, VerifyHits.NOTHING)


def test_config_lists_come_from_the_registries():
    assert config.HASH_ALGOS == tuple(HASHERS) and set(config.UNSAFE_HASH_ALGOS) == UNSAFE_HASHES
    assert config.SCRUB_POLICIES == tuple(SCRUBBERS)


class Spy(ScrubOnFree):
    """ScrubOnFree that also implements the optional hooks, recording every call."""

    def __init__(self):
        self.calls: list[tuple[str, tuple]] = []

    def on_free(self, pool, ids):
        self.calls.append(("on_free", tuple(ids)))
        super().on_free(pool, ids)

    def on_alloc(self, pool, ids):
        self.calls.append(("on_alloc", tuple(ids)))

    def on_hit(self, pool, ids):
        self.calls.append(("on_hit", tuple(ids)))

    def on_store(self, pool, ids):
        self.calls.append(("on_store", tuple(ids)))

    def on_cache(self, pool, ids):
        self.calls.append(("on_cache", tuple(ids)))


def test_one_dispatch_runs_the_tables_hook_for_every_transition():
    spy = Spy()
    llm = LLM("tiny-random", device="cpu", dtype="float32", block_size=4, num_blocks=16,
              enable_prefix_caching=True, scrubber=spy, audit_log=None)
    seen: list[tuple[str, tuple]] = []
    llm.engine.block_manager.listeners.append(lambda t, ids, seq: seen.append((t, tuple(ids))))
    prompt = list(range(10, 23))  # 13 tokens: 3 full blocks + 1
    llm.generate([prompt], P, tenant="a")
    llm.generate([prompt], P, tenant="a")  # hits the 3 cached blocks
    twin = list(range(40, 53))
    llm.generate([twin, twin], P, tenant="a")  # one step: the second adopts the first's 3 blocks at commit
    llm.engine.reset_prefix_cache()  # evicts them
    # promote and isolate happen only under cache_isolation="selective" (tests/test_selective*.py),
    # offload and onload only with kv_tiers (tests/test_kv_tiers.py checks their hooks the same way)
    assert {t for t, _ in seen} == set(Transition) - {Transition.PROMOTE, Transition.ISOLATE,
                                                      Transition.OFFLOAD, Transition.ONLOAD}
    assert [len(ids) for t, ids in seen if t == Transition.ADOPT] == [3]
    assert [(LIFECYCLE[Transition(t)].hook, ids) for t, ids in seen] == spy.calls


def test_snapshot_holders_come_from_the_running_sequences():
    llm = LLM("tiny-random", device="cpu", dtype="float32", block_size=4, num_blocks=32,
              enable_prefix_caching=True, cache_isolation="tenant")
    eng = llm.engine
    prompt = list(range(10, 23))
    eng.add_request("a1", prompt, SamplingParams(max_tokens=8, ignore_eos=True), tenant="a")
    eng.step()
    eng.add_request("a2", prompt, SamplingParams(max_tokens=8, ignore_eos=True), tenant="a")
    eng.step()
    snap = eng.snapshot()
    shared = [b for b in snap.blocks if b.ref_count == 2]
    assert len(shared) == 3 and all(b.holders == ("a1", "a2") and b.holder_tenants == ("a", "a") for b in shared)
    assert all(len(b.holders) == b.ref_count for b in snap.blocks)
    assert snap.num_free + snap.num_cached + sum(b.state == "used" for b in snap.blocks) == 32
