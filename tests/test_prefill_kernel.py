"""minikv's C++ causal prefill kernel (``minikv/backends/kernels/prefill_attention.cpp``).

The kernel runs every fresh prefill of a step in one call, writing each sequence's rows of a
shared output through raw pointers.  These tests hold it to:

* **the arithmetic**: causal softmax(q K^T * scale) V of each sequence over its own keys, against
  a float64 reference computed one query at a time (fp32: 1e-5 absolute; bf16: 2^-7 of the
  largest value), for every head dim the ``paged`` backend accepts, GQA ratios 1-4, lengths of
  1, of a tile exactly (32) and across tiles and key blocks, and q/k/v as strided views of one
  qkv buffer, as the engine hands them over;
* **what it touches**: rows of no listed sequence stay as they were (the output is shared with the
  step's other groups), a sequence's keys never reach another's queries (NaN poison between
  sequences), and a sequence alone or batched gives the same bits;
* **bad input**: a ``RuntimeError`` naming the bad value, before any pointer is followed;
* **the engine**: a ``paged`` step plans its fresh prefills as one ``"causal"`` group, ``score``
  keeps SDPA (transformers' bits), and generation is within the decode tolerance of the
  ``reference`` backend with the same greedy tokens.
"""
from __future__ import annotations

import re

import pytest
import torch

from minikv.backends.registry import KERNEL_HEAD_DIMS
from tests.paged_kernel import KERNEL_BUILT

pytestmark = pytest.mark.skipif(not KERNEL_BUILT, reason="no C++ compiler: the kernels are not built")


def _qkv(seed, lengths, heads, kv_heads, dim, dtype, gap=0):
    """One [T, heads + 2 * kv_heads, D] buffer (``gap`` rows of NaN between sequences) and its
    q, k, v views, with the (first row, length) of each sequence."""
    g = torch.Generator().manual_seed(seed)
    seqs, rows = [], 0
    for n in lengths:
        seqs.append([rows, n])
        rows += n + gap
    qkv = torch.full((rows, heads + 2 * kv_heads, dim), float("nan"))
    for start, n in seqs:
        qkv[start:start + n] = torch.randn(n, heads + 2 * kv_heads, dim, generator=g)
    qkv = qkv.to(dtype)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return q, k, v, torch.tensor(seqs, dtype=torch.long)


def _reference(q, k, v, seqs, scale):
    """float64, one query at a time over the keys at or before it: nothing shared with the kernel."""
    heads, dim = q.shape[1], q.shape[2]
    rep = heads // k.shape[1]
    out = {}
    for start, n in seqs.tolist():
        for i in range(n):
            row = torch.empty(heads, dim, dtype=torch.float64)
            for h in range(heads):
                keys = k[start:start + i + 1, h // rep].double()
                w = torch.softmax(keys @ q[start + i, h].double() * scale, dim=0)
                row[h] = w @ v[start:start + i + 1, h // rep].double()
            out[start + i] = row.view(-1)
    return out


def _run(q, k, v, seqs, scale, fill=7.0):
    out = torch.full((q.shape[0], q.shape[1] * q.shape[2]), fill, dtype=q.dtype)
    got = torch.ops.minikv.prefill_attention_(out, q, k, v, seqs, scale)
    assert got.data_ptr() == out.data_ptr()  # in place, returned
    return out


CASES = [  # head_dim, kv_heads, rep, lengths
    (64, 3, 3, [1, 32, 33, 64, 65, 130]),  # SmolLM2's heads; a tile exactly; across tiles and key blocks
    (16, 2, 2, [5, 31, 97]),  # tiny-random's heads
    (32, 4, 1, [9, 70]),  # no GQA
    (128, 1, 4, [40, 3]),
    (256, 2, 2, [20]),
]


@pytest.mark.parametrize("head_dim,kv_heads,rep,lengths", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_textbook_and_touches_only_its_rows(dtype, head_dim, kv_heads, rep, lengths):
    q, k, v, seqs = _qkv(len(lengths), lengths, kv_heads * rep, kv_heads, head_dim, dtype, gap=2)
    scale = head_dim ** -0.5
    out = _run(q, k, v, seqs, scale)
    want = _reference(q, k, v, seqs, scale)
    mine = sorted(want)
    assert torch.isfinite(out[mine]).all(), "read a NaN: a row between sequences reached a query"
    others = [r for r in range(q.shape[0]) if r not in want]
    assert (out[others] == 7.0).all(), "wrote a row of no listed sequence"
    expected = torch.stack([want[r] for r in mine])
    err = (out[mine].double() - expected).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * expected.abs().max().item()
    assert err <= tol, (dtype, err, tol)


def test_every_head_dim_of_the_paged_backend_is_supported():
    """The ``paged`` backend takes a model only if both kernels do: the prefill kernel must accept
    every head dim the decode kernel is instantiated for."""
    for dim in KERNEL_HEAD_DIMS:
        q, k, v, seqs = _qkv(0, [3], 2, 1, dim, torch.float32)
        assert torch.isfinite(_run(q, k, v, seqs, 0.5)).all(), dim


def test_one_sequence_is_unaffected_by_its_batch():
    q, k, v, seqs = _qkv(3, [300, 12, 77], 9, 3, 64, torch.float32)
    together = _run(q, k, v, seqs, 0.125)
    for start, n in seqs.tolist():
        alone = _run(q, k, v, torch.tensor([[start, n]]), 0.125)
        assert torch.equal(alone[start:start + n], together[start:start + n])


def test_matches_sdpa_on_smollm2_shapes_within_fp32_rounding():
    """Against the call it replaces (SDPA, causal, enable_gqa, one sequence at a time)."""
    import torch.nn.functional as F

    q, k, v, seqs = _qkv(5, [512, 200], 9, 3, 64, torch.float32)
    out = _run(q, k, v, seqs, 0.125)
    for start, n in seqs.tolist():
        qs, ks, vs = (x[start:start + n].transpose(0, 1)[None] for x in (q, k, v))
        ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=0.125, enable_gqa=True)
        assert (out[start:start + n] - ref[0].transpose(0, 1).reshape(n, -1)).abs().max().item() <= 1e-5


def _args(**change):
    q, k, v, seqs = _qkv(1, [20, 40], 9, 3, 64, torch.float32)
    args = dict(out=torch.zeros(60, 9 * 64), q=q, k=k, v=v, seqs=seqs)
    args.update(change)
    return args


@pytest.mark.parametrize("change,message", [
    (lambda a: dict(seqs=torch.tensor([[0, 20], [20, 41]])), "sequence 1 (first row 20, length 41) does not lie in the 60 rows"),
    (lambda a: dict(seqs=torch.tensor([[0, 0]])), "sequence 0 (first row 0, length 0)"),
    (lambda a: dict(seqs=torch.tensor([[-1, 5]])), "sequence 0 (first row -1, length 5)"),
    (lambda a: dict(seqs=torch.tensor([0, 20])), "seqs must be a contiguous int64 [S, 2]"),
    (lambda a: dict(seqs=a["seqs"].int()), "seqs must be a contiguous int64 [S, 2]"),
    (lambda a: dict(q=a["q"].to(torch.bfloat16)), "must all be float32 or all bfloat16, got BFloat16, Float, Float"),
    (lambda a: dict(q=a["q"][:, :8]), "8 query heads do not fit 3 KV heads"),
    (lambda a: dict(k=a["k"][:50]), "k and v must be [60, kv_heads, 64]"),
    (lambda a: dict(out=torch.zeros(60, 9 * 64 + 1)), "out must be a contiguous Float [60, 576]"),
    (lambda a: dict(out=torch.zeros(60, 9 * 64, dtype=torch.bfloat16)), "out must be a contiguous Float"),
    (lambda a: dict(q=torch.randn(60, 9, 24), k=torch.randn(60, 3, 24), v=torch.randn(60, 3, 24),
                    out=torch.zeros(60, 9 * 24)), "head_dim 24 is not one of"),
])
def test_bad_input_is_refused_with_the_bad_value_named(change, message):
    args = _args()
    args.update(change(args))
    before = args["out"].clone()
    with pytest.raises(RuntimeError, match=re.escape(message)):
        torch.ops.minikv.prefill_attention_(args["out"], args["q"], args["k"], args["v"], args["seqs"], 0.125)
    assert torch.equal(args["out"], before)  # nothing written


def _plan_kinds(monkeypatch, llm, prompts):
    """The group kinds of every plan ``llm`` builds for a generate over ``prompts`` (all fresh
    prefills), then for a ``score`` of the first."""
    from minikv import SamplingParams
    from minikv.backends import fused

    kinds, build = [], fused.build_plan

    def recording(*a, **kw):
        plan = build(*a, **kw)
        kinds.append([g.kind for g in plan.groups])
        return plan

    with monkeypatch.context() as m:
        m.setattr(fused, "build_plan", recording)  # the name the backend calls it by
        llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0.0))
        llm.engine.score(prompts[0])
    return kinds


def test_paged_engine_plans_fresh_prefills_as_one_kernel_call_and_score_keeps_sdpa(monkeypatch):
    from minikv import LLM

    llm = LLM("tiny-random", dtype="float32", device="cpu", attention_backend="cpu_kernels")
    kinds = _plan_kinds(monkeypatch, llm, [[30 + i for i in range(n)] for n in (5, 40, 17)])
    assert kinds[0] == ["causal"], kinds  # generation: the three prefills in one group
    assert kinds[-1] == ["fresh"], kinds  # score: SDPA, transformers' op sequence
    fused = _plan_kinds(monkeypatch, LLM("tiny-random", dtype="float32", device="cpu", attention_backend="fused"),
                        [[30] * 9, [31] * 4])
    assert fused[0] == ["fresh", "fresh"]  # no kernels: one SDPA per sequence, as before


def test_paged_generation_within_decode_tolerance_of_reference():
    """Prefill rows and decodes of a batch, paged (prefill kernel) against reference (SDPA):
    within 1e-4 of each row's largest logit (issue 11's bound for a backend against the
    reference), the same greedy tokens."""
    from minikv import LLM, SamplingParams
    from tests.engine_helpers import assert_traces_close

    prompts = [[30 + (7 * i) % 200 for i in range(n)] for n in (3, 70, 33)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    runs = {}
    for backend in ("reference", "cpu_kernels"):
        llm = LLM("tiny-random", dtype="float32", device="cpu", attention_backend=backend)
        llm.engine.logit_trace = []
        outs = llm.generate(prompts, params)
        runs[backend] = ([o.outputs[0].token_ids for o in outs], llm.engine.logit_trace)
    assert runs["cpu_kernels"][0] == runs["reference"][0]
    assert_traces_close(runs["cpu_kernels"][1], runs["reference"][1], rel_tol=1e-4)
