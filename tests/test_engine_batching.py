"""Batching must not change results; continuous batching must be real; a full pool preempts."""
from __future__ import annotations

import random

import pytest

from minikv import LLM, SamplingParams
from tests.engine_helpers import compare_with_ties

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def _prompts(tok, n, seed=0):
    rng = random.Random(seed)
    words = "cache block token tenant secret prefix model attention memory pool key value".split()
    return [tok(" ".join(rng.choice(words) for _ in range(rng.randint(3, 40)))).input_ids for _ in range(n)]


def _alone(name, prompts, params, **kw):
    """Each prompt on its own engine run, with the reference logits of every step."""
    llm = LLM(name, dtype="float32", device="cpu", **kw)
    llm.engine.logit_trace = []
    results = []
    for p in prompts:
        start = len(llm.engine.logit_trace)
        out = llm.generate([p], params)[0]
        logits = [t[out.request_id] for t in llm.engine.logit_trace[start:]]
        results.append((out.outputs[0].token_ids, logits))
    return results


@pytest.mark.parametrize("name", ["tiny-random", pytest.param("smollm2-135m-instruct", marks=pytest.mark.model)])
def test_batched_equals_alone(name):
    llm = LLM(name, dtype="float32", device="cpu", block_size=8)
    prompts = _prompts(llm.get_tokenizer(), 6)
    alone = _alone(name, prompts, GREEDY, block_size=8)
    batched = llm.generate(prompts, GREEDY)
    ties = []
    for i, (out, (ref, ref_logits)) in enumerate(zip(batched, alone)):
        compare_with_ties(out.outputs[0].token_ids, ref, ref_logits, f"{name} prompt {i}", ties)
    for t in ties:
        print("TIE:", t)


def test_continuously_batched_equals_alone_and_seeded_sampling():
    """Requests joining mid-flight (staggered arrivals) get the same tokens as alone, including
    seeded sampling, which must not depend on who else is in the batch."""
    name = "tiny-random"
    llm = LLM(name, dtype="float32", device="cpu", block_size=4)
    prompts = _prompts(llm.get_tokenizer(), 5, seed=1)
    params = [GREEDY, SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)] * 3
    alone = [_alone(name, [p], sp, block_size=4)[0] for p, sp in zip(prompts, params)]
    eng, finished = llm.engine, {}
    for step in range(200):
        if step % 3 == 0 and step // 3 < len(prompts):
            i = step // 3
            eng.add_request(f"r{i}", prompts[i], params[i])
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].token_ids
        if len(finished) == len(prompts):
            break
    ties = []
    for i, (ref, ref_logits) in enumerate(alone):
        compare_with_ties(finished[f"r{i}"], ref, ref_logits, f"staggered {i}", ties)
    for t in ties:
        print("TIE:", t)


def test_continuous_batching_step_trace():
    """A request added while others decode gets its first token before they finish."""
    llm = LLM("tiny-random", device="cpu")
    eng = llm.engine
    long = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eng.add_request("early-1", "the first request", long)
    eng.add_request("early-2", "the second request", long)
    first_token, finished = {}, {}
    for step in range(1, 100):
        if step == 5:
            eng.add_request("late", "a late arrival", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        for out in eng.step():
            first_token.setdefault(out.request_id, step)
            if out.finished:
                finished[out.request_id] = step
        if not eng.has_unfinished_requests():
            break
    assert first_token["late"] == 5, first_token
    assert first_token["late"] < min(finished["early-1"], finished["early-2"])
    assert finished["late"] < finished["early-1"]
    # The late request was prefilled in the same step as the others decoded: one mixed batch.
    assert eng.stats["steps"] == max(finished.values())


def test_full_pool_preempts_and_recomputes():
    name = "tiny-random"
    prompts = _prompts(LLM(name, device="cpu").get_tokenizer(), 4, seed=3)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    roomy = LLM(name, dtype="float32", device="cpu", block_size=4).generate(prompts, params)
    tight = LLM(name, dtype="float32", device="cpu", block_size=4, num_blocks=100)
    outs = tight.generate(prompts, params)
    assert tight.engine.stats["preemptions"] > 0, "the pool was meant to overflow"
    assert any(o.num_preemptions for o in outs)
    for a, b in zip(roomy, outs):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
    tight.engine.check_invariants()
    assert tight.engine.block_manager.num_available == 100


@pytest.mark.parametrize("name", ["tiny-random", pytest.param("smollm2-135m-instruct", marks=pytest.mark.model)])
def test_prefix_caching_on_off_identical(name):
    off = LLM(name, dtype="float32", device="cpu", enable_prefix_caching=False)
    on = LLM(name, dtype="float32", device="cpu", enable_prefix_caching=True)
    system = "You are a helpful assistant. Answer briefly and accurately. " * 4
    prompts = [system + q for q in ("What is a KV cache?", "Name a colour.", "What is 2+2?")]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    ref = off.generate(prompts, params)
    first = on.generate(prompts[:1], params)
    rest = on.generate(prompts, params)
    assert first[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens == 0 for o in ref)
    assert all(o.num_cached_tokens >= 16 for o in rest), [o.num_cached_tokens for o in rest]
    assert all(o.num_cached_tokens % 16 == 0 for o in rest)
    for a, b in zip(ref, rest):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_hit_leaves_at_least_one_token_to_compute():
    llm = LLM("tiny-random", device="cpu", enable_prefix_caching=True, block_size=4)
    ids = list(range(5, 21))  # exactly 4 full blocks
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([ids], params)
    again = llm.generate([ids], params)[0]
    assert again.num_cached_tokens == 12  # capped: the last block is recomputed
    assert again.outputs[0].token_ids == llm.generate([ids], params)[0].outputs[0].token_ids
