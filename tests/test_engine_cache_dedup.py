"""No dead prefix-cache entries: a repeated batch hits every shared block, whatever the timing.

Before engine v2, two requests with one prefix admitted in the same step each computed it, the
second kept its copy private, and its later blocks were stored with that private copy as their
parent.  An exact repeat of the batch then hit only the first request's blocks in full: cached
tokens ``[64, 32, 32, 32]`` with three "rejected hits" and no attack.  Lesson 06 teaches that a
rejected hit is evidence of a hash collision, so these must stay at zero without one.
"""
from __future__ import annotations

import random
import warnings

import pytest

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.engine.block_manager import BlockManager
from minikv.engine.sequence import Sequence

BS = 16
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _prompts(seed: int = 0, n: int = 4) -> list[list[int]]:
    """``n`` 72-token prompts: one 32-token prefix (2 blocks), then distinct 40-token tails."""
    rng = random.Random(seed)
    prefix = [rng.randrange(5, 250) for _ in range(32)]
    return [prefix + [rng.randrange(5, 250) for _ in range(40)] for _ in range(n)]


def _llm(isolation: str, verify):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)  # verify_hits False / "tokens"
        return LLM("tiny-random", device="cpu", dtype="float32", block_size=BS, num_blocks=256,
                   enable_prefix_caching=True, cache_isolation=isolation, verify_hits=verify)


def _run(llm, prompts, tenant, arrivals):
    """Send ``prompts``; ``arrivals[k]`` is the step at which prompt k arrives.  Returns
    each request's cached tokens, in prompt order."""
    eng = llm.engine
    ids = [eng.new_request_id() for _ in prompts]
    done, step = {}, 0
    while len(done) < len(prompts):
        for k, (rid, p) in enumerate(zip(ids, prompts)):
            if arrivals[k] == step:
                eng.add_request(rid, p, ONE, tenant=tenant)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out.num_cached_tokens
        eng.check_invariants()
        step += 1
    return [done[r] for r in ids]


FULL = 64  # (72 - 1) // 16 = 4 blocks may hit: one prompt token is always computed
TIMINGS = {"same step": [0, 0, 0, 0], "across steps": [0, 1, 2, 3], "two and two": [0, 0, 1, 1]}


@pytest.mark.parametrize("timing", TIMINGS)
@pytest.mark.parametrize("verify", [True, "tokens", False])
@pytest.mark.parametrize("isolation", ["tenant", "shared"])
def test_a_repeated_batch_hits_every_shared_block(isolation, verify, timing):
    llm = _llm(isolation, verify)
    bm, prompts = llm.engine.block_manager, _prompts()
    first = _run(llm, prompts, "alice", TIMINGS[timing])
    # Whoever arrives with a request already running (or cached) hits its prefix at once.
    assert first[0] == 0 and all(c in (0, 32) for c in first[1:])
    again = _run(llm, prompts, "alice", TIMINGS[timing])
    assert again == [FULL] * 4, f"{timing}: repeat hit {again}"
    assert bm.num_rejected_hits == 0, "a rejected hit without any attack"
    # One copy of the shared prefix: each duplicate computed in the same step was freed.
    assert bm.num_deduplicated == 2 * first.count(0) - 2
    assert len(bm.hash_table) == 2 + 4 * 2  # prefix + each tail's two full blocks


@pytest.mark.parametrize("verify", [True, "tokens", False])
def test_deduplication_stays_inside_the_tenant(verify):
    """Both directions: alice's repeat hits all of alice's blocks; bob, sending the same batch
    in the same step as alice, neither hits nor adopts hers, and his repeat hits his own."""
    llm = _llm("tenant", verify)
    eng, bm, prompts = llm.engine, llm.engine.block_manager, _prompts(seed=1)
    for k, p in enumerate(prompts):
        eng.add_request(f"a{k}", p, ONE, tenant="alice")
        eng.add_request(f"b{k}", p, ONE, tenant="bob")
    while eng.has_unfinished_requests():
        eng.step()
        eng.check_invariants()
    tenants = {bm.blocks[b].writer_tenant for b in bm.hash_table.values()}
    assert tenants == {"alice", "bob"} and len(bm.hash_table) == 2 * (2 + 4 * 2)
    assert _run(llm, prompts, "alice", [0] * 4) == [FULL] * 4
    assert _run(llm, prompts, "bob", [0] * 4) == [FULL] * 4
    assert _run(llm, prompts, "carol", [0] * 4) == [0] * 4, "another tenant hit"
    assert bm.num_rejected_hits == 0


def test_a_colliding_twin_is_not_adopted_and_still_counts_as_a_rejected_hit():
    """A twin with the same hash but other tokens is a collision: the copy stays private, and a
    later lookup that meets it is rejected and counted (lesson 06's evidence of an attack)."""
    collide = lambda parent, tokens, extra, key: b"same hash for every block"  # noqa: E731
    bm = BlockManager(8, 4, hasher=collide, enable_caching=True)
    a = Sequence("a", [1, 2, 3, 4, 9], ONE)
    b = Sequence("b", [5, 6, 7, 8, 9], ONE)
    for s in (a, b):
        assert bm.allocate(s)
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.commit(s)
    assert bm.num_deduplicated == 0 and bm.blocks[b.block_table[0]].hash is None
    bm.check_invariants([a, b])
    c = Sequence("c", [5, 6, 7, 8, 9], ONE)
    assert bm.allocate(c) and c.num_cached_tokens == 0
    assert bm.num_rejected_hits == 1


def test_a_same_step_duplicate_is_freed_and_its_twin_adopted():
    """Block-manager level: the second sequence swaps its copy for the twin (one adopt event, no
    hit event: nothing was cached when it was admitted), its copy goes back to the free list (one
    free event), and its next block chains onto the twin.  A later sequence's reuse is a hit."""
    events = []
    bm = BlockManager(16, 4, hasher=lambda p, t, e, k: repr((p, t, k)).encode(), enable_caching=True)
    bm.listeners.append(lambda ev, ids, seq: events.append((str(ev), seq.request_id, list(ids))))
    a = Sequence("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], ONE)
    b = Sequence("b", [1, 2, 3, 4, 6, 6, 6, 6, 9], ONE)
    assert bm.allocate(a) and bm.allocate(b)
    b_copy = b.block_table[0]
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
        bm.commit(s)
    assert b.block_table[0] == a.block_table[0] and bm.blocks[a.block_table[0]].ref_count == 2
    assert b_copy in bm.free_ids
    assert ("adopt", "b", [a.block_table[0]]) in events and ("free", "b", [b_copy]) in events
    assert not [e for e in events if e[0] == "hit"] and bm.num_hits == 0 and b.num_cached_tokens == 0
    assert bm.blocks[b.block_table[1]].identity.parent == bm.blocks[a.block_table[0]].ref
    bm.check_invariants([a, b])
    for s in (a, b):
        bm.free(s)
    repeat = Sequence("b2", list(b.prompt_token_ids), ONE)
    assert bm.allocate(repeat) and repeat.num_cached_tokens == 8
    assert events[-2:] == [("hit", "b2", repeat.block_table[:2]), ("allocate", "b2", repeat.block_table[2:])]
    assert bm.num_rejected_hits == 0


def test_a_hasher_that_raises_mid_commit_leaves_consistent_books():
    """The engine fails a sequence whose commit raises (step_guard); what commit did before
    the error -- here, adopting a twin and freeing the copy -- is still announced, so scrub
    hooks and the audit trail see the freed block, and the invariants hold."""
    def hasher(parent, tokens, extra, key):
        if tokens == (7, 7, 7, 7):
            raise ValueError("learner's hasher failed")
        return repr((parent, tokens, key)).encode()

    events = []
    bm = BlockManager(16, 4, hasher=hasher, enable_caching=True)
    bm.listeners.append(lambda ev, ids, seq: events.append((str(ev), seq.request_id, list(ids))))
    a = Sequence("a", [1, 2, 3, 4, 5], ONE)
    b = Sequence("b", [1, 2, 3, 4, 7, 7, 7, 7, 9], ONE)
    assert bm.allocate(a) and bm.allocate(b)
    copy = b.block_table[0]
    for s in (a, b):
        s.num_computed_tokens = s.num_tokens
    bm.commit(a)
    with pytest.raises(ValueError, match="learner"):
        bm.commit(b)
    assert ("adopt", "b", [a.block_table[0]]) in events and ("free", "b", [copy]) in events
    bm.check_invariants([a, b])
    bm.free(b)
    bm.free(a)
    bm.check_invariants([])
    assert bm.num_available == 16
