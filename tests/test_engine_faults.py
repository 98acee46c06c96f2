"""A failure inside step() stays with the sequence that caused it (engine/step_guard.py).

Each test runs a few tenants' greedy requests with and without one faulty request and checks
that everyone else gets exactly the same tokens, the faulty one finishes with reason "error"
and a message, the pool's bookkeeping holds, and the engine keeps serving afterwards.
"""
from __future__ import annotations

import re
import warnings

import pytest

from minikv import LLM, SamplingParams
from minikv.engine.step_guard import STAGES

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
GOOD = {"alice": "alice asks about the weather", "bob": "bob wants a poem about cache",
        "carol": "carol: summarise this memo", "dave": "dave says hello"}
MALLORY = "mallory's request, the one that breaks"


@pytest.fixture(scope="module")
def donor():
    return LLM("tiny-random", device="cpu", block_size=4, num_blocks=96, max_num_seqs=8)


def _run(engine, requests, params=GREEDY, max_steps=200):
    """Add every (request id, prompt, tenant) at once, step to the end; {id: CompletionOutput}."""
    for rid, prompt, tenant in requests:
        engine.add_request(rid, prompt, params, tenant=tenant)
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if not engine.has_unfinished_requests():
            return done
    raise AssertionError("the engine did not finish its requests (wedged?)")


def _good(tenants=GOOD):
    return [(t, prompt, t) for t, prompt in tenants.items()]


def _with_mallory():
    good = _good()
    return good[:2] + [("mallory", MALLORY, "mallory")] + good[2:]  # mid-batch


@pytest.fixture(scope="module")
def reference(donor):
    """The good tenants' tokens on a fresh engine without the faulty request."""
    return {rid: out.token_ids for rid, out in _run(donor.fork().engine, _good()).items()}


def _fault_at(stage, after_tokens=2):
    """An injector that fails mallory's request at ``stage`` once it has ``after_tokens`` tokens."""
    def injector(at, seq):
        if at == stage and seq.tenant == "mallory" and len(seq.output_token_ids) >= after_tokens:
            raise RuntimeError(f"injected fault in {stage}")
    return injector


def _assert_healthy(engine, donor):
    engine.check_invariants()
    assert not engine.scheduler.running and not engine.scheduler.waiting
    assert engine.block_manager.num_available == engine.num_blocks
    fresh = _run(donor.fork().engine, [("after", "a normal request afterwards", "erin")])
    again = _run(engine, [("after", "a normal request afterwards", "erin")])
    assert again["after"].token_ids == fresh["after"].token_ids and again["after"].finish_reason == "length"


@pytest.mark.parametrize("stage", STAGES)
def test_one_failing_sequence_fails_alone(donor, reference, stage):
    engine = donor.fork().engine
    with pytest.warns(RuntimeWarning, match="test-only"):
        engine.set_fault_injector(_fault_at(stage))
    done = _run(engine, _with_mallory())
    for rid, tokens in reference.items():
        assert done[rid].token_ids == tokens, f"{rid}'s tokens changed because of mallory's failure"
        assert done[rid].finish_reason == "length" and done[rid].error is None
    bad = done["mallory"]
    assert bad.finish_reason == "error"
    assert stage in bad.error and "injected fault" in bad.error and "RuntimeError" in bad.error
    assert len(bad.token_ids) == 2  # it failed mid-generation, keeping what it had produced
    assert engine.stats["failed"] == 1
    engine.set_fault_injector(None)
    _assert_healthy(engine, donor)


def test_a_prefill_that_fails_caches_nothing(donor):
    """A sequence that fails in its first forward never commits: none of its K/V (possibly half
    written) is registered in the prefix cache, so no later request can hit it."""
    engine = donor.fork(enable_prefix_caching=True).engine
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        engine.set_fault_injector(_fault_at("forward", after_tokens=0))
    done = _run(engine, _with_mallory())
    assert done["mallory"].finish_reason == "error" and done["mallory"].token_ids == []
    assert not any(b.writer_tenant == "mallory" and b.hash is not None for b in engine.block_manager.blocks)
    engine.set_fault_injector(None)
    again = _run(engine, [("mallory-2", MALLORY, "mallory")])
    assert again["mallory-2"].finish_reason == "length"
    engine.check_invariants()


def test_forward_failure_is_retried_sequence_by_sequence(donor, reference):
    """A batched forward that raises is run again one sequence at a time: only the sequence
    whose own forward raises again fails; a fault that happens only once fails nobody."""
    engine = donor.fork().engine
    calls = {"batched": 0}

    def once(at, seq):  # a transient fault: the first batched forward that contains bob
        if at == "forward" and seq.tenant == "bob" and len(seq.output_token_ids) == 3 and not calls["batched"]:
            calls["batched"] += 1
            raise RuntimeError("transient")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        engine.set_fault_injector(once)
    done = _run(engine, _good())
    assert calls["batched"] == 1
    assert {rid: out.token_ids for rid, out in done.items()} == reference
    assert all(out.finish_reason == "length" for out in done.values())
    _assert_healthy(engine, donor)


def test_nan_temperature_set_after_validation_does_not_wedge_the_engine(donor, reference):
    """The old failure for real (no injector): a request whose temperature became NaN after
    SamplingParams checked it makes torch.multinomial raise.  It used to fail the whole step
    and stay in the batch, so every later step() raised too."""
    engine = donor.fork().engine
    poisoned = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    poisoned.temperature = float("nan")  # dataclasses do not re-validate on assignment
    for rid, prompt, tenant in _good():
        engine.add_request(rid, prompt, GREEDY, tenant=tenant)
    engine.add_request("mallory", MALLORY, poisoned, tenant="mallory")
    done = _run(engine, [])
    assert done["mallory"].finish_reason == "error" and "sample" in done["mallory"].error
    assert {rid: done[rid].token_ids for rid in reference} == reference
    _assert_healthy(engine, donor)


def test_tiny_positive_temperature_is_greedy(donor, reference):
    """1e-50 is a valid temperature (>= 0) that is 0 in fp32: dividing by it gave inf/NaN rows
    and torch.multinomial raised.  Below GREEDY_EPS it now means greedy, as in vLLM."""
    for t in (1e-50, 1e-320, 1e-6):
        params = SamplingParams(max_tokens=8, temperature=t, ignore_eos=True, seed=1)
        assert params.greedy
        done = _run(donor.fork().engine, _good(), params)
        assert {rid: out.token_ids for rid, out in done.items()} == reference


def test_a_learners_hasher_that_raises_in_commit_fails_only_its_request(donor):
    """The hasher is a seam learners fill in.  One that crashes on some block content (here: a
    block of four 'z's) fails the request that produced it, in the commit stage."""
    from minikv.security.hashing import make_hasher
    real = make_hasher("sha256", b"0" * 32)
    zzzz = tuple(donor.get_tokenizer()("zzzz", add_special_tokens=False).input_ids)

    def fragile(parent, tokens, extra, key):
        if tokens == zzzz:
            raise ValueError("this hasher cannot hash that block")
        return real(parent, tokens, extra, key)
    engine = donor.fork(enable_prefix_caching=True, block_hasher=fragile).engine
    reference = _run(donor.fork(enable_prefix_caching=True).engine, _good())
    done = _run(engine, _good() + [("mallory", "abcdzzzzq", "mallory")])
    assert done["mallory"].finish_reason == "error" and "commit" in done["mallory"].error
    assert {rid: done[rid].token_ids for rid in reference} == {r: o.token_ids for r, o in reference.items()}
    engine.check_invariants()


def test_the_fault_injector_is_not_reachable_from_the_command_line(donor):
    from minikv.cli import build_parser
    parser = build_parser()
    texts = [parser.format_help()]
    for action in parser._subparsers._group_actions:  # every subcommand's --help
        texts += [sub.format_help() for sub in action.choices.values()]
    assert not any(re.search(r"\bfault|inject", t, re.IGNORECASE) for t in texts)  # ("default" is fine)
    with pytest.raises(TypeError, match="callable"):
        donor.fork().engine.set_fault_injector("not a function")
