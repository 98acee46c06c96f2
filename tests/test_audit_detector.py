"""Trail detector on synthetic event streams written in the exact trail format (ARCHITECTURE.md),
at both levels: per-block events ("block") and one summary per request ("request")."""
import hashlib
import hmac
import json
import random
from collections import Counter

import pytest

from minikv.audit.detector import detect, format_findings, infer_block_size, load_trail

BS = 16
KEY = b"operator-key"


class Trail:
    """Generates trail events the way minikv's AuditTrail does (keyed, chained prefix fingerprints),
    per block (``level="block"``) or as one summary per request (``level="request"``)."""

    def __init__(self, level="block", engine="e0"):
        self.events, self.t, self.n = [], 1_700_000_000.0, 0
        self.level, self.engine = level, engine

    def _ev(self, event, rid, tenant, **kw):
        self.t += 0.01
        self.events.append({"t": round(self.t, 6), "event": event, "request_id": rid, "tenant": tenant,
                            "block_id": kw.pop("block_id", None), "fp": kw.pop("fp", None), **kw})

    def request(self, tenant, tokens, hits_from=None, public=False, evicts=()):
        """One request; ``evicts``: owner tenants of the cached blocks its allocations evicted."""
        self.n += 1
        rid = f"req-{self.n}"
        fps, state = [], b""
        for i in range(len(tokens) // BS):
            state = hmac.new(KEY, state + bytes(str(tokens[i * BS:(i + 1) * BS]), "ascii"), hashlib.sha256).digest()
            fps.append(state.hex()[:16])
        tail = hmac.new(KEY, b"tail" + bytes(str(tokens), "ascii"), hashlib.sha256).hexdigest()[:16]
        if self.level == "request":
            cross = len(fps) if hits_from not in (None, tenant) and not public else 0
            self._ev("summary", rid, tenant, v=2, engine=self.engine, num_prompt_tokens=len(tokens),
                     num_cached_tokens=BS * len(fps) if hits_from else 0, num_output_tokens=1,
                     finish_reason="length", cross_tenant_hits=[[hits_from, cross]] if cross else [],
                     evicted_owners=[[o, n] for o, n in Counter(evicts).items()], prefix_fps=fps,
                     tail_fp=tail)
            return rid
        self._ev("request", rid, tenant, num_prompt_tokens=len(tokens), prefix_fps=fps, tail_fp=tail)
        for i, owner in enumerate(evicts):
            self._ev("evict", rid, tenant, block_id=i, fp=f"{i:016x}", owner_tenant=owner)
        for i, fp in enumerate(fps):
            if hits_from is not None:
                self._ev("hit", rid, tenant, block_id=i, fp=fp, owner_tenant=hits_from, public=public)
            else:
                self._ev("allocate", rid, tenant, block_id=100 + self.n * 10 + i)
        self._ev("finish", rid, tenant, num_cached_tokens=BS * len(fps) if hits_from else 0,
                 num_prompt_tokens=len(tokens), num_output_tokens=1, finish_reason="length")
        return rid


def words(rng, n):
    return [rng.randrange(32000) for _ in range(n)]


SYSTEM = words(random.Random(42), 5 * BS)  # an 80-token shared system prompt


def test_probing_attacker_is_flagged():
    rng, tr = random.Random(0), Trail()
    victim_secret = words(rng, 21)
    tr.request("victim", SYSTEM + victim_secret)
    known = SYSTEM + victim_secret[:10]  # the attacker knows the first 10 secret tokens
    probe_ids = [tr.request("mallory", known + [cand]) for cand in range(30)]
    found = [f for f in detect(tr.events) if f.kind == "probing"]
    assert len(found) == 1
    f = found[0]
    assert f.tenant == "mallory" and set(f.request_ids) == set(probe_ids)
    assert "victim" in f.detail  # the other sender of the same prefix is named


def test_probing_found_when_candidates_cross_a_block_boundary():
    tr = Trail()
    known = SYSTEM + words(random.Random(1), BS - 1)  # next token completes block 6
    for cand in range(10):
        tr.request("mallory", known + [cand])
    assert [f.tenant for f in detect(tr.events)] == ["mallory"]


def test_fifty_tenants_sharing_a_system_prompt_are_not_flagged():
    rng, tr = random.Random(2), Trail()
    for t in range(50):
        for _ in range(rng.randint(1, 3)):
            tr.request(f"tenant-{t}", SYSTEM + words(rng, rng.randint(5, 200)), hits_from="tenant-0",
                       public=True)
    assert detect(tr.events) == []


def test_ordinary_tenant_with_a_few_questions_is_not_flagged():
    rng, tr = random.Random(3), Trail()
    for _ in range(5):
        tr.request("alice", SYSTEM + words(rng, rng.randint(10, 120)))
    assert detect(tr.events) == []


def test_busy_tenant_with_varied_questions_is_not_flagged():
    rng, tr = random.Random(4), Trail()
    for _ in range(60):
        tr.request("service", SYSTEM + words(rng, rng.randint(20, 400)))
    assert detect(tr.events) == []


def test_retry_loop_of_one_prompt_is_not_probing():
    tr = Trail()
    prompt = SYSTEM + [7, 8, 9]
    for _ in range(20):
        tr.request("bob", prompt)
    assert detect(tr.events) == []


def test_threshold_is_respected():
    tr = Trail()
    for cand in range(7):
        tr.request("mallory", SYSTEM + [cand])
    assert detect(tr.events) == []
    assert [f.kind for f in detect(tr.events, threshold=5)] == ["probing"]


def test_cross_tenant_private_hits_flagged_public_not():
    tr = Trail()
    tr.request("victim", SYSTEM)
    r1 = tr.request("mallory", SYSTEM, hits_from="victim")
    tr.request("carol", SYSTEM, hits_from="victim", public=True)
    tr.request("victim", SYSTEM, hits_from="victim")
    found = detect(tr.events)
    assert len(found) == 1
    f = found[0]
    assert (f.kind, f.tenant, f.request_ids) == ("cross_tenant_hit", "mallory", (r1,))
    assert "'victim'" in f.detail and "5 private block reuse(s) (hits or adoptions)" in f.detail
    assert "cross_tenant_hit" in format_findings(found)


def test_hit_without_public_field_counts_as_private():
    ev = {"t": 1.0, "event": "hit", "request_id": "r", "tenant": "a", "block_id": 1, "fp": "00",
          "owner_tenant": "b"}
    assert [f.kind for f in detect([ev])] == ["cross_tenant_hit"]


def test_infer_block_size():
    tr = Trail()
    rng = random.Random(5)
    for n in (17, 40, 95, 130):
        tr.request("a", words(rng, n))
    assert infer_block_size(tr.events) == BS
    assert infer_block_size([]) is None


def test_load_trail_roundtrip_and_errors(tmp_path):
    tr = Trail()
    tr.request("a", SYSTEM)
    p = tmp_path / "trail.jsonl"
    p.write_text("\n".join(json.dumps(e) for e in tr.events) + "\n\n")
    assert load_trail(p) == tr.events
    p.write_text(json.dumps(tr.events[0]) + "\n{oops\n")
    with pytest.raises(ValueError, match=":2:"):
        load_trail(p)


def test_threshold_validated():
    with pytest.raises(ValueError):
        detect([], threshold=1)


@pytest.mark.parametrize("flag, value, says", [
    ("--threshold", "1", "expected an integer >= 2, got 1"),
    ("--threshold", "eight", "expected an integer, got 'eight'"),
    ("--min-evictions", "0", "expected an integer >= 1, got 0"),
    ("--block-size", "-16", "expected an integer >= 1, got -16"),
])
def test_detect_cli_refuses_bad_numbers_naming_the_value(tmp_path, capsys, flag, value, says):
    """``minikv audit detect`` checks its numbers at the command line: argparse's usage error
    (exit 2) names the flag and the value, before any trail is read."""
    from minikv.audit.cli import main as audit_main

    trail = tmp_path / "trail.jsonl"
    trail.write_text("")
    with pytest.raises(SystemExit) as exc:
        audit_main(["audit", "detect", str(trail), flag, value])
    assert exc.value.code == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err


def test_long_decoy_request_does_not_hide_the_probes():
    """One long request sharing the probed prefix used to cancel the whole group."""
    rng, tr = random.Random(5), Trail()
    known = SYSTEM + words(rng, 10)
    probe_ids = [tr.request("mallory", known + [cand]) for cand in range(12)]
    tr.request("mallory", known + words(rng, 5 * BS))  # a decoy that runs far past the prefix
    found = [f for f in detect(tr.events) if f.kind == "probing"]
    assert len(found) == 1 and set(found[0].request_ids) == set(probe_ids)


# ----------------------------------------------------------------------------- both levels
@pytest.mark.parametrize("level", ["block", "request"])
def test_probing_and_cross_tenant_hits_found_at_both_levels(level):
    rng, tr = random.Random(0), Trail(level)
    secret = words(rng, 21)
    tr.request("victim", SYSTEM + secret)
    leak = tr.request("mallory", SYSTEM, hits_from="victim")
    tr.request("carol", SYSTEM, hits_from="victim", public=True)
    probes = [tr.request("mallory", SYSTEM + secret[:10] + [cand]) for cand in range(10)]
    found = detect(tr.events)
    assert [(f.kind, f.tenant) for f in found] == [("cross_tenant_hit", "mallory"), ("probing", "mallory")]
    assert found[0].request_ids == (leak,) and "5 private block reuse(s) (hits or adoptions)" in found[0].detail
    assert set(probes) <= set(found[1].request_ids)


def test_same_request_id_from_two_engines_is_named_with_its_engine():
    a, b = Trail("request", engine="e1"), Trail("request", engine="e1.1")
    ra = a.request("mallory", SYSTEM, hits_from="victim")
    rb = b.request("mallory", SYSTEM, hits_from="victim")
    assert ra == rb == "req-1"  # a fork numbers its requests from the start too
    (f,) = detect(a.events + b.events)
    assert f.request_ids == ("req-1@e1", "req-1@e1.1") and "across 2 request(s)" in f.detail
    (g,) = detect(a.events)
    assert g.request_ids == ("req-1",)  # unambiguous ids stay plain


# ----------------------------------------------------------------------------- eviction pressure
POOL = 24


def flush_rounds(tr, rounds=8, victims=("alice", "bob"), per_victim=3):
    """Prime-and-probe with fresh primes: each round the victims' requests evict the attacker's
    primed blocks, then mallory refills the whole pool -- mostly its own old blocks, plus
    everything the victims cached in between."""
    rng = random.Random(7)
    for _ in range(rounds):
        for v in victims:
            tr.request(v, SYSTEM + words(rng, rng.randint(10, 90)), evicts=["mallory"] * per_victim)
        fresh = len(victims) * per_victim
        tr.request("mallory", words(rng, POOL * BS + 1), evicts=["mallory"] * (POOL - fresh) +
                   [v for v in victims for _ in range(per_victim)])


@pytest.mark.parametrize("level", ["block", "request"])
def test_a_tenant_that_keeps_flushing_the_others_is_flagged(level):
    tr = Trail(level)
    flush_rounds(tr)
    found = [f for f in detect(tr.events) if f.kind == "eviction_pressure"]
    assert [f.tenant for f in found] == ["mallory"]
    assert "48 cached block(s) of 2 other tenant(s) (alice 24, bob 24)" in found[0].detail
    assert "100% of all the blocks other tenants lost" in found[0].detail
    assert len(found[0].request_ids) == 8
    assert detect(tr.events, min_evictions=49) == []


@pytest.mark.parametrize("level", ["block", "request"])
def test_ordinary_mixed_traffic_is_not_flagged(level):
    """Four tenants with similar load on a full pool: each evicts the LRU's oldest blocks,
    whoever wrote them, so each causes about a quarter of everybody's losses."""
    rng, tr = random.Random(11), Trail(level)
    tenants = ["t0", "t1", "t2", "t3"]
    for _ in range(200):
        tr.request(rng.choice(tenants), words(rng, rng.randint(20, 200)),
                   evicts=[rng.choice(tenants) for _ in range(rng.randint(1, 6))])
    assert [f for f in detect(tr.events) if f.kind == "eviction_pressure"] == []


@pytest.mark.parametrize("level", ["block", "request"])
def test_two_similar_tenants_and_a_tenant_evicting_only_itself_are_not_flagged(level):
    rng, tr = random.Random(12), Trail(level)
    for _ in range(100):
        tr.request("a", words(rng, 50), evicts=rng.choices(["a", "b"], k=4))
        tr.request("b", words(rng, 50), evicts=rng.choices(["a", "b"], k=4))
        tr.request("solo", words(rng, 400), evicts=["solo"] * 25)
    assert [f for f in detect(tr.events) if f.kind == "eviction_pressure"] == []


def test_eviction_pressure_limits_are_what_the_docs_say():
    # A re-priming attacker and its victim evict exactly each other's blocks: symmetric, not flagged.
    tr = Trail()
    for _ in range(40):
        tr.request("victim", SYSTEM, evicts=["mallory"] * 3)
        tr.request("mallory", SYSTEM, evicts=["victim"] * 3)
    assert [f for f in detect(tr.events) if f.kind == "eviction_pressure"] == []
    # Evictions that no request caused (an operator's reset_prefix_cache) count for nobody.
    reset = [{"t": 1.0, "event": "evict", "request_id": None, "tenant": None, "block_id": i, "fp": None,
              "owner_tenant": "alice"} for i in range(100)]
    assert detect(reset) == []


def test_min_evictions_validated():
    with pytest.raises(ValueError, match="min_evictions"):
        detect([], min_evictions=0)
    with pytest.raises(TypeError, match="threshold"):
        detect([], threshold="8")


def test_load_trail_reads_gzip(tmp_path):
    import gzip
    tr = Trail("request")
    flush_rounds(tr, rounds=1)
    p = tmp_path / "trail.jsonl.1.gz"
    p.write_bytes(gzip.compress(("\n".join(json.dumps(e) for e in tr.events) + "\n").encode()))
    assert load_trail(p) == tr.events
