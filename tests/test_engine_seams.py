"""The engine's test-only seams (engine/seams.py): each warns when installed, is gone when removed,
and nothing a user or a client can reach (CLI flags, server, config fields) names one.

Lesson 05's buggy engine is built on these seams (``minikv.attacks.engine_bugs``); the fault
injector's own behaviour is tested in test_engine_faults.py.
"""
from __future__ import annotations

import dataclasses
import re
import warnings
from pathlib import Path

import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.attacks.engine_bugs import buggy_abort_release, buggy_context_mask
from minikv.engine.config import EngineConfig
from minikv.engine.seams import SeamWarning

SEAMS = ("fault_injector", "decode_mask", "kv_read_observer", "abort_release")
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = {"alice": "alice asks about the weather", "bob": "bob wants a poem about the cache",
           "carol": "carol"}
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def donor():
    return LLM("tiny-random", device="cpu", block_size=4, num_blocks=64, max_num_seqs=8)


def _run(engine, prompts=PROMPTS, max_steps=200):
    """Every prompt at once, stepped to the end, with the logits of every step recorded."""
    engine.logit_trace = []
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY, tenant=rid)
    done = {}
    for _ in range(max_steps):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            trace, engine.logit_trace = engine.logit_trace, None
            return done, trace
    raise AssertionError("the engine did not finish its requests")


def _install(engine, name, fn):
    with pytest.warns(SeamWarning, match="test-only seam"):
        getattr(engine, f"set_{name}")(fn)


@pytest.mark.parametrize("name", SEAMS)
def test_installing_a_seam_warns_and_none_removes_it(donor, name):
    engine = donor.fork().engine
    assert getattr(engine, name) is None  # off on a normal engine
    fn = lambda *args: None  # noqa: E731
    with pytest.warns(RuntimeWarning, match="test-only seam"):  # SeamWarning is a RuntimeWarning
        getattr(engine, f"set_{name}")(fn)
    assert getattr(engine, name) is fn
    assert getattr(engine.fork(), name) is None  # a fork starts clean
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # removing one is silent
        getattr(engine, f"set_{name}")(None)
    assert getattr(engine, name) is None
    with pytest.raises(TypeError, match="callable"):
        getattr(engine, f"set_{name}")("not a function")


def test_removing_the_decode_seams_restores_the_engine(donor):
    reference, ref_trace = _run(donor.fork().engine)
    engine = donor.fork().engine
    gathered = []
    _install(engine, "decode_mask", buggy_context_mask)
    _install(engine, "kv_read_observer", lambda layer, tables, lens, k, v: gathered.append((layer, k.shape)))
    buggy, bug_trace = _run(engine)
    layers = engine.model.shape.num_layers
    assert gathered and {layer for layer, _ in gathered} == set(range(layers))  # every decode gather seen
    assert all(k[0] == len(PROMPTS) for _, k in gathered[:layers])  # the first decode step: everyone
    assert any(not torch.equal(a[r], b[r]) for a, b in zip(ref_trace, bug_trace) for r in a)  # the bug bites
    engine.set_decode_mask(None)
    engine.set_kv_read_observer(None)
    n = len(gathered)
    again, _ = _run(engine)
    assert again == reference  # same tokens as an engine that never had the seams
    assert len(gathered) == n  # the observer is gone too


def _two_sharers(engine):
    """alice's r1 runs; r2 hits r1's full prompt blocks; both are running."""
    prompt = "alice's long prompt, shared by a retry of the same request"
    engine.add_request("r1", prompt, GREEDY, tenant="alice")
    engine.step()
    engine.add_request("r2", prompt, GREEDY, tenant="alice")
    engine.step()
    shared = engine.requests["r1"].block_table[:2]
    assert engine.requests["r2"].block_table[:2] == shared
    return shared


def _finish(engine):
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return done


def test_the_abort_seam_runs_on_abort_only_and_removing_it_restores_the_engine(donor):
    never = donor.fork(enable_prefix_caching=True).engine
    _two_sharers(never)
    never.abort_request("r1")
    never.check_invariants()
    reference = _finish(never)

    engine = donor.fork(enable_prefix_caching=True).engine
    seen = []
    _install(engine, "abort_release", lambda bm, seq: seen.append(seq.request_id))  # releases nothing
    engine.add_request("w", "a request that never runs", GREEDY, tenant="bob")
    engine.abort_request("w")  # still waiting: it holds no blocks, the seam is not called
    _two_sharers(engine)
    engine.abort_request("r1")
    assert seen == ["r1"]  # ... and the normal path released what the seam left
    engine.check_invariants()
    assert _finish(engine) == reference and seen == ["r1"]  # finishes never reach it

    engine = donor.fork(enable_prefix_caching=True).engine
    _install(engine, "abort_release", buggy_abort_release)
    engine.set_abort_release(None)
    _two_sharers(engine)
    engine.abort_request("r1")
    engine.check_invariants()
    assert _finish(engine) == reference


def test_no_seam_is_reachable_from_the_command_line_the_server_or_the_config():
    sources = [ROOT / "minikv" / "cli.py", ROOT / "minikv" / "engine" / "cli_flags.py",
               *sorted((ROOT / "minikv" / "serve").rglob("*.py"))]
    pattern = re.compile("|".join(SEAMS) + r"|\bseams?\b", re.IGNORECASE)
    hits = [f"{p.relative_to(ROOT)}:{i}" for p in sources
            for i, line in enumerate(p.read_text().splitlines(), 1) if pattern.search(line)]
    assert hits == []
    assert not {f.name for f in dataclasses.fields(EngineConfig)} & set(SEAMS)
