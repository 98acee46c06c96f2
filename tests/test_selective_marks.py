"""Private marks under selective sharing (minikv/sharing/strategies.py): what a tenant marks private
(``cache_private=True``) and what the operator marks sensitive (``sensitive_prefixes``).

Both directions every time: the marked content is not hit by another tenant while the same
unmarked content is; the writer's tenant still hits its own private blocks.  Then outputs equal
cache-off outputs, the trail records, and bad input.
"""
from __future__ import annotations

import json

import pytest

from minikv import LLM, SamplingParams
from minikv.audit.monitor import DetectorMonitor
from minikv.engine.config import EngineConfig
from tests.engine_helpers import quiet_fork, random_contents

BS = 16
P1 = SamplingParams(max_tokens=1, temperature=0.0)
P4 = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
MARKER = [251, 252]  # outside the random contents' range 3..250: it occurs only where placed
MONITOR = dict(selective_strategy="monitor", reuse_monitor=DetectorMonitor)


@pytest.fixture(scope="module")
def base(tiny_path):
    return LLM(tiny_path, num_blocks=512, seed=0)


fork, contents = quiet_fork, random_contents


def cached(llm, prompt, tenant, **kw) -> int:
    return llm.generate([prompt], P1, tenant=tenant, **kw)[0].num_cached_tokens


@pytest.mark.parametrize("policy", [dict(cache_isolation="selective", **MONITOR),
                                    dict(cache_isolation="selective"), dict(cache_isolation="shared")],
                         ids=["monitor", "k_tenants", "shared"])
def test_cache_private_request_is_hit_only_by_its_own_tenant(base, policy):
    llm = fork(base, **policy)
    secret, public = (p + [3] for p in contents(1, 2))  # 3 full blocks + 1 token: 48 cacheable
    assert cached(llm, secret, "victim", cache_private=True) == 0
    assert cached(llm, secret, "attacker") == 0  # not hittable by another tenant
    assert cached(llm, secret, "other", cache_private=True) == 0  # nor from another's private domain
    assert cached(llm, secret, "victim", cache_private=True) == 48  # the same tenant hits its own
    if policy.get("selective_strategy") == "monitor" or policy["cache_isolation"] == "shared":
        assert cached(llm, public, "victim") == 0  # the control: unmarked content IS shared
        assert cached(llm, public, "attacker") == 48


def test_cache_private_never_counts_towards_promotion(base):
    llm = fork(base, cache_isolation="selective")  # k_tenants, k=3
    secret, public = (p + [3] for p in contents(2, 2))
    for t in ("a", "b", "c", "d"):
        cached(llm, secret, t, cache_private=True)
        cached(llm, public, t)
    assert cached(llm, secret, "e") == 0  # four private computations: never promoted
    assert cached(llm, public, "e") == 48  # three unmarked ones: promoted


@pytest.mark.parametrize("offset", [0, 5], ids=["block-aligned", "mid-block"])
@pytest.mark.parametrize("strategy", [MONITOR, {}], ids=["monitor", "k_tenants"])
def test_sensitive_prefix_and_what_follows_stay_private(base, strategy, offset):
    system, secret, other = contents(3, 3, blocks=2)
    marked = system + other[:offset] + MARKER + secret + [3]  # the marker starts in block 2
    plain = system + other + [4]
    llm = fork(base, cache_isolation="selective", sensitive_prefixes=[MARKER], **strategy)
    tenants = ("a", "b", "c") if not strategy else ("a",)  # k_tenants: k=3 computations to promote
    for t in tenants:
        cached(llm, marked, t)
        cached(llm, plain, t)
    assert cached(llm, marked, "z") == 2 * BS  # the system blocks are shared; the marked ones are not
    assert cached(llm, plain, "z") == len(plain) - 1  # unmarked content still is
    # z computed the marked blocks in its own domain just now: its tenant hits them, another does not
    assert cached(llm, marked, "z") == (len(marked) - 1) // BS * BS
    assert cached(llm, marked, "y") == 2 * BS


@pytest.mark.parametrize("strategy", [MONITOR, dict(selective_k=2)], ids=["monitor", "k2"])
def test_outputs_equal_cache_off_outputs_with_marks(base, strategy):
    off = base.fork(enable_prefix_caching=False)
    llm = fork(base, cache_isolation="selective", sensitive_prefixes=[MARKER], **strategy)
    pool = contents(7, 3)
    reqs = [(f"t{i % 4}", pool[i % 3][:(1 + i % 3) * BS] + (MARKER if i % 5 == 0 else []) + [5 + i], i % 3 == 0)
            for i in range(18)]
    for tenant, prompt, private in reqs:
        a = off.generate([prompt], P4, tenant=tenant)[0]
        b = llm.generate([prompt], P4, tenant=tenant, cache_private=private)[0]
        assert a.outputs[0].token_ids == b.outputs[0].token_ids, (tenant, len(prompt), private)
    assert llm.engine.stats["cached_tokens"] > 0  # the comparison covered hits, not only misses


def test_private_decisions_are_in_the_trail_keyed_and_without_text(base, tmp_path):
    path = tmp_path / "trail.jsonl"
    llm = fork(base, cache_isolation="selective", sensitive_prefixes=[MARKER], audit_log=str(path), **MONITOR)
    system, secret = contents(4, 2, blocks=2)
    llm.generate([secret + [3]], P1, tenant="a", cache_private=True)
    llm.generate([system + MARKER + secret], P1, tenant="b")
    llm.generate([system + [3]], P1, tenant="c")  # no mark: no record
    llm.engine.audit.close()
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    private = [r for r in recs if r["event"] == "sharing" and r["decision"] == "private"]
    assert [(r["tenant"], r["reason"], r["blocks"]) for r in private] == [
        ("a", "cache_private", 2), ("b", "sensitive_prefixes", 2)]
    assert all(len(r["fps"]) == 1 and len(r["fps"][0]) == 16 for r in private)
    assert ",".join(map(str, secret[:8])) not in path.read_text()


def test_bad_input(base):
    llm = fork(base, cache_isolation="selective", **MONITOR)
    with pytest.raises(TypeError, match=r"cache_private must be a bool, got str \('yes'\)"):
        llm.engine.add_request("r1", [5, 6, 7], P1, tenant="a", cache_private="yes")
    with pytest.raises(TypeError, match=r"cache_private must be a bool, got int \(1\)"):
        llm.generate([[5, 6, 7]], P1, cache_private=1)
    with pytest.raises(ValueError, match="cache_private has 1 entries for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], P1, cache_private=[True])
    assert not llm.engine.requests and not llm.engine.has_unfinished_requests()  # nothing left behind
    with pytest.raises(TypeError, match=r"sensitive_prefixes\[0\] must be a non-empty str"):
        EngineConfig(cache_isolation="selective", sensitive_prefixes=[[]])
    with pytest.raises(TypeError, match=r"sensitive_prefixes must be a str or a list of prefixes, got int \(5\)"):
        EngineConfig(cache_isolation="selective", sensitive_prefixes=5)
    with pytest.raises(ValueError, match="cannot stay private under cache_isolation='shared'"):
        EngineConfig(cache_isolation="shared", sensitive_prefixes=["secret"])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        fork(base, cache_isolation="selective", sensitive_prefixes=[[10**9]])
    assert EngineConfig(cache_isolation="tenant", sensitive_prefixes="x").sensitive_prefixes == ("x",)
