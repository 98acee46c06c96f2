"""The fused forward's two matmul implementations (``minikv/backends/matmuls.py``) agree.

Packed oneDNN weights are an optimisation, never a different model: on the same engine, the
packed and the dense path must give the same greedy tokens and logits within the tolerance of
the dtype -- fp32 decode steps 1e-4 of the largest logit (as fused vs reference), bf16 within
the 8% the README states for bf16.  Steps with a prefill never pack in fp32 (their logits match
transformers exactly, ``test_engine_correctness.py``), and a torch without the oneDNN ops falls
back to ``F.linear``.
"""
from __future__ import annotations

import random

import pytest
import torch

from minikv import LLM, SamplingParams
from minikv.backends import matmuls
from minikv.backends.matmuls import DenseMatmuls, PackedMatmuls, matmuls_for
from minikv.backends.model_state import prepared
from tests.engine_helpers import assert_traces_close

needs_packing = pytest.mark.skipif(not matmuls._packing_available(), reason="this torch has no oneDNN packing ops")
BF16_PACKS = matmuls._packing_available(torch.bfloat16)
needs_bf16_packing = pytest.mark.skipif(not BF16_PACKS, reason="oneDNN has no bf16 kernels on this CPU "
                                        "(needs AVX-512 BW/VL/DQ, AVX-NE-CONVERT or AMX)")
BF16_TOL, FP32_TOL = 0.08, 1e-4


def _run(dtype: str, packed: bool, monkeypatch):
    """Greedy tokens and every sampled row's logits of a mixed batch (prefills, then decodes)."""
    with monkeypatch.context() as m:
        if not packed:
            m.setattr(matmuls, "_packing_available", lambda *dtype: False)
        llm = LLM("tiny-random", device="cpu", dtype=dtype, attention_backend="fused", num_blocks=64)
        prepared(llm.engine.model).packed = prepared(llm.engine.model).packed_head = None  # each run packs (or not) anew
        rng = random.Random(5)
        prompts = [[rng.randrange(3, 259) for _ in range(n)] for n in (7, 30, 61)]
        llm.engine.logit_trace = []
        outs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        return [o.outputs[0].token_ids for o in outs], llm.engine.logit_trace


@needs_packing
@pytest.mark.parametrize("dtype,tol", [("float32", FP32_TOL), pytest.param("bfloat16", BF16_TOL, marks=needs_bf16_packing)])
def test_packed_and_dense_matmuls_agree(dtype, tol, monkeypatch):
    tokens_p, trace_p = _run(dtype, True, monkeypatch)
    tokens_d, trace_d = _run(dtype, False, monkeypatch)
    if dtype == "float32":
        assert tokens_p == tokens_d
    assert len(trace_p) == len(trace_d) == 8
    assert_traces_close(trace_d, trace_p, tol)


@needs_packing
def test_which_steps_pack():
    fp32 = LLM("tiny-random", device="cpu", dtype="float32").engine.model
    bf16 = LLM("tiny-random", device="cpu", dtype="bfloat16").engine.model
    assert isinstance(matmuls_for(fp32, exact=True), DenseMatmuls)  # fp32 prefill: transformers' rounding
    assert isinstance(matmuls_for(fp32, exact=False), PackedMatmuls)  # fp32 decode-only
    if not BF16_PACKS:  # an AVX2-only CPU: oneDNN has no bf16 kernels, so bf16 stays dense
        for exact in (True, False):
            assert isinstance(matmuls_for(bf16, exact=exact), DenseMatmuls)
        assert prepared(bf16).packed is None and prepared(bf16).packed_head is None
        return
    assert isinstance(matmuls_for(bf16, exact=True), PackedMatmuls)  # bf16: always
    packed = matmuls_for(bf16, exact=True).packed
    assert len(packed) == bf16.shape.num_layers and packed is matmuls_for(bf16, exact=False).packed  # packed once


def test_bf16_packs_only_where_onednn_has_bf16_kernels(monkeypatch, fresh_weights):
    """Where oneDNN's bf16 reorder would raise (an AVX2-only CPU), a bf16 engine is built and
    serves on F.linear; fp32 packing is not affected."""
    monkeypatch.setattr(matmuls, "_bf16_packing_supported", lambda: False)
    bf16 = LLM("tiny-random", device="cpu", dtype="bfloat16", attention_backend="fused").engine.model
    assert not matmuls._packing_available(torch.bfloat16)
    assert matmuls._packing_available(torch.float32) == matmuls._packing_available()
    for exact in (True, False):
        assert isinstance(matmuls_for(bf16, exact=exact), DenseMatmuls)
    assert prepared(bf16).packed is None and prepared(bf16).packed_head is None


def test_without_the_ops_every_step_is_dense(monkeypatch):
    monkeypatch.setattr(matmuls, "_packing_available", lambda *dtype: False)
    model = LLM("tiny-random", device="cpu", dtype="bfloat16").engine.model
    for exact in (True, False):
        assert isinstance(matmuls_for(model, exact), DenseMatmuls)


def test_dense_residual_is_exact_only_when_asked():
    """``exact`` keeps the residual add as its own op (transformers' rounding); otherwise it rides
    on the matmul.  Both compute x + a @ W.T."""
    model = LLM("tiny-random", device="cpu", dtype="float32").engine.model
    L = model.layers[0]
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4, L.o_proj.shape[1], generator=g)
    x = torch.randn(4, L.o_proj.shape[0], generator=g)
    want = x + a @ L.o_proj.T
    for exact in (True, False):
        got = DenseMatmuls(model, exact).o_proj(0, a, x.clone())
        assert torch.allclose(got, want, atol=1e-5), exact


@needs_packing
def test_the_engine_packs_when_built_not_mid_request(fresh_weights):
    """The fused engine packs its weights when it is built (``matmuls.prepare``), so no request pays
    the reorder: the first prefix hit of SmolLM2 in fp32 took 360 ms against 95 ms for the next
    ones while packing waited for it.  Requests reuse those packs; the reference backend packs nothing."""
    llm = LLM("tiny-random", device="cpu", dtype="float32", attention_backend="fused")
    model = llm.engine.model
    packed, head = prepared(model).packed, prepared(model).packed_head
    assert packed is not None and len(packed) == model.shape.num_layers and head is not None
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert prepared(model).packed is packed and prepared(model).packed_head is head
    assert prepared(llm.fork().engine.model).packed is packed  # a fork shares the weights and their packs
    assert prepared(LLM("tiny-random", device="cpu", dtype="float32").engine.model).packed is packed  # so does a twin
    fresh_weights()  # the reference engine below gets weights no fused engine has packed
    ref = LLM("tiny-random", device="cpu", dtype="float32", attention_backend="reference").engine.model
    assert prepared(ref).packed is None
