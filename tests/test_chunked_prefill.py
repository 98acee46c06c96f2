"""Chunked prefill: a prompt longer than the step's token budget is prefilled over several steps,
and nothing a tenant or an operator can observe differs from prefilling it in one piece.

Two engines share tiny-random's weights: ``whole`` (a budget larger than any prompt here) and
``chunked`` (a budget of a few blocks).  For every attention backend this machine runs:

* every step computes at most the budget, and a chunk that stops short of the prompt ends on a
  block boundary and returns no token;
* greedy tokens, the logits each token was sampled from, the block hashes and the K/V of every
  prompt block are those of the one-piece prefill;
* the lifecycle events (so the scrubs they trigger and the audit records) are the same blocks
  through the same transitions;
* a later request of the same tenant hits the same blocks; another tenant's hits none;
* mid-prefill, only the blocks already computed are registered: a request arriving then hits
  exactly those, never a block whose K/V a later chunk has yet to write.
"""
from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from minikv import LLM
from minikv.backends import BACKENDS
from minikv.engine import SamplingParams

BS, BUDGET = 4, 10
CHUNK = BUDGET // BS * BS  # the most a chunk that stops short may compute: 8
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engines(backend: str):
    whole = LLM("tiny-random", device="cpu", dtype="float32", attention_backend="reference", block_size=BS,
                num_blocks=256, max_num_seqs=8, max_num_batched_tokens=4096, enable_prefix_caching=True,
                cache_isolation="tenant", engine_secret=b"chunked-prefill-test-secret!")
    try:
        chunked = whole.fork(attention_backend=backend, max_num_batched_tokens=BUDGET)
        whole = whole.fork(attention_backend=backend)
    except (ValueError, RuntimeError) as exc:  # the registry refuses it on this machine, and says why
        pytest.skip(f"{backend}: {exc}")
    return whole.engine, chunked.engine


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 200) for _ in range(n)]


class Recorder:
    """Every batch the scheduler returns, and every block event, of one engine."""

    def __init__(self, engine):
        self.batches, self.events = [], []
        schedule = engine.scheduler.schedule

        def watched():
            batch = schedule()
            self.batches.append([(s.request_id, s.num_computed_tokens, s.num_scheduled_tokens, s.num_tokens, kind)
                                 for kind, seqs in (("prefill", batch.prefills), ("chunk", batch.chunks),
                                                    ("decode", batch.decodes)) for s in seqs])
            return batch
        engine.scheduler.schedule = watched
        engine.block_manager.listeners.append(
            lambda t, ids, seq: self.events.extend((str(t), b, seq.request_id if seq else None) for b in ids))
        engine.logit_trace = []


def _run(engine, requests) -> dict:
    """Add ``requests`` ((rid, ids, tenant)), run to the end; tokens and hashes per request."""
    seqs = {}
    for rid, ids, tenant in requests:
        engine.add_request(rid, ids, PARAMS, tenant=tenant)
        seqs[rid] = engine.requests[rid]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
        engine.check_invariants()
    return {rid: (list(done[rid].outputs[0].token_ids), list(seqs[rid].block_hashes), seqs[rid].num_cached_tokens)
            for rid in seqs}


def _sampled_rows(engine) -> dict[str, list[torch.Tensor]]:
    rows: dict = {}
    for step in engine.logit_trace:
        for rid, row in step.items():
            rows.setdefault(rid, []).append(row)
    return rows


@pytest.mark.parametrize("backend", [b for b in BACKENDS if b != "auto"])
def test_a_prompt_prefilled_in_chunks_is_the_prompt_prefilled_whole(backend):
    whole, chunked = _engines(backend)
    long = _prompt(62)  # 15 full blocks and two tokens: 7 chunks of 8, then the last 6
    rec = {e: Recorder(e) for e in (whole, chunked)}
    runs = {e: _run(e, [("a", long, "alice")]) for e in (whole, chunked)}
    assert runs[whole] == runs[chunked], "tokens, block hashes or cached count differ"
    # The chunks: within the budget, on block boundaries, no token before the last.
    steps = rec[chunked].batches
    prefill_steps = [b for b in steps if any(kind != "decode" for *_, kind in b)]
    assert len(prefill_steps) == 62 // CHUNK + 1 and len(rec[whole].batches[0]) == 1
    computed = 0
    for batch in prefill_steps:
        (rid, start, n, total, kind), = batch
        assert start == computed and n <= BUDGET
        computed += n
        assert kind == ("prefill" if computed == total else "chunk")
        if kind == "chunk":
            assert computed % BS == 0, f"a chunk ends at {computed}, not on a block boundary"
    assert computed == 62
    # The logits each token was sampled from; the K/V of every prompt block.
    rows_w, rows_c = _sampled_rows(whole), _sampled_rows(chunked)
    assert rows_w.keys() == rows_c.keys() and len(rows_c["a"]) == PARAMS.max_tokens
    for a, b in zip(rows_w["a"], rows_c["a"]):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    assert set(whole.block_manager.hash_table) == set(chunked.block_manager.hash_table)
    for h in runs[whole]["a"][1][:62 // BS]:
        bw, bc = whole.block_manager.hash_table[h], chunked.block_manager.hash_table[h]
        for cache in ("k_cache", "v_cache"):
            kw, kc = getattr(whole.pool, cache)[:, bw], getattr(chunked.pool, cache)[:, bc]
            assert (kw - kc).abs().max() <= 1e-4 * kw.abs().max(), f"{cache} of block {h.hex()[:8]} differs"
    # The same blocks through the same transitions (the scrubs and audit records follow them).
    assert Counter(rec[whole].events) == Counter(rec[chunked].events)
    # Hits afterwards: the same for alice, none for bob.
    later = [("a2", long[:48] + _prompt(9, seed=1), "alice"), ("b", long, "bob")]
    after = {e: _run(e, later) for e in (whole, chunked)}
    assert after[whole] == after[chunked]
    assert after[chunked]["a2"][2] == 48 and after[chunked]["b"][2] == 0


def test_mid_prefill_only_computed_blocks_are_registered_and_hit():
    whole, chunked = _engines("reference")
    long = _prompt(61)  # 7 chunks of 8 leave 5 tokens
    chunked.add_request("a", long, PARAMS, tenant="alice")
    seq = chunked.requests["a"]
    for step in range(1, 4):
        assert chunked.step() == [], "a chunk that stops short returns no token"
        assert seq.num_computed_tokens == step * CHUNK
        registered = {h for h in chunked.block_manager.hash_table}
        assert registered == set(seq.block_hashes[:step * CHUNK // BS]), \
            "registered blocks must be exactly the ones computed so far"
    # Arriving now, a same-tenant request with the same prompt hits what is computed when it is
    # admitted, no more; another tenant's hits nothing.
    admitted = {}
    chunked.scheduler.on_admit = lambda s: admitted.setdefault(
        s.request_id, (s.num_cached_tokens, seq.num_computed_tokens, len(chunked.block_manager.hash_table)))
    chunked.add_request("a-again", long, PARAMS, tenant="alice")
    chunked.add_request("b", long, PARAMS, tenant="bob")
    done = {}
    while chunked.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in chunked.step() if o.finished})
    alone = _run(whole, [("a", long, "alice")])["a"][0]
    assert done == {"a": alone, "a-again": alone, "b": alone}
    cached, computed_by_a, _ = admitted["a-again"]
    assert cached == min(computed_by_a, (61 - 1) // BS * BS) and cached >= 3 * CHUNK
    assert admitted["b"][0] == 0
    chunked.check_invariants()


def test_a_chunked_prefill_preempted_mid_way_is_recomputed_right():
    whole, chunked = _engines("reference")
    tight = chunked.fork(num_blocks=21, max_num_batched_tokens=BUDGET)
    prompts = [("p0", _prompt(40, seed=2), "alice"), ("p1", _prompt(44, seed=3), "bob"),
               ("p2", _prompt(30, seed=4), "carol")]
    got = {rid: out[0] for rid, out in _run(tight, prompts).items()}
    assert tight.stats["preemptions"] > 0, "the pool was meant to be too small for all three"
    want = {rid: _run(whole, [(rid, ids, t)])[rid][0] for rid, ids, t in prompts}
    assert got == want
