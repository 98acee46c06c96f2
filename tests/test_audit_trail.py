"""The audit trail as the engine writes it: levels, schema v2, forks, eviction attribution.

Every test runs the real engine (tiny-random) and reads the file it wrote.
"""
from __future__ import annotations

import json
import random
import warnings
from collections import Counter, defaultdict

import pytest

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.audit.detector import detect, load_trail
from minikv.audit.trail import LEVELS
from minikv.audit.trail_size import trail_bytes_per_request
from minikv.engine.config import AUDIT_LEVELS, EngineConfig

SECRET = b"audit-trail-test-secret-32-bytes"
GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tiny_path):
    return LLM(str(tiny_path), device="cpu", enable_prefix_caching=True, num_blocks=32)


def toks(rng, n, vocab=200):
    return [rng.randrange(3, vocab) for _ in range(n)]


def run(llm, jobs):
    """``jobs``: (tenant, prompt) pairs, submitted in that order, four at a time."""
    for i in range(0, len(jobs), 4):
        chunk = jobs[i:i + 4]
        llm.generate([p for _, p in chunk], GREEDY, tenant=[t for t, _ in chunk])


def workload(seed=0):
    rng = random.Random(seed)
    systems = {t: toks(rng, 40) for t in ("alice", "bob", "carol")}
    jobs = [(t, systems[t] + toks(rng, rng.randint(3, 60))) for t in rng.choices(list(systems), k=18)]
    jobs[0] = ("alice", systems["alice"] + toks(rng, 9))
    jobs[4:4] = [("mallory", systems["alice"] + toks(rng, 5)) for _ in range(3)]  # the 2nd batch
    return jobs


def trail_of(base, tmp_path, level, **kw):
    llm = base.fork(audit_log=str(tmp_path / f"{level}.jsonl"), audit_level=level, **kw)
    return llm, tmp_path / f"{level}.jsonl"


# ----------------------------------------------------------------------------- levels
def test_request_level_is_the_default_one_summary_per_request_and_no_content(base, tmp_path):
    llm = base.fork(audit_log=str(tmp_path / "t.jsonl"))
    assert llm.engine.config.audit_level == "request"
    jobs = workload()
    run(llm, jobs)
    llm.engine.audit.close()
    text = (tmp_path / "t.jsonl").read_text()
    events = [json.loads(line) for line in text.splitlines()]
    assert [e["event"] for e in events] == ["engine"] + ["summary"] * len(jobs)
    assert {e["v"] for e in events} == {2} and len({e["engine"] for e in events}) == 1
    assert events[0]["level"] == "request" and events[0]["block_size"] == 16
    s = events[1]
    assert set(s["blocks"]) == {"allocated", "hit", "adopted", "stored", "evicted", "scrubbed", "tier_hit", "offloaded"}
    assert len(s["prefix_fps"]) == s["num_prompt_tokens"] // 16 and len(s["tail_fp"]) == 16
    assert s["finish_reason"] == "length" and s["num_output_tokens"] == 2
    assert len({(e["engine"], e["request_id"]) for e in events[1:]}) == len(jobs)
    # never prompt content: no token-id run of any prompt, no field that could hold one
    for _, prompt in jobs:
        assert json.dumps(prompt[:6])[1:-1].replace(" ", "") not in text
    assert not {"prompt", "prompt_token_ids", "token_ids", "text"} & {k for e in events for k in e}


def test_both_levels_record_the_same_decisions(base, tmp_path):
    """The summary is the block events, counted: same counts, fingerprints and findings."""
    jobs = workload(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        trails = {}
        for level in LEVELS:  # same secret -> same keys; the engine is deterministic
            llm, path = trail_of(base, tmp_path, level, engine_secret=SECRET, cache_isolation="shared",
                                 max_cached_blocks_per_tenant="unlimited")
            run(llm, jobs)
            llm.engine.audit.close()
            trails[level] = load_trail(path)
    summaries = {e["request_id"]: e for e in trails["request"] if e["event"] == "summary"}
    per_req = defaultdict(list)
    for e in trails["block"]:
        per_req[e.get("request_id")].append(e)
    assert set(summaries) == {r for r in per_req if r is not None}
    for rid, s in summaries.items():
        evs = per_req[rid]
        kinds = Counter(e["event"] for e in evs)
        assert s["blocks"] == {"allocated": kinds["allocate"], "hit": kinds["hit"], "adopted": kinds["adopt"],
                               "stored": kinds["store"], "evicted": kinds["evict"], "scrubbed": kinds["scrub"],
                               "tier_hit": kinds["onload"], "offloaded": kinds["offload"]}
        assert s["hit_fps"] == [e["fp"] for e in evs if e["event"] == "hit"]
        assert s["adopted_fps"] == [e["fp"] for e in evs if e["event"] == "adopt"]
        assert s["stored_fps"] == [e["fp"] for e in evs if e["event"] == "store"]
        assert Counter(dict(map(tuple, s["evicted_owners"]))) == Counter(
            e["owner_tenant"] for e in evs if e["event"] == "evict")
        assert Counter(dict(map(tuple, s["cross_tenant_hits"]))) == Counter(  # adoptions are reuses too
            e["owner_tenant"] for e in evs if e["event"] in ("hit", "adopt") and e["owner_tenant"] != e["tenant"])
        (req,) = [e for e in evs if e["event"] == "request"]
        assert (s["prefix_fps"], s["tail_fp"]) == (req["prefix_fps"], req["tail_fp"])
    assert sum(s["blocks"]["evicted"] for s in summaries.values()) > 0  # the pool was under pressure
    assert sum(s["blocks"]["adopted"] for s in summaries.values()) > 0  # same-step twins were adopted
    assert any(s["cross_tenant_hits"] for s in summaries.values())  # shared mode: mallory read alice's
    found = {lvl: [(f.kind, f.tenant, f.detail, f.request_ids) for f in detect(ev)] for lvl, ev in trails.items()}
    assert found["request"] == found["block"] and ("cross_tenant_hit", "mallory") in [f[:2] for f in found["block"]]


# ----------------------------------------------------------------------------- hits and adoptions
PAIRS = {"one tenant": ("alice", "alice"), "alice first": ("alice", "mallory"), "mallory first": ("mallory", "alice")}


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("isolation", ["tenant", "shared"])
def test_a_same_step_twin_is_an_adopt_record_and_a_later_repeat_a_hit(base, tmp_path, isolation, pair):
    """Two requests with one 3-block prefix in one step: the second computes the prefix too, then
    adopts the first's copy at commit -- an ``adopt`` record, never a ``hit`` (it cached nothing at
    admission).  A third request, a step later, hits the blocks -- a ``hit`` record.  Across tenants,
    a shared cache adopts and hits the other tenant's blocks (both reported as cross-tenant, in both
    directions); tenant isolation does neither, and its repeat hits the tenant's own blocks."""
    first, second = PAIRS[pair]
    rng = random.Random(7)
    prefix = toks(rng, 48)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        runs = {}
        for level in LEVELS:
            llm, path = trail_of(base, tmp_path, level, engine_secret=SECRET, cache_isolation=isolation)
            twins = llm.generate([prefix + toks(rng, 5), prefix + toks(rng, 5)], GREEDY, tenant=[first, second])
            repeat = llm.generate([prefix + toks(rng, 5)], GREEDY, tenant=second)[0]
            llm.engine.audit.close()
            runs[level] = (load_trail(path), [o.num_cached_tokens for o in twins] + [repeat.num_cached_tokens])
    (events, cached), (summaries, cached_r) = runs["block"], runs["request"]
    assert cached == cached_r
    shares = first == second or isolation == "shared"
    assert cached == [0, 0, 48]  # an adoption caches nothing at admission; the repeat hits all 3 blocks
    reuse = [(e["event"], e["request_id"], e["tenant"], e["owner_tenant"]) for e in events
             if e["event"] in ("hit", "adopt")]
    adopted = [("adopt", "1", second, first)] * 3 if shares else []
    owner = first if shares else second  # a shared cache kept only the first copy
    assert reuse == adopted + [("hit", "2", second, owner)] * 3
    by_id = {s["request_id"]: s for s in summaries if s["event"] == "summary"}
    assert [(by_id[r]["blocks"]["hit"], by_id[r]["blocks"]["adopted"]) for r in "012"] == [
        (0, 0), (0, 3 if shares else 0), (3, 0)]
    assert len(by_id["1"]["adopted_fps"]) == by_id["1"]["blocks"]["adopted"] and not by_id["1"]["hit_fps"]
    cross = first != second and isolation == "shared"
    assert [by_id[r]["cross_tenant_hits"] for r in "012"] == ([[], [[first, 3]], [[first, 3]]] if cross else [[]] * 3)
    for evs in (events, summaries):  # the detector sees the adoption and the hit, at both levels
        found = [(f.kind, f.tenant, f.request_ids) for f in detect(evs) if f.kind == "cross_tenant_hit"]
        assert found == ([("cross_tenant_hit", second, ("1", "2"))] if cross else [])


def test_abort_and_close_still_write_a_summary(base, tmp_path):
    llm = base.fork(audit_log=str(tmp_path / "t.jsonl"))
    eng = llm.engine
    eng.add_request("gone", list(range(10, 60)), GREEDY, tenant="a")
    eng.add_request("busy", list(range(10, 60)), GREEDY, tenant="b")
    eng.step()
    eng.abort_request("gone")
    eng.audit.close()  # "busy" is still running: its summary says so
    ends = {e["request_id"]: e["finish_reason"] for e in load_trail(tmp_path / "t.jsonl") if e["event"] == "summary"}
    assert ends == {"gone": "abort", "busy": None}


def test_audit_level_setting_is_validated_and_has_a_serve_flag():
    assert AUDIT_LEVELS == LEVELS
    with pytest.raises(ValueError, match="audit_level='verbose'"):
        EngineConfig(model="tiny-random", audit_level="verbose")
    from minikv.cli import build_parser
    from minikv.engine.cli_flags import engine_kwargs_from_args
    args = build_parser().parse_args(["serve", "--model", "m", "--api-keys", "k.json", "--audit-level", "block"])
    assert engine_kwargs_from_args(args)["audit_level"] == "block"


# ----------------------------------------------------------------------------- forks
def test_forks_share_the_file_with_their_own_tags_and_the_same_fingerprints(base, tmp_path):
    path = str(tmp_path / "t.jsonl")
    parent = base.fork(audit_log=path)
    kids = [parent.fork(), parent.fork()]
    other_domain = parent.fork(engine_secret=SECRET)
    prompt = list(range(20, 70))
    for llm in [parent, *kids, other_domain]:
        llm.generate([prompt], GREEDY, tenant="alice")  # each engine numbers its requests from 0
    for llm in [parent, *kids, other_domain]:
        llm.engine.audit.close()
    events = load_trail(path)
    starts = {e["engine"]: e for e in events if e["event"] == "engine"}
    tag = parent.engine.audit.engine
    assert [k.engine.audit.engine for k in kids] == [f"{tag}.1", f"{tag}.2"]
    assert starts[f"{tag}.1"]["parent"] == tag and starts[tag]["parent"] is None
    sums = [e for e in events if e["event"] == "summary"]
    assert {s["request_id"] for s in sums} == {"0"} and len({(s["engine"], s["request_id"]) for s in sums}) == 4
    same_key = [s for s in sums if s["engine"] != other_domain.engine.audit.engine]
    assert len({(tuple(s["prefix_fps"]), s["tail_fp"]) for s in same_key}) == 1  # identical content, one fp
    assert sums[-1]["tail_fp"] != sums[0]["tail_fp"]  # a fork given its own secret is another domain


def test_a_fork_with_its_own_file_keeps_the_lineage(base, tmp_path):
    parent = base.fork(audit_log=str(tmp_path / "p.jsonl"))
    kid = parent.fork(audit_log=str(tmp_path / "k.jsonl"), audit_level="block")
    prompt = list(range(20, 70))
    for llm in (parent, kid):
        llm.generate([prompt], GREEDY, tenant="a")
        llm.engine.audit.close()
    (p_sum,) = [e for e in load_trail(tmp_path / "p.jsonl") if e["event"] == "summary"]
    k_events = load_trail(tmp_path / "k.jsonl")
    (k_req,) = [e for e in k_events if e["event"] == "request"]
    assert k_events[0]["parent"] == parent.engine.audit.engine and k_events[0]["level"] == "block"
    assert k_req["prefix_fps"] == p_sum["prefix_fps"]


# ----------------------------------------------------------------------------- eviction attribution
def eviction_scenario(llm, kind, rounds=20):
    rng = random.Random(3)
    systems = {t: toks(rng, 48) for t in ("a", "b", "c", "d")}
    for _ in range(rounds):
        if kind == "prime-and-probe":  # fresh primes that refill the pool, then a victim request
            run(llm, [("mallory", toks(rng, 161)) for _ in range(3)] + [("victim", toks(rng, rng.randint(20, 120)))])
        elif kind == "mixed":
            run(llm, [(t, systems[t] + toks(rng, rng.randint(5, 200))) for t in rng.sample(list(systems), 4)])
        else:  # one tenant, alone, cycling through far more content than the pool holds
            run(llm, [("solo", toks(rng, 16 * 24 + 1)), ("solo", systems["a"] + toks(rng, 10))])


@pytest.mark.parametrize("level", LEVELS)
def test_a_tenant_that_keeps_evicting_others_is_flagged(base, tmp_path, level):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)  # no quota: the prime-and-probe lessons' setting
        llm, path = trail_of(base, tmp_path, level, max_cached_blocks_per_tenant="unlimited")
    eviction_scenario(llm, "prime-and-probe")
    llm.engine.audit.close()
    events = load_trail(path)
    found = [f for f in detect(events) if f.kind == "eviction_pressure"]
    assert [f.tenant for f in found] == ["mallory"] and "(victim " in found[0].detail
    if level == "block":  # each evict names who needed the room and who wrote the block
        evicts = [e for e in events if e["event"] == "evict"]
        assert {(e["tenant"], e["owner_tenant"]) for e in evicts} >= {("mallory", "victim"), ("victim", "mallory")}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("kind, quota", [("mixed", "unlimited"), ("mixed", None), ("solo", "unlimited")])
def test_ordinary_traffic_and_self_eviction_are_not_flagged(base, tmp_path, level, kind, quota):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        llm, path = trail_of(base, tmp_path, level, max_cached_blocks_per_tenant=quota)
    eviction_scenario(llm, kind, rounds=12)
    llm.engine.audit.close()
    events = load_trail(path)
    evicted = sum(e["event"] == "evict" for e in events) + sum(
        s["blocks"]["evicted"] for s in events if s["event"] == "summary")
    assert evicted > 40  # the pool was under real pressure
    assert [f for f in detect(events) if f.kind == "eviction_pressure"] == []


# ----------------------------------------------------------------------------- size
def test_request_level_costs_a_fraction_of_block_level(base):
    sizes = trail_bytes_per_request(base, num_requests=24)
    assert set(sizes) == set(LEVELS)
    assert 0 < sizes["request"] < sizes["block"] / 3
