"""minikv's row-wise C++ kernels (``minikv/backends/kernels/pointwise.cpp``): RMSNorm, SwiGLU, RoPE.

What they are held to:

* **RMSNorm**: a float64 reference of the definition (fp32: 2e-6 relative to the largest output;
  bf16: one bf16 rounding of it), on rows that are strided views (the engine hands it slices);
  in bf16 it keeps transformers' rounding order (normalise in fp32, round, then scale), so it
  agrees with ``minikv.engine.model.rms_norm`` (that order written in PyTorch) where
  ``F.rms_norm`` in bf16 does not;
* **SwiGLU**: in fp32, bit for bit ``F.silu(gate) * up`` for widths that are a whole number of
  vectors (every common model; SmolLM2's 1536): the engine runs it on steps held to
  transformers' exact rounding.  Other widths and bf16: within the dtype's rounding;
* **RoPE** (``rope_``): in fp32 and in bf16, bit for bit the fused forward's ATen ops (roll, two multiplies,
  one add) on the rotated heads, at head dims that take the vector path and ones that do not,
  on a strided qkv view; the heads past ``heads`` (v) are untouched;
* **bad input**: a ``RuntimeError`` naming the bad shape, dtype or value;
* **in the engine**: the ``paged`` backend runs them (counted by op name) and still matches the
  reference backend (the engine-level logit tests in test_attention_fused.py and
  test_engine_correctness.py run ``paged`` too).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minikv.engine.model import rms_norm as reference_order_rms_norm
from tests.paged_kernel import KERNEL_BUILT

pytestmark = pytest.mark.skipif(not KERNEL_BUILT, reason="no C++ compiler: minikv's CPU kernels are not built")


def rms_norm(x, w, eps):
    return torch.ops.minikv.rms_norm(x, w, eps)


def silu_mul(gate_up):
    return torch.ops.minikv.silu_mul(gate_up)


def rope_(qkv, cos, sin, heads):
    return torch.ops.minikv.rope_(qkv, cos, sin, heads)


def _rope_tables(tokens, dim, seed):
    """cos and sin [T, 1, D] at scattered positions, rotate-half's sign folded into sin (as
    ``fused_plan.build_plan`` makes them)."""
    pos = torch.randperm(4 * tokens, generator=torch.Generator().manual_seed(seed))[:tokens].float()
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    sign = torch.cat([-torch.ones(dim // 2), torch.ones(dim // 2)])
    return emb.cos()[:, None], (emb.sin() * sign)[:, None]


def _rms_reference(x, w, eps):
    xd = x.double()
    return w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 576), (16, 576), (300, 576), (7, 100), (5, 17)])
def test_rms_norm_matches_the_definition(dtype, rows, n):
    g = torch.Generator().manual_seed(rows * 1000 + n)
    wide = (torch.randn(rows, 2 * n, generator=g) * 3).to(dtype)
    x = wide[:, n:]  # a strided view: row stride 2n
    w = (torch.rand(n, generator=g) + 0.5).to(dtype)
    out = rms_norm(x, w, 1e-5)
    assert out.shape == (rows, n) and out.dtype == dtype and out.is_contiguous()
    ref = _rms_reference(x, w, 1e-5)
    err = (out.double() - ref).abs().max().item() / ref.abs().max().item()
    assert err <= (2e-6 if dtype == torch.float32 else 2 ** -7), err
    if dtype == torch.bfloat16:  # transformers' order: the few differences are one bf16 step apart
        same = (out == reference_order_rms_norm(x, w, 1e-5)).float().mean().item()
        assert same >= 0.99, same


def test_rms_norm_is_row_independent():
    """A row's result does not depend on which other rows share the call (or how the rows were
    split between threads): a decode's output is the same alone or batched."""
    x = torch.randn(257, 576)
    w = torch.rand(576) + 0.5
    full = rms_norm(x, w, 1e-6)
    assert torch.equal(full[100:101], rms_norm(x[100:101], w, 1e-6))
    assert torch.equal(full[:16], rms_norm(x[:16], w, 1e-6))


@pytest.mark.parametrize("n", [1536, 2048, 64])
def test_silu_mul_is_atens_bit_for_bit_in_fp32(n):
    g = torch.Generator().manual_seed(n)
    gate_up = torch.randn(33, 2 * n, generator=g) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_mul(gate_up), F.silu(gate.contiguous()) * up)


@pytest.mark.parametrize("dtype,n", [(torch.float32, 17), (torch.float32, 1539), (torch.bfloat16, 1536), (torch.bfloat16, 17)])
def test_silu_mul_other_widths_and_bf16_are_within_rounding(dtype, n):
    g = torch.Generator().manual_seed(n)
    gate_up = (torch.randn(9, 2 * n, generator=g) * 4).to(dtype)
    gate, up = gate_up.double().chunk(2, dim=-1)
    ref = gate * torch.sigmoid(gate) * up
    out = silu_mul(gate_up)
    assert out.shape == (9, n) and out.dtype == dtype
    tol = 1e-6 if dtype == torch.float32 else 2 ** -8  # bf16: one rounding of the product
    assert torch.allclose(out.double(), ref, rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("tokens,heads_total,heads,dim", [
    (300, 15, 12, 64),  # SmolLM2's q, k, v heads: q and k rotate, v does not
    (1, 15, 12, 64), (28, 6, 6, 128), (7, 5, 3, 10), (9, 4, 2, 48)])  # 10, 48: halves off the vector width
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_atens_ops_bit_for_bit(tokens, heads_total, heads, dim, dtype):
    """In bf16 as in fp32: ATen rounds after each of its ops (two products, one sum), and so does
    the kernel, so the bits agree in both dtypes."""
    g = torch.Generator().manual_seed(tokens * 7 + dim)
    wide = (torch.randn(tokens, heads_total * dim + 32, generator=g) * 3).to(dtype)
    qkv = wide[:, 32:].view(tokens, heads_total, dim)  # a view with a row stride, like the matmul's output
    cos, sin = (t.to(dtype) for t in _rope_tables(tokens, dim, tokens))
    expected = qkv.clone()
    qk = expected[:, :heads]  # the fused forward's exact branch, in ATen
    rot = qk.roll(dim // 2, -1).mul_(sin)
    qk.mul_(cos).add_(rot)
    untouched = wide[:, :32].clone()
    assert rope_(qkv, cos, sin, heads) is qkv
    assert torch.equal(qkv, expected)
    assert torch.equal(wide[:, :32], untouched)  # nothing written outside the view


def test_rope_is_a_rotation():
    """Each pair (x_d, x_{d + D/2}) turns by its angle: norms are kept, and position 0 is the identity."""
    qkv = torch.randn(5, 3, 64)
    cos, sin = _rope_tables(5, 64, 0)
    cos[0], sin[0] = 1.0, 0.0
    out = rope_(qkv.clone(), cos, sin, 3)
    assert torch.equal(out[0], qkv[0])
    pair = lambda x: x[..., :32].pow(2) + x[..., 32:].pow(2)
    assert torch.allclose(pair(out), pair(qkv), rtol=1e-5)


@pytest.mark.parametrize("call,message", [
    (lambda: rope_(torch.randn(4, 3, 8).double(), *_rope_tables(4, 8, 0), 2), "qkv must be fp32 or bf16 [tokens, heads, head_dim]"),
    (lambda: rope_(torch.randn(4, 8, 3).transpose(1, 2), *_rope_tables(4, 8, 0), 2), "with a contiguous last dim"),
    (lambda: rope_(torch.randn(4, 3, 7), torch.ones(4, 1, 7), torch.ones(4, 1, 7), 2), "head_dim must be even, got 7"),
    (lambda: rope_(torch.randn(4, 3, 8), *_rope_tables(4, 8, 0), 4), "heads=4 outside [0, 3]"),
    (lambda: rope_(torch.randn(4, 3, 8), *_rope_tables(5, 8, 0), 2), "must be contiguous [4, 1, 8] tables .one row per token. of qkv's dtype Float, got [5, 1, 8] Float"),
    (lambda: rope_(torch.randn(4, 3, 8), torch.ones(4, 1, 8).half(), torch.ones(4, 1, 8), 2), "of qkv's dtype Float, got [4, 1, 8] Half"),
    (lambda: rope_(torch.randn(4, 3, 8).bfloat16(), *_rope_tables(4, 8, 0), 2), "of qkv's dtype BFloat16, got [4, 1, 8] Float"),

    (lambda: rms_norm(torch.randn(576), torch.ones(576), 1e-5), "x must be 2-D [rows, n]"),
    (lambda: rms_norm(torch.randn(4, 576).t(), torch.ones(4), 1e-5), "with a contiguous last dim"),
    (lambda: rms_norm(torch.randn(4, 576), torch.ones(575), 1e-5), "weight must be a contiguous [576]"),
    (lambda: rms_norm(torch.randn(4, 8), torch.ones(8, dtype=torch.bfloat16), 1e-5), "of x's dtype Float"),
    (lambda: rms_norm(torch.randn(4, 8).half(), torch.ones(8).half(), 1e-5), "has dtype Half"),
    (lambda: rms_norm(torch.randn(4, 8), torch.ones(8), -1.0), "eps must be a positive number, got -1"),
    (lambda: rms_norm(torch.randn(4, 8), torch.ones(8), float("nan")), "eps must be a positive number, got nan"),
    (lambda: silu_mul(torch.randn(4, 7)), "an even size, got 7"),
    (lambda: silu_mul(torch.randn(2, 4, 8)), "gate_up must be 2-D [rows, n]"),
    (lambda: silu_mul(torch.randn(4, 8, dtype=torch.float64)), "has dtype Double"),
])
def test_bad_input_is_refused_with_the_value_named(call, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        call()


def test_the_paged_backend_runs_them_and_the_fused_backend_does_not():
    """``paged`` is minikv's C++ kernels; ``fused`` stays pure PyTorch (the readable fast path).
    Counted on a prefill step (the SwiGLU op runs with dense matmuls: an fp32 fresh prefill) and
    on a decode step (RMSNorm; packed matmuls fuse SwiGLU themselves)."""
    from torch.profiler import profile

    from minikv import LLM
    from minikv.engine import SamplingParams

    llm = LLM("tiny-random", dtype="float32", attention_backend="cpu_kernels")
    layers = llm.engine.model.shape.num_layers
    counts = {}
    for backend, engine_llm in (("cpu_kernels", llm), ("fused", llm.fork(attention_backend="fused"))):
        eng = engine_llm.engine
        eng.add_request("r", list(range(5, 45)), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
        with profile() as prefill:
            eng.step()
        with profile() as decode:
            eng.step()
        while eng.has_unfinished_requests():
            eng.step()
        counts[backend] = [{e.name: 0 for e in p.events()} for p in (prefill, decode)]
        for c, p in zip(counts[backend], (prefill, decode)):
            for e in p.events():
                c[e.name] += 1
    (pre, dec), (fpre, fdec) = counts["cpu_kernels"], counts["fused"]
    assert pre.get("minikv::silu_mul") == layers and "aten::silu" not in pre, pre
    assert pre.get("aten::rms_norm") == 2 * layers + 1  # an exact fp32 step keeps ATen's norm
    assert dec.get("minikv::rms_norm") == 2 * layers + 1 and "aten::rms_norm" not in dec, dec
    for c in (pre, dec):  # RoPE: one op per layer in fp32, where ATen needs a roll, multiplies and an add
        assert c.get("minikv::rope_") == layers and "aten::roll" not in c, c
    assert fpre.get("aten::roll") == layers and fdec.get("aten::roll") == layers
    assert not any(k.startswith("minikv::") for k in (*fpre, *fdec))


def test_bf16_steps_rope_with_the_kernel_too(monkeypatch):
    """In bf16 the ``paged`` backend's prefills and decodes rotate q and k with ``rope_`` (one op
    per layer, no roll), and the prefill's logits are the same bits as with ATen's ops (the
    kernel rounds where they do)."""
    from torch.profiler import profile

    from minikv import LLM
    from minikv.backends import fused
    from minikv.engine import SamplingParams

    prompt, params = list(range(5, 45)), SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    llm = LLM("tiny-random", dtype="bfloat16", attention_backend="cpu_kernels")
    eng, layers = llm.engine, llm.engine.model.shape.num_layers
    eng.logit_trace = []
    eng.add_request("r", prompt, params)
    for _ in range(2):  # the prefill, then a decode
        with profile() as p:
            eng.step()
        names = [e.name for e in p.events()]
        assert names.count("minikv::rope_") == layers and "aten::roll" not in names, names
    # the same two steps with the kernel's RoPE switched off in the plan: ATen's roll, multiplies and add
    real = fused.build_plan

    def aten_rope(*a, **k):
        plan = real(*a, **k)
        assert plan.rope_kernel  # so that the switch below is what changes
        plan.rope_kernel = False
        return plan

    monkeypatch.setattr(fused, "build_plan", aten_rope)
    other = llm.fork().engine
    other.logit_trace = []
    other.add_request("r", prompt, params)
    with profile() as p:
        other.step()
    assert "aten::roll" in {e.name for e in p.events()}
    assert torch.equal(other.logit_trace[0]["r"], eng.logit_trace[0]["r"])  # the prefill: same bits
