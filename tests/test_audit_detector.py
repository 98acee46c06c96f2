"""Trail detector on synthetic event streams written in the exact trail format (ARCHITECTURE.md)."""
import hashlib
import hmac
import json
import random

import pytest

from minikv.audit.detector import detect, format_findings, infer_block_size, load_trail

BS = 16
KEY = b"operator-key"


class Trail:
    """Generates trail events the way minikv's AuditTrail does (keyed, chained prefix fingerprints)."""

    def __init__(self):
        self.events, self.t, self.n = [], 1_700_000_000.0, 0

    def _ev(self, event, rid, tenant, **kw):
        self.t += 0.01
        self.events.append({"t": round(self.t, 6), "event": event, "request_id": rid, "tenant": tenant,
                            "block_id": kw.pop("block_id", None), "fp": kw.pop("fp", None), **kw})

    def request(self, tenant, tokens, hits_from=None, public=False):
        self.n += 1
        rid = f"req-{self.n}"
        fps, state = [], b""
        for i in range(len(tokens) // BS):
            state = hmac.new(KEY, state + bytes(str(tokens[i * BS:(i + 1) * BS]), "ascii"), hashlib.sha256).digest()
            fps.append(state.hex()[:16])
        tail = hmac.new(KEY, b"tail" + bytes(str(tokens), "ascii"), hashlib.sha256).hexdigest()[:16]
        self._ev("request", rid, tenant, num_prompt_tokens=len(tokens), prefix_fps=fps, tail_fp=tail)
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
    assert "'victim'" in f.detail and "5 private block hit(s)" in f.detail
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


def test_long_decoy_request_does_not_hide_the_probes():
    """One long request sharing the probed prefix used to cancel the whole group."""
    rng, tr = random.Random(5), Trail()
    known = SYSTEM + words(rng, 10)
    probe_ids = [tr.request("mallory", known + [cand]) for cand in range(12)]
    tr.request("mallory", known + words(rng, 5 * BS))  # a decoy that runs far past the prefix
    found = [f for f in detect(tr.events) if f.kind == "probing"]
    assert len(found) == 1 and set(found[0].request_ids) == set(probe_ids)
