"""Bad input gets a clear error naming the value, corrupts nothing, and the engine keeps serving."""
from __future__ import annotations

import pytest

from minikv import LLM, EngineConfig, SamplingParams

P = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", device="cpu", block_size=4, num_blocks=64, max_model_len=200)


def _serving_still_works(llm, reference):
    out = llm.generate("still serving", P)[0]
    assert out.outputs[0].token_ids == reference
    llm.engine.check_invariants()
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.block_manager.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("prompt,params,tenant,exc,match", [
    ("", P, None, ValueError, "empty"),
    ([[]], P, None, ValueError, "empty"),
    ([5, 99999], P, None, ValueError, "99999"),
    ([5, -1], P, None, ValueError, "-1"),
    ("x" * 400, P, None, ValueError, "max_model_len"),
    ("hello", P, 42, TypeError, "int"),
    ("hello", P, b"bytes", TypeError, "bytes"),
    (3.5, P, None, TypeError, "float"),
])
def test_bad_requests_raise_and_engine_keeps_serving(llm, prompt, params, tenant, exc, match):
    reference = llm.generate("still serving", P)[0].outputs[0].token_ids
    llm.engine.add_request("running-neighbour", "a neighbour that is mid-flight", P, tenant="n")
    llm.engine.step()
    with pytest.raises(exc, match=match):
        llm.generate(prompt, params, tenant=tenant)
    while llm.engine.has_unfinished_requests():  # the neighbour finishes normally
        for out in llm.engine.step():
            if out.finished:
                assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 3
    _serving_still_works(llm, reference)


def test_batch_with_one_bad_prompt_adds_nothing(llm):
    with pytest.raises(ValueError, match="123456"):
        llm.generate(["good one", [1, 123456]], P)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.check_invariants()


def test_prompt_longer_than_pool():
    llm = LLM("tiny-random", device="cpu", block_size=4, num_blocks=8)
    with pytest.raises(ValueError, match="whole pool holds 32"):
        llm.generate("y" * 40, P)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(max_tokens=0), ValueError, "max_tokens must be > 0, got 0"),
    (dict(max_tokens=-3), ValueError, "-3"),
    (dict(max_tokens=2.5), TypeError, "float"),
    (dict(temperature=-1.0), ValueError, "-1.0"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_k=-5), ValueError, "-5"),
    (dict(stop=[""]), ValueError, "stop"),
    (dict(n=2), ValueError, "n=2"),
])
def test_bad_sampling_params(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(cache_isolation="tenants"), ValueError, "'tenants'"),
    (dict(hash_algo="md5"), ValueError, "'md5'"),
    (dict(scrub="sometimes"), ValueError, "'sometimes'"),
    (dict(verify_hits="yes"), ValueError, "'yes'"),
    (dict(block_size=0), ValueError, "block_size must be > 0, got 0"),
    (dict(block_size="16"), TypeError, "str"),
    (dict(dtype="float8"), ValueError, "'float8'"),
    (dict(engine_secret=b"short"), ValueError, "5"),
    (dict(engine_secret="text-secret-that-is-long"), TypeError, "str"),
])
def test_bad_settings(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        EngineConfig(model="tiny-random", **kwargs)


def test_unknown_model_and_abort_of_unknown_request(llm):
    with pytest.raises(ValueError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ValueError, match="'nope'"):
        llm.engine.abort_request("nope")


def test_duplicate_request_id_and_abort_frees_blocks(llm):
    eng = llm.engine
    eng.add_request("dup", "first", P)
    with pytest.raises(ValueError, match="'dup'"):
        eng.add_request("dup", "second", P)
    eng.step()
    eng.abort_request("dup")
    assert not eng.has_unfinished_requests()
    eng.check_invariants()
    assert eng.block_manager.num_free_blocks == eng.num_blocks


def test_stop_strings_seed_and_eos():
    llm = LLM("tiny-random", device="cpu")
    sampled = SamplingParams(max_tokens=12, temperature=1.0, seed=123, ignore_eos=True)
    a = llm.generate("seeded", sampled)[0].outputs[0]
    b = llm.generate("seeded", sampled)[0].outputs[0]
    assert a.token_ids == b.token_ids
    greedy = llm.generate("stop here", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].outputs[0]
    stop = greedy.text[3:5]
    cut = llm.generate("stop here", SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop]))[0].outputs[0]
    assert cut.finish_reason == "stop" and stop not in cut.text and greedy.text.startswith(cut.text)
    st = llm.generate("stop here", SamplingParams(max_tokens=5, temperature=0.0,
                                                  stop_token_ids=[greedy.token_ids[0]]))[0].outputs[0]
    assert st.finish_reason == "stop" and st.token_ids == greedy.token_ids[:1]
