"""KV tiers without Redis: the host tier below the pool, the seam, the sealing, the lifecycle hooks.

A pool of 12 four-token blocks is small on purpose: a second tenant's prompt evicts the first
tenant's blocks, so they go through ``offload`` into the host tier and come back by ``onload``.
The Redis tier and two instances sharing it are tests/test_kv_tiers_redis.py.
"""
from __future__ import annotations

import json
import logging
import re
import warnings

import pytest
import torch

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.engine.cli_flags import add_engine_arguments, engine_kwargs_from_args
from minikv.tiers import HostTier, make_tier
from minikv.engine.lifecycle import LIFECYCLE, Transition
from minikv.security.scrub import ScrubOnAlloc
from minikv.security.sealing import SealError, Sealer, binding, tier_key, tier_space

P = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
SECRET = b"k" * 32
VICTIM = list(range(10, 30))    # 20 tokens: 4 full blocks of 4 can be hit (the last token is computed)
FLOOD = list(range(100, 144))   # 44 tokens (+3 generated): all 12 blocks, so every VICTIM block goes


def tiered(**kw) -> LLM:
    base = dict(device="cpu", dtype="float32", num_blocks=12, block_size=4, enable_prefix_caching=True,
                kv_tiers=["host"], engine_secret=SECRET, max_cached_blocks_per_tenant=12)
    return LLM("tiny-random", **(base | kw))


def tokens(out) -> list[int]:
    return out.outputs[0].token_ids


def evict_victim(llm, tenant="a"):
    first = llm.generate([VICTIM], P, tenant=tenant)[0]
    llm.generate([FLOOD], P, tenant="flood")
    assert llm.engine.tiers.stats["offloaded"] >= 4, llm.engine.tiers.stats
    return first


def test_no_tier_by_default_is_todays_engine():
    llm = LLM("tiny-random", device="cpu", num_blocks=12, block_size=4, enable_prefix_caching=True,
              max_cached_blocks_per_tenant=12)
    assert llm.engine.tiers is None and type(llm.engine.block_manager.kv_connector).__name__ == "NoConnector"
    llm.generate([VICTIM], P, tenant="a")
    llm.generate([FLOOD], P, tenant="flood")
    assert llm.generate([VICTIM], P, tenant="a")[0].num_cached_tokens == 0  # evicted is gone
    assert llm.engine.stats["tier_tokens"] == 0


def test_an_evicted_prefix_comes_back_from_the_host_tier_with_the_same_output():
    llm = tiered()
    first = evict_victim(llm)
    again = llm.generate([VICTIM], P, tenant="a")[0]
    assert again.num_cached_tokens == 16  # 4 blocks, all from the tier
    assert llm.engine.stats["tier_tokens"] == 16 and llm.engine.tiers.stats["onloaded"] == 4
    assert tokens(again) == tokens(first)  # the onloaded K/V are the K/V that were computed
    llm.engine.check_invariants()


@pytest.mark.parametrize("writer,reader", [("a", "b"), ("b", "a")])
def test_tier_hits_stay_within_the_tenant_both_directions(writer, reader):
    llm = tiered()
    evict_victim(llm, writer)
    other = llm.generate([VICTIM], P, tenant=reader)[0]
    assert other.num_cached_tokens == 0 and llm.engine.tiers.stats["onloaded"] == 0
    llm.generate([FLOOD], P, tenant="flood")
    assert llm.generate([VICTIM], P, tenant=writer)[0].num_cached_tokens == 16  # control: the writer hits


class Spy(ScrubOnAlloc):
    def __init__(self):
        self.calls = []

    def on_offload(self, pool, ids):
        super().on_offload(pool, ids)
        assert float(pool.k_cache[:, ids].abs().sum()) == 0.0  # zeroed right after the tier got it
        self.calls.append(("on_offload", tuple(ids)))

    def on_onload(self, pool, ids):
        assert float(pool.k_cache[:, ids].abs().sum()) > 0.0  # the tier's K/V are in place
        self.calls.append(("on_onload", tuple(ids)))


def test_offload_and_onload_run_their_hooks_and_offload_scrubs():
    spy = Spy()
    llm = tiered(scrubber=spy)
    seen = []
    llm.engine.block_manager.listeners.append(lambda t, ids, seq: seen.append((t, tuple(ids))))
    evict_victim(llm)
    llm.generate([VICTIM], P, tenant="a")
    tiered_events = [(LIFECYCLE[t].hook, ids) for t, ids in seen if t in (Transition.OFFLOAD, Transition.ONLOAD)]
    assert {h for h, _ in tiered_events} == {"on_offload", "on_onload"}
    assert tiered_events == spy.calls


def test_the_trail_counts_tier_hits_apart_from_pool_hits(tmp_path):
    llm = tiered(audit_log=str(tmp_path / "t.jsonl"))
    evict_victim(llm)
    llm.generate([VICTIM], P, tenant="a")
    llm.engine.audit.close()
    last = [json.loads(x) for x in (tmp_path / "t.jsonl").read_text().splitlines()][-1]
    assert last["blocks"]["hit"] == 4 and last["blocks"]["tier_hit"] == llm.engine.tiers.stats["onloaded"] == 4
    assert last["num_cached_tokens"] == 16


def test_a_deferred_admission_counts_its_tier_hits_once(tmp_path):
    """Regression: a request the pool cannot hold yet (a hog holds it) used to onload its blocks, be
    refused, see the hog's decodes evict (offload) them again, and onload them again on every retry:
    its trail said tier_hit 10 > hit 4, and ``tier_tokens`` 40.  A tier hit is one block the
    admitted request was served from a tier, counted once (``BlockManager.allocate``)."""
    llm = tiered(num_blocks=8, audit_log=str(tmp_path / "t.jsonl"))
    eng = llm.engine
    first = llm.generate([VICTIM], P, tenant="a")[0]
    llm.generate([FLOOD[:28]], P, tenant="flood")  # 7 blocks: every VICTIM block goes to the host tier
    assert eng.tiers.stats["offloaded"] >= 4 and eng.tiers.stats["onloaded"] == 0
    served = []
    eng.block_manager.listeners.append(lambda t, ids, seq: served.extend(
        ids if t == Transition.ONLOAD and seq.request_id == "v" else []))
    eng.add_request("hog", list(range(200, 220)), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                    tenant="c")  # 5 blocks, growing to 8 while "v" waits
    eng.add_request("v", VICTIM, P, tenant="a")
    outs = {}
    while eng.has_unfinished_requests():
        outs.update({o.request_id: o for o in eng.step() if o.finished})
        eng.check_invariants()
    eng.audit.close()
    trail = {e["request_id"]: e for e in map(json.loads, (tmp_path / "t.jsonl").read_text().splitlines())
             if e.get("event") == "summary"}
    blocks = trail["v"]["blocks"]
    assert outs["v"].num_cached_tokens == 16 and tokens(outs["v"]) == tokens(first)
    assert blocks["tier_hit"] <= blocks["hit"], blocks  # pool hits = hit - tier_hit >= 0
    assert blocks["tier_hit"] == len(served) == eng.tiers.stats["onloaded"] == 4, (blocks, served, eng.tiers.stats)
    assert eng.stats["tier_tokens"] == 16 and sum(eng.tiers.hits_by_tier.values()) == 4

def test_a_tampered_value_is_refused_counted_logged_and_recomputed(caplog):
    llm = tiered()
    first = evict_victim(llm)
    host: HostTier = llm.engine.tiers.tiers[0]
    tampered = {}
    for key, value in list(host._values.items()):
        flipped = bytearray(value)
        flipped[-1] ^= 1  # one bit of the ciphertext
        host._values[key] = tampered[key] = bytes(flipped)
    with caplog.at_level(logging.WARNING, logger="minikv.tiers"):
        again = llm.generate([VICTIM], P, tenant="a")[0]
    assert llm.engine.tiers.stats["onloaded"] == 0 and llm.engine.tiers.stats["refused"] >= 1
    assert "failed verification" in caplog.text
    dropped = [k for k, v in tampered.items() if host._values.get(k) != v]
    assert dropped  # a failing value is dropped from its tier (the lookup stops at the first one)
    assert tokens(again) == tokens(first)  # recomputed, never served from the bad value


# ---------------------------------------------------------------- the sealing, unit by unit
GEOM = (2, 4, 2, 16)
SP = tier_space("0" * 64, "float32", GEOM)


def _sealed(secret=SECRET, key=b"k1", model="tiny-random", dtype="float32", geom=GEOM, toks=(1, 2, 3, 4)):
    s = Sealer(secret)
    return s, s.seal(b"\x01" * 64, binding(tier_key(SP, key), model, dtype, geom, toks), ("domain", b"t"))


@pytest.mark.parametrize("what,bound", [
    ("swapped key", binding(tier_key(SP, b"k2"), "tiny-random", "float32", GEOM, (1, 2, 3, 4))),
    ("other model", binding(tier_key(SP, b"k1"), "smollm2-135m-instruct", "float32", GEOM, (1, 2, 3, 4))),
    ("other dtype", binding(tier_key(SP, b"k1"), "tiny-random", "bfloat16", GEOM, (1, 2, 3, 4))),
    ("other geometry", binding(tier_key(SP, b"k1"), "tiny-random", "float32", (2, 8, 2, 16), (1, 2, 3, 4))),
    ("other tokens", binding(tier_key(SP, b"k1"), "tiny-random", "float32", GEOM, (1, 2, 3, 5))),
])
def test_a_value_opens_only_for_what_it_was_sealed_for(what, bound):
    s, value = _sealed()
    assert s.open(value, binding(tier_key(SP, b"k1"), "tiny-random", "float32", GEOM, (1, 2, 3, 4)),
                  ("domain", b"t")) == b"\x01" * 64
    with pytest.raises(SealError):
        s.open(value, bound, ("domain", b"t"))


def test_an_outside_write_a_bit_flip_and_another_tenant_are_refused():
    s, value = _sealed()
    bound = binding(tier_key(SP, b"k1"), "tiny-random", "float32", GEOM, (1, 2, 3, 4))
    _, foreign = _sealed(secret=b"o" * 32)  # sealed by someone without this operator's secret
    for bad in (foreign, b"garbage", value[:-1] + bytes([value[-1] ^ 0x80])):
        with pytest.raises(SealError):
            s.open(bad, bound, ("domain", b"t"))
    with pytest.raises(SealError, match="another tenant"):  # the MAC holds, the tenant's AEAD key does not
        s.open(value, bound, ("domain", b"someone else"))
    assert b"\x01" * 16 not in value  # ciphertext: no run of the plaintext survives


def test_tier_keys_hold_no_tokens():
    with pytest.raises(TypeError, match="block_hash"):
        tier_key(SP, (1, 2, 3))
    with pytest.raises(TypeError, match="space"):
        tier_key(b"tiny-random", b"\xab" * 4)  # a model's name is not a space
    assert tier_key(SP, b"\xab" * 4) == b"minikv/kv/v2/" + SP + b"/abababab"


def test_each_model_dtype_and_geometry_has_a_space_of_its_own():
    spaces = {tier_space(m, d, g) for m in ("0" * 64, "1" * 64) for d in ("float32", "bfloat16")
              for g in (GEOM, (2, 8, 2, 16))}
    assert len(spaces) == 8 and all(len(x) == 16 and re.fullmatch(rb"[0-9a-f]{16}", x) for x in spaces)
    assert tier_space("0" * 64, "float32", GEOM) == SP  # deterministic: every instance agrees


def test_the_model_fingerprint_is_of_the_weights_not_the_name():
    from minikv.engine.loader import from_hf
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(cfg)
    a, b = from_hf(hf, torch.device("cpu")), from_hf(hf, torch.device("cpu"))
    assert a.fingerprint() == b.fingerprint() and re.fullmatch(r"[0-9a-f]{64}", a.fingerprint())
    with torch.no_grad():
        hf.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3  # a fine-tune that leaves embeddings alone
    assert from_hf(hf, torch.device("cpu")).fingerprint() != a.fingerprint()
    assert from_hf(hf.to(torch.bfloat16), torch.device("cpu")).fingerprint() != a.fingerprint()


# ---------------------------------------------------------------- settings at the door
@pytest.mark.parametrize("kw,match", [
    (dict(kv_tiers=["nosuch"]), "nosuch"),
    (dict(kv_tiers=["host?mib=lots"]), "lots"),
    (dict(kv_tiers=["host?colour=red"]), "colour"),
    (dict(kv_tier_keys="salted"), "salted"),
])
def test_bad_tier_settings_are_refused_naming_the_value(kw, match):
    with pytest.raises(ValueError, match=match):
        tiered(**kw)


def test_bad_settings_leave_a_running_engine_serving():
    llm = tiered()
    with pytest.raises(ValueError, match="nosuch"):
        llm.fork(kv_tiers=["nosuch"])
    assert tokens(llm.generate([VICTIM], P, tenant="a")[0])


def test_the_timing_audit_names_a_bad_prime_url_and_plans_a_good_one():
    from minikv.audit.timing import run_timing_audit
    with pytest.raises(ValueError, match="127.0.0.1:8001"):
        run_timing_audit("http://127.0.0.1:8000/v1", "sk-a", prime_url="127.0.0.1:8001", progress=False)
    plan = run_timing_audit("http://127.0.0.1:8000/v1", "sk-a", prime_url="http://127.0.0.1:8001/v1", dry_run=True)
    assert plan.prime_url == "http://127.0.0.1:8001/v1" and "primes to http://127.0.0.1:8001/v1" in plan.describe()

def test_kv_tiers_must_be_a_list():
    with pytest.raises(TypeError, match="kv_tiers"):
        tiered(kv_tiers=5)


@pytest.mark.parametrize("kw,name", [(dict(kv_tier_keys="content"), "kv_tier_keys='content'"),
                                     (dict(kv_tier_encrypt=False), "kv_tier_encrypt=False")])
def test_the_unsafe_tier_settings_warn(kw, name):
    with pytest.warns(UnsafeSettingWarning, match=name):
        tiered(**kw)


def test_an_unreachable_redis_is_a_miss_not_an_error():
    pytest.importorskip("redis")
    llm = tiered(kv_tiers=["host", "redis://127.0.0.1:1/0"])  # port 1: nothing listens there
    first = evict_victim(llm)
    assert tokens(llm.generate([VICTIM], P, tenant="a")[0]) == tokens(first)
    assert llm.engine.tiers.tiers[1].stats["errors"] > 0


def test_serve_flags_reach_the_config():
    import argparse
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    args = p.parse_args(["--model", "tiny-random", "--kv-tier", "host", "--kv-tier", "redis://127.0.0.1:6390/0",
                         "--kv-tier-keys", "content", "--no-kv-tier-encrypt"])
    kw = engine_kwargs_from_args(args)
    assert kw["kv_tiers"] == ("host", "redis://127.0.0.1:6390/0")
    assert kw["kv_tier_keys"] == "content" and kw["kv_tier_encrypt"] is False
    assert "kv_tiers" not in engine_kwargs_from_args(p.parse_args(["--model", "m"]))


def test_make_tier_registry():
    assert isinstance(make_tier("host?mib=1"), HostTier) and make_tier("host?mib=1").capacity == 1 << 20
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        h = HostTier(100)
        assert h.put(b"a", b"x" * 60, "t") and h.put(b"b", b"y" * 60, "t")
        assert h.get(b"a") is None and h.get(b"b") == b"y" * 60 and h.nbytes == 60  # bounded: the oldest went


# ---------------------------------------------------------------- a tier object, shared by engines in one process
def test_two_engines_given_one_tier_object_share_it():
    store = HostTier(1 << 20, name="store", when="store")  # written on store, like the Redis tier
    one, two = tiered(kv_tiers=["host", store]), tiered(kv_tiers=["host", store])
    assert one.engine.tiers.tiers[1] is store is two.engine.tiers.tiers[1]
    first = one.generate([VICTIM], P, tenant="a")[0]
    assert len(store) == 5  # every full block, stored on full
    assert two.generate([VICTIM], P, tenant="b")[0].num_cached_tokens == 0  # another tenant: a miss
    again = two.generate([VICTIM], P, tenant="a")[0]
    assert again.num_cached_tokens == 16 and two.engine.tiers.hits_by_tier == {"host": 0, "store": 4}
    assert tokens(again) == tokens(first)
    assert len(store.items()) == len(store) and all(isinstance(v, bytes) for _, v in store.items())


@pytest.mark.parametrize("bad", [object(), 5, None, HostTier])
def test_a_tier_entry_that_is_neither_a_spec_nor_a_tier_is_refused_naming_it(bad):
    with pytest.raises(TypeError, match=rf"kv_tiers: .*\({type(bad).__name__}\) is neither a tier spec"):
        tiered(kv_tiers=["host", bad])


@pytest.mark.parametrize("kw,match", [(dict(when="later"), "later"), (dict(name=""), "name")])
def test_a_host_tier_names_a_bad_name_or_when(kw, match):
    with pytest.raises(ValueError, match=match):
        HostTier(1 << 20, **kw)


def test_a_tier_object_with_a_bad_when_is_refused_naming_it():
    store = HostTier(1 << 20, name="store", when="store")
    store.when = "sometimes"
    with pytest.raises(ValueError, match="sometimes"):
        tiered(kv_tiers=[store])
