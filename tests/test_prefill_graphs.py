"""One-sequence prefill steps (prefix hits and misses) through the prefill graph runner compute
what the eager fused path computes.

As ``tests/test_cuda_graphs.py`` does for decodes: on the CPU the runner's static-buffer logic
(token and width buckets, padding rows after the real ones, their writes to the scratch block,
the hit's mask and RoPE built inside the captured function) runs with the ``"eager"`` capture
strategy, and two engines with the same weights driven through one schedule must agree: logits
within 1e-4 of the largest, the same greedy tokens, the same K/V in every real block.  The
schedule has misses and hits padded up to their buckets and one exactly at a bucket, a table
crossing width buckets, a miss up to the longest prompt and a step with two prefills (eager).  The tests named ``cuda`` run it with real graphs where a
GPU is present (``scripts/gpu_check.py`` runs them).
"""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from minikv import LLM
from minikv.backends import prefill_graphs
from minikv.engine import SamplingParams
from minikv.backends.cuda_graphs import DecodeGraphRunner
from minikv.backends.prefill_graphs import PrefillGraphRunner, token_bucket
from tests.engine_helpers import assert_traces_close
from tests.test_cuda_graphs import TOL, _same_kv, check_reserved_blocks


def _pair(device, dtype="float32", capture=None):
    """(graph engine, eager engine): same weights, fused backend, 4-token blocks, contexts up to
    64 tokens (width buckets 1, 2, 4, 8, 16; token buckets up to 64)."""
    base = LLM("tiny-random", device=device, dtype=dtype, attention_backend="fused", block_size=4,
               num_blocks=96, max_num_seqs=8, max_model_len=64,
               enable_prefix_caching=True)
    eager = base.fork(enforce_eager=True).engine
    graph = base.engine
    if capture is not None:  # CPU: force both runners in, with the strategy given
        graph.backend.graphs = DecodeGraphRunner(graph, capture=capture)
        graph.backend.prefill_graphs = PrefillGraphRunner(graph, capture=capture)
    return graph, eager


# (name, prompt) run one after another, each to the end; "sys" is a 23-token system prompt whose
# 5 full blocks (20 tokens) are cached after the first request that has it.
SCHEDULE = [("miss26", ["sys", 3]),         # 26 new -> bucket 32 (6 padded rows)
            ("hit12", ["sys", 9]),          # 20 cached, 12 new -> bucket 16, 8 blocks -> width 8
            ("hit4", ["sys", 1]),           # 20 cached, 4 new -> bucket 8
            ("hit20", ["sys", 17]),         # 20 cached, 20 new -> bucket 24, 10 blocks -> width 16
            ("miss16", [16]),               # exactly a bucket: no padded row
            ("hit35", ["sys", 35]),         # 20 cached, 38 new -> bucket 40, 15 blocks -> width 16
            ("long", [57])]                 # 57 new -> bucket 64, the longest prompt there can be


def _drive(engine, seed=0):
    """The schedule, then two prompts prefilled in one step (the eager path) and decoded together.
    Returns (logit trace, tokens by request, checks made on the way)."""
    rng = random.Random(seed)
    vocab = engine.model.shape.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(23)]
    engine.logit_trace = []
    checks = {"pad_zero": True, "scratch_in_table": False}
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    tokens = {}

    def run_all():
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    tokens[out.request_id] = (out.outputs[0].token_ids, out.num_cached_tokens)
            check_reserved_blocks(engine, checks)

    for name, parts in SCHEDULE:
        prompt = [t for part in parts for t in (system if part == "sys" else
                                                [rng.randrange(3, vocab) for _ in range(part)])]
        engine.add_request(name, prompt, p)
        run_all()
    for i in range(2):
        engine.add_request(f"together{i}", [rng.randrange(3, vocab) for _ in range(7 + i)], p)
    run_all()
    return engine.logit_trace, tokens, checks


def _spy(runner):
    """Record ``(real new tokens, key)`` of every step the runner runs, and check what it put in
    the static buffer: real ids, positions and slots first; padded rows token 0 at the last real
    position, writing the scratch block; the table padded with the pad block.  A wrong buffer is
    recorded as ``"bad buffer"``, not raised (the engine would turn a raise into failed requests)."""
    seen, run = [], runner.run

    def spying_run(seq, key):
        out = run(seq, key)
        n, tokens = seq.num_tokens - seq.num_computed_tokens, key[1]
        width = key[2] if key[0] == "hit" else 0
        buf = runner._static[: 3 * tokens + 4 + width].tolist()
        ids, pos, slots = buf[:tokens], buf[tokens: 2 * tokens], buf[2 * tokens: 3 * tokens]
        start, bs, pool = seq.num_computed_tokens, runner.block_size, runner.pool
        good = (ids[:n] == seq.token_ids[start:seq.num_tokens] and ids[n:] == [0] * (tokens - n)
                and pos == list(range(start, seq.num_tokens)) + [seq.num_tokens - 1] * (tokens - n)
                and all(s // bs == seq.block_table[p // bs] for s, p in zip(slots[:n], pos[:n]))
                and all(s // bs == pool.scratch_block for s in slots[n:])
                and buf[3 * tokens: 3 * tokens + 4] == [n - 1, 0, n, seq.num_tokens]
                and buf[3 * tokens + 4:] == (seq.block_table + [pool.pad_block] * (width - len(seq.block_table))
                                             if width else []))
        seen.append((n, key if good else "bad buffer"))
        return out
    runner.run = spying_run
    return seen


def test_prefill_graphs_match_the_eager_fused_path_with_padding_and_buckets():
    graph, eager = _pair("cpu", capture="eager")
    seen = _spy(graph.backend.prefill_graphs)
    trace_g, tokens_g, checks = _drive(graph)
    trace_e, tokens_e, _ = _drive(eager)
    assert "bad buffer" not in [k for _, k in seen], seen
    assert tokens_g == tokens_e and len(tokens_g) == len(SCHEDULE) + 2
    assert [tokens_g[n][1] for n in ("miss26", "hit12", "hit4", "hit20", "miss16", "hit35", "long")] == \
        [0, 20, 20, 20, 0, 20, 0]
    assert_traces_close(trace_e, trace_g, TOL)
    # the schedule exercised what it claims: every one-prefill step replayed, padded and exact
    # buckets, two widths, the chunked prompt as a miss and then a hit, the two-prefill step eager
    assert seen == [(26, ("miss", 32)), (12, ("hit", 16, 8)), (4, ("hit", 8, 8)), (20, ("hit", 24, 16)),
                    (16, ("miss", 16)), (38, ("hit", 40, 16)), (57, ("miss", 64))]
    r = graph.backend.prefill_graphs
    assert set(r.graphs) == {k for _, k in seen} and r.captures == len(r.graphs) == 7 and r.replays == 7
    assert graph.backend.graphs.replays > 0  # the decodes in between replayed the decode graphs
    # padded rows wrote the scratch block, never the pad block, never a real one
    assert checks == {"pad_zero": True, "scratch_in_table": False}
    assert graph.pool._k[:, graph.pool.scratch_block].abs().sum() > 0
    _same_kv(graph.pool, eager.pool)


def test_token_buckets_pad_by_at_most_7_rows_or_a_sixteenth():
    assert [token_bucket(n) for n in (1, 8, 9, 256, 257, 512, 513, 1040, 4112, 7016)] == \
        [8, 8, 16, 256, 272, 512, 544, 1088, 4352, 7168]
    for n in range(1, 9000):
        b = token_bucket(n)
        assert n <= b <= n + max(7, n // 16), n


def test_a_step_no_bucket_holds_runs_eagerly(monkeypatch):
    graph, _ = _pair("cpu", capture="eager")
    r = graph.backend.prefill_graphs
    seq = SimpleNamespace(num_tokens=30, num_computed_tokens=0, block_table=list(range(8)))
    assert r.key(seq) == ("miss", 32)
    seq.num_computed_tokens = 8  # a hit of 22 new tokens over 8 blocks
    assert r.key(seq) == ("hit", 24, 8)
    assert r.key(SimpleNamespace(num_tokens=61, num_computed_tokens=0, block_table=[0] * 16)) == ("miss", 64)
    assert r.key(SimpleNamespace(num_tokens=70, num_computed_tokens=20, block_table=[0] * 18)) is None  # > 16 blocks
    monkeypatch.setattr(prefill_graphs, "MAX_GRAPHS", 1)
    r.graphs[("miss", 32)] = lambda: None  # one bucket kept: it still replays, a new one runs eagerly
    assert r.key(SimpleNamespace(num_tokens=30, num_computed_tokens=0, block_table=[0] * 8)) == ("miss", 32)
    assert r.key(SimpleNamespace(num_tokens=10, num_computed_tokens=0, block_table=[0] * 3)) is None


def test_only_cuda_engines_of_the_fused_and_triton_backends_get_a_prefill_runner():
    cpu = LLM("tiny-random", device="cpu", attention_backend="fused").engine
    assert cpu.backend.prefill_graphs is None

    def fake(**kw):  # an engine that claims CUDA: nothing touches the device before the first step
        c = dict(device=torch.device("cuda"), attention_backend="fused", enforce_eager=False)
        c.update(kw)
        return SimpleNamespace(device=c["device"], attention_backend=c["attention_backend"], model=cpu.model,
                               pool=cpu.pool, block_size=16, max_model_len=2048, num_blocks=1000,
                               config=SimpleNamespace(enforce_eager=c["enforce_eager"], max_num_seqs=8,
                                                      max_num_batched_tokens=4096))
    r = PrefillGraphRunner.for_engine(fake())
    assert isinstance(r, PrefillGraphRunner) and r.widths[-1] == 128 and r.max_tokens == 2048
    assert not r.triton and PrefillGraphRunner.for_engine(fake(attention_backend="triton")).triton
    for kw in (dict(enforce_eager=True), dict(attention_backend="reference"), dict(attention_backend="cpu_kernels"),
               dict(device=torch.device("cpu"))):
        assert PrefillGraphRunner.for_engine(fake(**kw)) is None, kw
    with pytest.raises(ValueError, match="capture='graph'"):
        PrefillGraphRunner(cpu, capture="graph")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,tol", [("float32", TOL), ("bfloat16", 0.02)])
def test_cuda_prefill_graphs_match_the_eager_fused_path(dtype, tol):
    """Real graphs: the runner is there by default on CUDA, captures, replays and agrees (bf16:
    within 2% of the largest logit, steps compared up to the first flipped greedy token)."""
    graph, eager = _pair("cuda", dtype)
    assert isinstance(graph.backend.prefill_graphs, PrefillGraphRunner) and eager.backend.prefill_graphs is None
    seen = _spy(graph.backend.prefill_graphs)
    trace_g, tokens_g, checks = _drive(graph)
    trace_e, tokens_e, _ = _drive(eager)
    r = graph.backend.prefill_graphs
    print(f"cuda prefill graphs {dtype}: {r.captures} captures, {r.replays} replays")
    assert "bad buffer" not in [k for _, k in seen] and r.replays == len(seen) == r.captures == 7
    assert checks == {"pad_zero": True, "scratch_in_table": False}
    if dtype == "float32":
        assert tokens_g == tokens_e
        assert_traces_close(trace_e, trace_g, tol)
        _same_kv(graph.pool, eager.pool)
    else:
        for step_g, step_e in zip(trace_g, trace_e):
            for rid, row in step_e.items():
                assert (row - step_g[rid]).abs().max().item() <= tol * row.abs().max().item(), rid
            if any(int(row.argmax()) != int(step_g[rid].argmax()) for rid, row in step_e.items()):
                break
