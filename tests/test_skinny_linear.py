"""minikv's few-row matmul (``minikv/backends/kernels/skinny_linear.cpp``) and where the engine uses it.

What it is held to:

* **the product**: ``x @ W.T`` within fp32's own accumulation bound (K roundings of the
  magnitudes summed, against a float64 reference) for row counts on and off the 14-row
  microkernel (1, 13, 14, 15, 28, 48), widths on and off the 32-column panel (1, 31, 32, 33, 960)
  and depths down to 1; with ``out`` the product is added in place (a residual add);
* **the packing**: panel ``p`` holds ``W[32p + j, k]`` at ``[p, k, j]``, zeros past ``N``; in
  bf16 at ``[p, k // 2, 2j + k % 2]`` (k in pairs), zeros past ``N`` and past an odd ``K``;
* **bf16** (AVX512-BF16): the fp32 bound plus one bf16 rounding of the output (2^-8 relative),
  after the residual add when there is one; on and off the blocks, odd K included;
* **batch invariance**: a row's result is bit for bit the same whichever rows share the call,
  in whatever order (a decode's logits never depend on its neighbours' matmuls);
* **bad input**: a ``RuntimeError`` naming the bad shape, dtype or count;
* **in the engine**: decode and prefix-hit steps of at most ``matmuls.skinny_max_rows`` rows run
  on it on the ``paged`` backend, fp32 and bf16 (counted by op name): ``SKINNY_MAX_ROWS``, or
  ``SKINNY_BF16_MAX_ROWS_AMX`` for bf16 on a CPU with AMX; fresh prefills (transformers'
  exact rounding in fp32; oneDNN's packed kernel in bf16), longer steps and the ``fused``
  backend do not; bf16 decode logits stay within the README's bf16 tolerance of fp32; without AVX-512 the engine
  falls back to oneDNN's packed kernel.  Logit agreement with the reference backend is held by
  test_attention_fused.py and test_engine_correctness.py, which run ``paged``.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import profile

from minikv import LLM, SamplingParams
from minikv.backends import cpu_kernels, matmuls
from minikv.backends.matmuls import SKINNY_BF16_MAX_ROWS_AMX, SKINNY_MAX_ROWS, DenseMatmuls, PackedMatmuls, SkinnyMatmuls, matmuls_for
from minikv.backends.model_state import prepared
from tests.paged_kernel import KERNEL_BUILT

SKINNY = KERNEL_BUILT and cpu_kernels.skinny_supported()
pytestmark = pytest.mark.skipif(not SKINNY, reason="minikv's CPU kernels are not built, or this CPU has no AVX-512")
BF16 = SKINNY and cpu_kernels.skinny_bf16_supported()
needs_bf16 = pytest.mark.skipif(not BF16, reason="this CPU has no AVX512-BF16: bf16 steps keep oneDNN's packed kernel")


def _operands(m, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g) / k ** 0.5


def _assert_within_fp32_bound(got, x, w, base=None, out_rounding=0.0):
    """|got - exact| <= (K + 2) * 2^-24 * (|x| @ |W|.T + |base|): the textbook bound for a sum
    of K products in fp32, fused or not.  A wrong element (a transposed or misplaced panel, a
    skipped row or column) is off by the size of the products, far above it."""
    exact = x.double() @ w.double().T
    scale = x.double().abs() @ w.double().abs().T
    if base is not None:
        exact, scale = exact + base.double(), scale + base.double().abs()
    bound = (x.shape[1] + 2) * 2.0 ** -24 * scale + out_rounding * exact.abs() + 1e-30
    worst = ((got.double() - exact).abs() / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f}x the fp32 bound"


@pytest.mark.parametrize("m", [1, 13, 14, 15, 28, 48])
@pytest.mark.parametrize("n,k", [(1, 1), (31, 17), (32, 64), (33, 576), (960, 576), (576, 1536)])
def test_the_product_matches_float64(m, n, k):
    x, w = _operands(m, n, k, seed=m * 7919 + n * 31 + k)
    got = cpu_kernels.skinny_linear(x, cpu_kernels.skinny_pack(w), n)
    assert got.shape == (m, n) and got.dtype == torch.float32 and got.is_contiguous()
    _assert_within_fp32_bound(got, x, w)


@pytest.mark.parametrize("m,n,k", [(5, 40, 24), (28, 576, 1536)])
def test_out_accumulates_in_place(m, n, k):
    x, w = _operands(m, n, k, seed=3)
    base = torch.randn(m, n, generator=torch.Generator().manual_seed(4)) * 10
    out = base.clone()
    got = cpu_kernels.skinny_linear(x, cpu_kernels.skinny_pack(w), n, out=out)
    assert got.data_ptr() == out.data_ptr()  # the residual stream itself, no new tensor
    _assert_within_fp32_bound(out, x, w, base)


BF16_ROUNDING = 2.0 ** -8  # bf16 keeps 8 significant bits: rounding to nearest is off by <= 2^-8 relative


@needs_bf16
@pytest.mark.parametrize("m", [1, 13, 14, 15, 28, 48])
@pytest.mark.parametrize("n,k", [(1, 1), (31, 17), (33, 575), (960, 576), (576, 1536)])
def test_the_bf16_product_matches_float64(m, n, k):
    x, w = (t.bfloat16() for t in _operands(m, n, k, seed=m * 7919 + n * 31 + k))
    got = cpu_kernels.skinny_linear(x, cpu_kernels.skinny_pack(w), n)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16 and got.is_contiguous()
    _assert_within_fp32_bound(got, x, w, out_rounding=BF16_ROUNDING)  # x and w are exact in float64


@needs_bf16
def test_bf16_out_accumulates_in_place_rounded_once():
    x, w = (t.bfloat16() for t in _operands(28, 576, 1536, seed=3))
    base = (torch.randn(28, 576, generator=torch.Generator().manual_seed(4)) * 10).bfloat16()
    out = base.clone()
    assert cpu_kernels.skinny_linear(x, cpu_kernels.skinny_pack(w), 576, out=out).data_ptr() == out.data_ptr()
    _assert_within_fp32_bound(out, x, w, base, out_rounding=BF16_ROUNDING)
    # the sum is rounded once, not the product and then the sum: compare with fp32 done by hand
    exact = (x.float() @ w.float().T + base.float()).bfloat16()
    assert (out != exact).float().mean().item() < 0.01


@needs_bf16
def test_the_bf16_panel_layout():
    w = (torch.arange(70 * 5, dtype=torch.float32).view(70, 5) + 1).bfloat16()  # small integers: exact in bf16
    p = cpu_kernels.skinny_pack(w)
    assert p.shape == (3, 3, 64) and p.dtype == torch.bfloat16
    for n in range(70):
        for k in range(5):
            assert p[n // 32, k // 2, 2 * (n % 32) + k % 2] == w[n, k], (n, k)
    assert (p[:, 2, 1::2] == 0).all()  # past the odd K: the pair's second half
    assert (p[2, :, 2 * (70 - 64):] == 0).all()  # the last panel's 26 missing columns


@needs_bf16
def test_a_bf16_rows_result_does_not_depend_on_its_neighbours():
    x, w = (t.bfloat16() for t in _operands(SKINNY_MAX_ROWS, 200, 96, seed=11))
    packed = cpu_kernels.skinny_pack(w)
    whole = cpu_kernels.skinny_linear(x, packed, 200)
    perm = torch.randperm(SKINNY_MAX_ROWS, generator=torch.Generator().manual_seed(1))
    assert torch.equal(cpu_kernels.skinny_linear(x[perm], packed, 200), whole[perm])
    for i in (0, 13, 14, SKINNY_MAX_ROWS - 1):
        assert torch.equal(cpu_kernels.skinny_linear(x[i:i + 1], packed, 200), whole[i:i + 1]), i


def test_a_strided_view_is_read_as_its_values():
    wide, w = _operands(6, 50, 2 * 40, seed=8)
    x = wide[:, 40:]  # row stride 80: what a slice of a larger activation looks like
    w = w[:, :40].contiguous()
    got = cpu_kernels.skinny_linear(x, cpu_kernels.skinny_pack(w), 50)
    assert torch.equal(got, cpu_kernels.skinny_linear(x.contiguous(), cpu_kernels.skinny_pack(w), 50))
    _assert_within_fp32_bound(got, x, w)


def test_the_panel_layout():
    w = torch.arange(70 * 3, dtype=torch.float32).view(70, 3) + 1  # no zeros of its own
    p = cpu_kernels.skinny_pack(w)
    assert p.shape == (3, 3, 32)
    for n in range(70):
        assert torch.equal(p[n // 32, :, n % 32], w[n]), n
    assert (p[2, :, 70 - 64:] == 0).all()  # the last panel's 26 missing columns


def test_a_rows_result_does_not_depend_on_its_neighbours():
    x, w = _operands(SKINNY_MAX_ROWS, 200, 96, seed=11)
    packed = cpu_kernels.skinny_pack(w)
    whole = cpu_kernels.skinny_linear(x, packed, 200)
    perm = torch.randperm(SKINNY_MAX_ROWS, generator=torch.Generator().manual_seed(1))
    assert torch.equal(cpu_kernels.skinny_linear(x[perm], packed, 200), whole[perm])
    for i in (0, 13, 14, 27, SKINNY_MAX_ROWS - 1):  # alone, and at every place in a 14-row block
        assert torch.equal(cpu_kernels.skinny_linear(x[i:i + 1], packed, 200), whole[i:i + 1]), i


_W = torch.randn(40, 24)


@pytest.mark.parametrize("call,message", [
    (lambda: cpu_kernels.skinny_pack(torch.randn(40)), "weights must be non-empty 2-D fp32 or bf16 [N, K], got [40] Float"),
    (lambda: cpu_kernels.skinny_pack(_W.half()), "got [40, 24] Half"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 24).double(), cpu_kernels.skinny_pack(_W), 40), "x must be 2-D fp32 or bf16 [rows, K], got [3, 24] Double"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 24).bfloat16(), cpu_kernels.skinny_pack(_W), 40), "x is BFloat16 but the weights were packed as Float"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 2, 24), cpu_kernels.skinny_pack(_W), 40), "got [3, 2, 24]"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 25), cpu_kernels.skinny_pack(_W), 40), "x has K=25 columns but the weights have K=24"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 26).bfloat16(), cpu_kernels.skinny_pack(_W.bfloat16()), 40), "x has K=26 columns but the weights have K/2=12"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 24), cpu_kernels.skinny_pack(_W), 65), "n=65 output columns do not fit 2 panels"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 24), cpu_kernels.skinny_pack(_W), 32), "n=32 output columns do not fit 2 panels"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(0, 24), cpu_kernels.skinny_pack(_W), 40), "rows=0 outside"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 24), _W, 40), "packed weights must be skinny_pack's"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 24), cpu_kernels.skinny_pack(_W), 40, out=torch.zeros(4, 40)), "out has 4 rows but x has 3"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 24), cpu_kernels.skinny_pack(_W), 40, out=torch.zeros(40, 3).t()), "out must be contiguous"),
    (lambda: cpu_kernels.skinny_linear(torch.randn(3, 24), cpu_kernels.skinny_pack(_W), 40, out=torch.zeros(3, 40).bfloat16()), "of x's dtype Float, got [3, 40] BFloat16"),
])
def test_bad_input_is_refused_with_the_value_named(call, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()


def _op_counts(eng, steps: int, outputs: list | None = None) -> list[dict[str, int]]:
    """Ops dispatched by each of the engine's next ``steps`` steps (their outputs into ``outputs``)."""
    counts = []
    for _ in range(steps):
        with profile() as p:
            out = eng.step()
        if outputs is not None:
            outputs.extend(out)
        c: dict[str, int] = {}
        for e in p.events():
            c[e.name] = c.get(e.name, 0) + 1
        counts.append(c)
    return counts


def test_the_paged_backend_runs_it_on_decodes_and_prefix_hits_only():
    llm = LLM("tiny-random", dtype="float32", attention_backend="cpu_kernels", enable_prefix_caching=True, num_blocks=128)
    eng, layers = llm.engine, llm.engine.model.shape.num_layers
    p = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    prompt = list(range(5, 69))  # 64 tokens: 4 blocks of 16
    eng.add_request("a", prompt, p)
    fresh, decode = _op_counts(eng, 2)
    assert "minikv::skinny_linear" not in fresh, "a fresh fp32 prefill keeps transformers' exact matmuls"
    # a decode step: qkv and gate_up per layer, and the LM head; o_proj and down add onto the residual
    assert decode.get("minikv::skinny_linear") == 2 * layers + 1, decode
    assert decode.get("minikv::skinny_linear_add_") == 2 * layers, decode
    assert not {"aten::linear", "aten::addmm", "aten::mm", "mkldnn::_linear_pointwise"} & set(decode), decode
    eng.add_request("b", prompt[:48] + [200, 201, 202, 203, 204, 205, 206], p)  # 48 cached, 7 new rows
    outs = []
    (hit,) = _op_counts(eng, 1, outs)
    assert [o.num_cached_tokens for o in outs if o.request_id == "b"] == [48]
    assert hit.get("minikv::skinny_linear") == 2 * layers + 1, hit
    while eng.has_unfinished_requests():
        eng.step()
    long_hit = prompt[:16] + list(range(100, 100 + SKINNY_MAX_ROWS + 1))  # 16 cached, 49 new rows
    eng.add_request("c", long_hit, p)
    outs = []
    (long,) = _op_counts(eng, 1, outs)
    assert [o.num_cached_tokens for o in outs if o.request_id == "c"] == [16]
    # past SKINNY_MAX_ROWS the layers' matmuls go back to the libraries; the LM head still has one row
    assert long.get("minikv::skinny_linear") == 1 and "minikv::skinny_linear_add_" not in long, long
    assert long.get("aten::linear", 0) + long.get("aten::addmm", 0) >= 4 * layers, long


def test_which_steps_it_serves(fresh_weights):
    fp32 = LLM("tiny-random", dtype="float32", attention_backend="cpu_kernels").engine.model
    bf16 = LLM("tiny-random", dtype="bfloat16", attention_backend="cpu_kernels").engine.model
    # built with the engine, and no second (oneDNN) copy of the fp32 weights
    assert prepared(fp32).skinny is not None and prepared(fp32).skinny_head is not None and prepared(fp32).packed is None
    assert isinstance(matmuls_for(fp32, exact=False, kernels=True, rows=1), SkinnyMatmuls)
    assert isinstance(matmuls_for(fp32, exact=False, kernels=True, rows=SKINNY_MAX_ROWS), SkinnyMatmuls)
    assert isinstance(matmuls_for(fp32, exact=False, kernels=True, rows=SKINNY_MAX_ROWS + 1), DenseMatmuls)
    assert isinstance(matmuls_for(fp32, exact=True, kernels=True, rows=5), DenseMatmuls)
    assert not isinstance(matmuls_for(fp32, exact=False, kernels=False, rows=5), SkinnyMatmuls)  # "fused": pure PyTorch
    # bf16: few rows on the kernel where the CPU has AVX512-BF16, longer steps on oneDNN's packed one
    assert isinstance(matmuls_for(bf16, exact=False, kernels=True, rows=5), SkinnyMatmuls) == BF16
    if BF16:  # both copies are made when the engine is built, so no request pays for a packing
        assert prepared(bf16).skinny is not None and prepared(bf16).skinny_head is not None
        if matmuls._packing_available(torch.bfloat16):
            assert prepared(bf16).packed is not None and prepared(bf16).packed_head is not None
            assert isinstance(matmuls_for(bf16, exact=True, kernels=True, rows=5), PackedMatmuls)
            assert isinstance(matmuls_for(bf16, exact=False, kernels=True, rows=SKINNY_MAX_ROWS + 1), PackedMatmuls)
    assert prepared(fp32).skinny is matmuls_for(fp32, exact=False, kernels=True, rows=3).layers  # packed once


@needs_bf16
@pytest.mark.parametrize("amx", [True, False])
def test_with_amx_bf16_steps_past_a_few_rows_stay_on_onednn(monkeypatch, amx):
    """On a CPU with AMX oneDNN's bf16 matmul wins from about a dozen rows (matmuls.py has the
    measurements), so the kernel's bf16 bound drops to SKINNY_BF16_MAX_ROWS_AMX there; fp32 is
    not affected (oneDNN's fp32 kernel does not use AMX)."""
    monkeypatch.setattr(matmuls, "amx_available", lambda: amx)
    fp32 = LLM("tiny-random", dtype="float32", attention_backend="cpu_kernels").engine.model
    bf16 = LLM("tiny-random", dtype="bfloat16", attention_backend="cpu_kernels").engine.model
    bound = SKINNY_BF16_MAX_ROWS_AMX if amx else SKINNY_MAX_ROWS
    assert matmuls.skinny_max_rows(bf16) == bound and matmuls.skinny_max_rows(fp32) == SKINNY_MAX_ROWS
    assert isinstance(matmuls_for(bf16, exact=False, kernels=True, rows=bound), SkinnyMatmuls)
    want = PackedMatmuls if matmuls._packing_available(torch.bfloat16) else DenseMatmuls
    assert isinstance(matmuls_for(bf16, exact=False, kernels=True, rows=bound + 1), want)
    assert isinstance(matmuls_for(fp32, exact=False, kernels=True, rows=SKINNY_MAX_ROWS), SkinnyMatmuls)
    # the LM head follows the same bound: bound + 1 rows of hidden state go through oneDNN's head
    hidden = torch.randn(bound + 1, bf16.shape.hidden_size).bfloat16()
    with torch.profiler.profile() as prof:
        out = matmuls.logits(bf16, hidden, exact=False, kernels=True)
    names = {e.name for e in prof.events()}
    assert out.shape == (bound + 1, bf16.shape.vocab_size) and "minikv::skinny_linear" not in names, names


def test_without_avx512_the_engine_falls_back(monkeypatch, fresh_weights):
    monkeypatch.setattr(cpu_kernels, "skinny_supported", lambda: False)
    llm = LLM("tiny-random", dtype="float32", attention_backend="cpu_kernels")
    model = llm.engine.model
    assert prepared(model).skinny is None
    want = PackedMatmuls if matmuls._packing_available() else DenseMatmuls
    assert isinstance(matmuls_for(model, exact=False, kernels=True, rows=4), want)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@needs_bf16
def test_bf16_decodes_run_it_and_stay_within_the_bf16_tolerance():
    """A bf16 decode and prefix-hit step run on the kernel; every step's logits stay within the
    README's bf16 tolerance (8% of the largest logit, tests/test_engine_correctness.py) of the fp32
    reference backend driven through the same schedule, and greedy tokens mostly agree."""
    from tests.test_engine_correctness import BF16_TOL

    runs = {}
    for dtype, backend in (("float32", "reference"), ("bfloat16", "cpu_kernels")):
        llm = LLM("tiny-random", dtype=dtype, attention_backend=backend, enable_prefix_caching=True, num_blocks=128)
        eng, layers = llm.engine, llm.engine.model.shape.num_layers
        eng.logit_trace = []
        p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = list(range(5, 69))
        eng.add_request("a", prompt, p)
        counts = _op_counts(eng, 4)
        eng.add_request("b", prompt[:48] + [200, 201, 202], p)  # a prefix hit: 48 cached, 3 new rows
        counts += _op_counts(eng, 4)
        runs[dtype] = (eng.logit_trace, counts)
    (ref_trace, _), (trace, counts) = runs["float32"], runs["bfloat16"]
    fresh, decode, hit = counts[0], counts[1], counts[4]
    assert "minikv::skinny_linear" not in fresh, fresh  # a bf16 prefill: oneDNN's packed kernel
    for step in (decode, hit):
        assert step.get("minikv::skinny_linear") == 2 * layers + 1 and step.get("minikv::skinny_linear_add_") == 2 * layers, step
        assert "mkldnn::_linear_pointwise" not in step, step
    assert len(trace) == len(ref_trace) == 8
    for got, ref in zip(trace, ref_trace):
        for rid in ref:
            diff = (got[rid].float() - ref[rid].float()).abs().max().item()
            assert diff <= BF16_TOL * ref[rid].abs().max().item(), (rid, diff)


def test_without_avx512_bf16_bf16_steps_keep_onednn(monkeypatch, fresh_weights):
    monkeypatch.setattr(cpu_kernels, "skinny_bf16_supported", lambda: False)
    llm = LLM("tiny-random", dtype="bfloat16", attention_backend="cpu_kernels")
    model = llm.engine.model
    assert prepared(model).skinny is None and prepared(model).skinny_head is None
    want = PackedMatmuls if matmuls._packing_available(torch.bfloat16) else DenseMatmuls
    assert isinstance(matmuls_for(model, exact=False, kernels=True, rows=4), want)
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3
