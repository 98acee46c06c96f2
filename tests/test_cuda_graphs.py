"""Decode-only steps through the CUDA-graph runner compute what the eager fused path computes.

On the CPU there are no graphs, but the runner's whole static-buffer logic (buckets, padding
rows, the scratch block, RoPE and mask built inside the captured function from the static
buffer) runs with the ``"eager"`` capture strategy: the captured function is called on every
"replay".  Two engines with the same weights are driven through the same schedule -- batches
that need padding (3 -> 4, 5 -> 8), contexts that cross width buckets, prefills arriving later
(those steps run eagerly) -- and must agree: logits within 1e-4 of the largest logit, the same
greedy tokens, the same K/V bytes in every real block.  The tests named ``cuda`` run the same
with real graphs where a GPU is present (``scripts/gpu_check.py`` runs them).
"""
from __future__ import annotations

import argparse
import random
from types import SimpleNamespace

import pytest
import torch

from minikv import LLM
from minikv.engine import SamplingParams
from minikv.engine.cli_flags import add_engine_arguments, engine_kwargs_from_args
from minikv.backends.cuda_graphs import INPUTS, DecodeGraphRunner, batch_buckets, bucket, width_buckets
from tests.engine_helpers import assert_traces_close

TOL = 1e-4  # of the largest absolute logit, as tests/test_attention_fused.py


def _pair(device, dtype="float32", capture=None):
    """(graph engine, eager engine): same weights, fused backend, 8 sequences at most, 4-token
    blocks, contexts up to 64 tokens (width buckets 1, 2, 4, 8, 16)."""
    base = LLM("tiny-random", device=device, dtype=dtype, attention_backend="fused", block_size=4,
               num_blocks=96, max_num_seqs=8, max_model_len=64, enable_prefix_caching=True)
    eager = base.fork(enforce_eager=True).engine
    graph = base.engine
    if capture is not None:  # CPU: force the runner in, with the strategy given
        graph.backend.graphs = DecodeGraphRunner(graph, capture=capture)
    return graph, eager


def _drive(engine, seed=0):
    """Three requests decode together (padded to 4), two more join (a step with prefills), then
    five decode (padded to 8) while they finish one by one.  Returns (logit trace, tokens,
    per-step checks made on the way)."""
    rng = random.Random(seed)
    vocab = engine.model.shape.vocab_size
    engine.logit_trace = []
    checks = {"pad_zero": True, "scratch_in_table": False}

    def add(name, n, max_tokens):
        engine.add_request(name, [rng.randrange(3, vocab) for _ in range(n)],
                           SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))

    def step():
        out = engine.step()
        check_reserved_blocks(engine, checks)
        return out

    for i, (n, m) in enumerate([(7, 30), (3, 14), (12, 22)]):
        add(f"a{i}", n, m)
    for _ in range(6):
        step()
    add("late0", 9, 20)
    add("late1", 26, 25)
    tokens = {}
    while engine.has_unfinished_requests():
        for out in step():
            if out.finished:
                tokens[out.request_id] = out.outputs[0].token_ids
    return engine.logit_trace, tokens, checks


def check_reserved_blocks(engine, checks: dict) -> None:
    """After a step: the pad block is still all zero, and no running table names the pad or the
    scratch block (padded graph rows write the scratch block; nobody may own either)."""
    pool = engine.pool
    pad, scratch = pool.pad_block, pool.scratch_block
    checks["pad_zero"] &= bool(pool._k[:, pad].eq(0).all() and pool._v[:, pad].eq(0).all())
    tables = [b for s in engine.scheduler.running for b in s.block_table]
    checks["scratch_in_table"] |= scratch in tables or pad in tables


def _compare(trace_g, tokens_g, trace_e, tokens_e, tol=TOL):
    assert tokens_g == tokens_e and len(tokens_g) == 5
    assert_traces_close(trace_e, trace_g, tol)


def _same_kv(pool_g, pool_e):
    """Every real block's K/V as the eager run left them: the same slots written (a padded row
    writing into someone's block, or a free one, changes the pattern or the values) and values
    within 1e-4 of the largest.  Not bit for bit: from the second layer on, K/V depend on
    attention, which the eager path runs over other key lengths (its own decode groups, no
    width bucket), so they may differ in the last bits."""
    for g, e in ((pool_g.k_cache, pool_e.k_cache), (pool_g.v_cache, pool_e.v_cache)):
        assert torch.equal(g != 0, e != 0)
        assert (g - e).abs().max().item() <= TOL * e.abs().max().item()


def _spy(runner):
    """Record (batch, widest table) of every step the runner is asked to run, and check the block
    tables it put in the static buffer: each row its own table padded with the pad block, padded
    rows all pad block (never block 0, never someone else's block); a wrong one is recorded as
    ``(batch, "bad tables")``, not raised (the engine would turn a raise into failed requests)."""
    seen, run = [], runner.run

    def spying_run(decodes):
        b, w = len(decodes), max(len(s.block_table) for s in decodes)
        seen.append((b, w))
        out = run(decodes)
        nb, nw = bucket(runner.batch_sizes, b), bucket(runner.widths, w)
        tables = runner._static[nb * INPUTS: nb * (INPUTS + nw)].view(nb, nw).tolist()
        pad = runner.pool.pad_block
        if tables != [s.block_table + [pad] * (nw - len(s.block_table)) for s in decodes] + [[pad] * nw] * (nb - b):
            seen.append((b, "bad tables"))
        return out
    runner.run = spying_run
    return seen


def test_graph_runner_matches_the_eager_fused_path_with_padding_and_width_buckets():
    graph, eager = _pair("cpu", capture="eager")
    seen = _spy(graph.backend.graphs)
    trace_g, tokens_g, checks = _drive(graph)
    trace_e, tokens_e, _ = _drive(eager)
    assert not [x for x in seen if x[1] == "bad tables"]
    _compare(trace_g, tokens_g, trace_e, tokens_e)
    # the schedule exercised what it claims: padded batches 3 -> 4 and 5 -> 8, widths crossing buckets
    r = graph.backend.graphs
    assert {b for b, _ in seen} >= {3, 5} and {(3, 4), (5, 8)} <= {(b, bucket(r.batch_sizes, b)) for b, _ in seen}
    assert len({bucket(r.widths, w) for b, w in seen if b == 3}) >= 2
    assert len(seen) < len(trace_g)  # the steps with a prefill ran the eager path
    # padded rows wrote the scratch block, never the pad block, never a real one
    assert checks == {"pad_zero": True, "scratch_in_table": False}
    assert graph.pool._k[:, graph.pool.scratch_block].abs().sum() > 0  # padded rows did write somewhere
    _same_kv(graph.pool, eager.pool)
    # one capture per bucket pair, reused afterwards
    keys = {(bucket(r.batch_sizes, b), bucket(r.widths, w)) for b, w in seen}
    assert set(r.graphs) == keys and r.captures == len(keys) and r.replays == len(seen) > len(keys)


def test_a_bucket_is_captured_once_and_reused():
    graph, _ = _pair("cpu", capture="eager")
    made = []
    strategy = graph.backend.graphs.capture
    graph.backend.graphs.capture = lambda fn: made.append(fn) or strategy(fn)
    p = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    for i in range(3):
        graph.add_request(f"r{i}", [5 + i, 6, 7, 8], p)  # decode contexts 5-9 tokens: 2 blocks, 3 -> 4 rows
    while graph.has_unfinished_requests():
        graph.step()
    assert [k for k in graph.backend.graphs.graphs] == [(4, 2)] and len(made) == graph.backend.graphs.captures == 1
    assert graph.backend.graphs.replays == 4  # five tokens: one from the prefill, four decode-only steps


def test_engines_off_cuda_or_eager_have_no_runner_and_buckets_have_vllms_form():
    assert LLM("tiny-random", device="cpu").engine.backend.graphs is None
    cpu = LLM("tiny-random", device="cpu", attention_backend="fused").engine

    def fake(**kw):  # an engine that claims CUDA: nothing touches the device before the first step
        c = dict(device=torch.device("cuda"), attention_backend="fused", enforce_eager=False)
        c.update(kw)
        return SimpleNamespace(device=c["device"], attention_backend=c["attention_backend"], model=cpu.model,
                               pool=cpu.pool, block_size=16, max_model_len=2048, num_blocks=1000,
                               config=SimpleNamespace(enforce_eager=c["enforce_eager"], max_num_seqs=40))
    r = DecodeGraphRunner.for_engine(fake())
    assert r.batch_sizes == [1, 2, 4, 8, 16, 24, 32, 40] and r.widths == [1, 2, 4, 8, 16, 32, 64, 128]
    for kw in (dict(enforce_eager=True), dict(attention_backend="reference"), dict(device=torch.device("cpu"))):
        assert DecodeGraphRunner.for_engine(fake(**kw)) is None, kw
    assert batch_buckets(3) == [1, 2, 3] and batch_buckets(10) == [1, 2, 4, 8, 10] and width_buckets(5) == [1, 2, 4, 5]
    assert width_buckets(1) == [1] and bucket([1, 2, 4], 3) == 4 and bucket([1, 2, 4], 5) is None
    with pytest.raises(ValueError, match="capture='graph'"):
        DecodeGraphRunner(cpu, capture="graph")


def test_enforce_eager_is_a_bool_setting_and_a_flag():
    with pytest.raises(TypeError, match="enforce_eager must be a bool, got str \\('yes'\\)"):
        LLM("tiny-random", device="cpu", enforce_eager="yes")
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    assert engine_kwargs_from_args(p.parse_args(["--model", "m", "--enforce-eager"]))["enforce_eager"] is True
    assert "enforce_eager" not in engine_kwargs_from_args(p.parse_args(["--model", "m"]))


def test_the_pool_has_a_scratch_block_outside_what_lessons_see():
    eng = LLM("tiny-random", device="cpu", num_blocks=10).engine
    pool = eng.pool
    assert (pool.pad_block, pool.scratch_block) == (10, 11) and pool._k.shape[1] == 12
    assert pool.k_cache.shape[1] == pool.v_cache.shape[1] == 10 and pool.k_blocks[0].shape[0] == 12
    assert pool.k_slots[0].shape[0] == 12 * eng.block_size and pool.nbytes == pool.k_cache.nbytes * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [("float32", TOL), ("bfloat16", 0.02)])
def test_cuda_graphs_match_the_eager_fused_path(dtype, tol):
    """Real graphs: the runner is there by default on CUDA, captures, replays and agrees (bf16:
    within 2% of the largest logit, as the fused-vs-reference bf16 test; tokens may then differ)."""
    graph, eager = _pair("cuda", dtype)
    assert isinstance(graph.backend.graphs, DecodeGraphRunner) and eager.backend.graphs is None
    seen = _spy(graph.backend.graphs)
    trace_g, tokens_g, checks = _drive(graph)
    trace_e, tokens_e, _ = _drive(eager)
    assert not [x for x in seen if x[1] == "bad tables"]
    r = graph.backend.graphs
    print(f"cuda graphs {dtype}: {r.captures} captures, {r.replays} replays")
    assert r.captures == len(r.graphs) >= 2 and r.replays == len(seen) > r.captures
    assert checks == {"pad_zero": True, "scratch_in_table": False}
    if dtype == "float32":
        _compare(trace_g, tokens_g, trace_e, tokens_e, tol)
        _same_kv(graph.pool, eager.pool)
    else:  # a near-tie can flip a greedy token in bf16: compare steps up to the first flip
        for step_g, step_e in zip(trace_g, trace_e):
            for rid, row in step_e.items():
                assert (row - step_g[rid]).abs().max().item() <= tol * row.abs().max().item(), rid
            if any(int(row.argmax()) != int(step_g[rid].argmax()) for rid, row in step_e.items()):
                break
