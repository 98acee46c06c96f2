"""The ``monitor`` strategy: the audit detector, plugged in through the engine's ReuseMonitor seam.

Traces are recorded from real runs on tiny-random (what the engine hands its monitor), then
replayed through a fresh DetectorMonitor: a probing trace must be flagged; benign traces give the
false-positive rate, which is printed (run with -s) and bounded.
"""
from __future__ import annotations

import json
import random

import pytest

from minikv import LLM, SamplingParams
from minikv.attacks.prefix_oracle import recover_secret_by_count
from minikv.audit.monitor import DetectorMonitor
from tests.engine_helpers import quiet_fork

BS = 16
P1 = SamplingParams(max_tokens=1, temperature=0.0)


class Recording(DetectorMonitor):
    """A DetectorMonitor that keeps every record it was shown (the recorded trace)."""

    instances: list = []

    def __init__(self, config=None, **kw):
        super().__init__(config, **kw)
        self.trace: list[dict] = []
        Recording.instances.append(self)

    def observe(self, record):
        self.trace.append(record)
        return super().observe(record)


@pytest.fixture(scope="module")
def base(tiny_path):
    return LLM(tiny_path, num_blocks=1024, seed=0)


def monitored(base, **kw):
    llm = quiet_fork(base, cache_isolation="selective", selective_strategy="monitor", reuse_monitor=Recording, **kw)
    return llm, Recording.instances[-1]


def rand(rng, n):
    return [rng.randrange(3, 250) for _ in range(n)]


def replay(trace) -> set:
    """Tenants a fresh detector flags on a recorded trace."""
    mon = DetectorMonitor()
    return {f.tenant for r in trace for f in mon.observe(r)}


def attack(llm, rank_of_secret: int, seed: int = 0):
    """The victim sends template + secret token + more; the attacker runs lesson 04's count
    attack on the secret token with a ranker that puts the truth at ``rank_of_secret``."""
    rng = random.Random(seed)
    template, secret, rest = rand(rng, 2 * BS - 1), rand(rng, 1), rand(rng, BS)
    llm.generate([template + secret + rest + [3]], P1, tenant="victim")
    decoys = [t for t in range(3, 250) if t != secret[0]][:15]
    candidates = decoys[:rank_of_secret] + secret + decoys[rank_of_secret:]
    rec = recover_secret_by_count(llm, template, 1, attacker_tenant="attacker", ranker=lambda _: candidates)
    return rec, template, secret, rest


def test_probing_is_flagged_after_threshold_and_isolated_both_directions(base):
    llm, mon = monitored(base)
    rec, template, secret, rest = attack(llm, rank_of_secret=12)
    assert rec.token_ids == [] and rec.probes == 16  # flagged at the 8th probe: the 13th misses
    assert [t[3] for t in rec.trace] == [False] * 16
    sharing = llm.engine.sharing
    assert sharing.flagged_tenants == {"attacker"} and len(sharing.flagged_prefixes) == 1
    victim_prompt = template + secret + rest + [4]
    # the victim still hits its own blocks (the isolated one now under its own key) ...
    assert llm.generate([victim_prompt], P1, tenant="victim")[0].num_cached_tokens == 3 * BS
    # ... a bystander hits the shared template but nothing after the flagged prefix ...
    assert llm.generate([victim_prompt], P1, tenant="bystander")[0].num_cached_tokens == BS
    # ... and the flagged attacker hits only blocks it wrote itself (its post-flag probes)
    writers = []
    llm.engine.block_manager.listeners.append(
        lambda tr, ids, seq: writers.extend(llm.engine.block_manager.blocks[b].writer_tenant for b in ids)
        if tr == "hit" and seq.tenant == "attacker" else None)
    assert llm.generate([victim_prompt], P1, tenant="attacker")[0].num_cached_tokens == 2 * BS
    assert writers and set(writers) == {"attacker"}
    assert replay(mon.trace) == {"attacker"}  # the recorded trace, replayed: the same verdict


def test_what_leaks_before_the_first_flag(base):
    """A secret the attacker's guesser ranks high is found in fewer probes than the threshold:
    the monitor flags afterwards, but the token is already out."""
    llm, _ = monitored(base)
    rec, _, secret, _ = attack(llm, rank_of_secret=3, seed=1)
    assert rec.token_ids == secret and rec.probes == 4
    assert llm.engine.sharing.num_flags == 0  # 4 probes: under the detector's threshold of 8


def benign_traces(base) -> dict[str, tuple[list[dict], set]]:
    """Recorded monitor inputs of three benign workloads, with their tenants."""
    rng = random.Random(0)
    out = {}
    llm, mon = monitored(base)  # N tenants sharing one system prompt, 2 questions each
    system = rand(rng, 70)
    for q in range(2):
        for t in range(16):
            llm.generate([system + rand(rng, rng.randint(8, 14))], P1, tenant=f"t{t}")
    out["system prompt, 16 tenants x 2"] = (mon.trace, {f"t{t}" for t in range(16)})
    llm, mon = monitored(base)  # Zipf-popular system prompts, unique 64-token suffixes
    prompts = [rand(rng, 8 * BS) for _ in range(8)]
    weights = [1 / (i + 1) ** 1.1 for i in range(8)]
    for _ in range(160):
        llm.generate([rng.choices(prompts, weights)[0] + rand(rng, 64)], P1, tenant=f"z{rng.randrange(24)}")
    out["zipf, 24 tenants"] = (mon.trace, {r["tenant"] for r in mon.trace})
    llm, mon = monitored(base)  # one chatty tenant: 24 questions of varied length, one system prompt
    for _ in range(24):
        llm.generate([system + rand(rng, rng.randint(5, 60))], P1, tenant="chatty")
    out["one chatty tenant, 24 questions"] = (mon.trace, {"chatty"})
    return out


def test_false_positive_rate_on_benign_traces(base):
    flagged = tenants = 0
    for name, (trace, who) in benign_traces(base).items():
        f = replay(trace)
        print(f"benign trace {name!r}: {len(f)} of {len(who)} tenants flagged")
        flagged, tenants = flagged + len(f), tenants + len(who)
    rate = flagged / tenants
    print(f"detector false-positive rate on benign traces: {flagged}/{tenants} = {rate:.1%}")
    assert tenants >= 40 and rate <= 0.05


def test_known_false_positive_a_classifier_tenant(base):
    """The detector's documented limit: many distinct equal-length short messages after one fixed
    prompt look exactly like an enumeration (a classifier API), so this benign tenant is flagged."""
    llm, mon = monitored(base)
    rng = random.Random(3)
    system = rand(rng, 2 * BS)
    for _ in range(10):
        llm.generate([system + rand(rng, 6)], P1, tenant="classifier")
    assert replay(mon.trace) == {"classifier"}


def test_monitor_records_carry_no_text_and_trail_gets_flags(base, tmp_path):
    path = tmp_path / "t.jsonl"
    llm, mon = monitored(base, audit_log=str(path))
    attack(llm, rank_of_secret=12)
    llm.engine.audit.close()
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    kinds = [r["decision"] for r in recs if r["event"] == "sharing"]
    assert kinds == ["flag", "isolate"]
    flag, iso = [r for r in recs if r["event"] == "sharing"]
    assert flag["tenant"] == "attacker" and "probing" not in flag["reason"] and len(flag["fps"]) == 1
    assert iso["blocks"] >= 1
    monitor_fps = {fp for r in mon.trace for fp in r["prefix_fps"]}
    assert not monitor_fps & set(flag["fps"])  # the trail's are re-keyed with the operator key
    assert all(set(r) == {"event", "request_id", "tenant", "num_prompt_tokens", "prefix_fps", "tail_fp"}
               for r in mon.trace)


def test_monitor_needs_a_factory():
    from minikv.engine.config import EngineConfig
    with pytest.raises(ValueError, match="reuse_monitor"):
        EngineConfig(cache_isolation="selective", selective_strategy="monitor")
    with pytest.raises(ValueError, match="threshold"):
        DetectorMonitor(threshold=1)
