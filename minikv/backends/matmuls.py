"""The fused forward's matmuls: plain ``F.linear``, weights prepacked for oneDNN on the CPU, or
minikv's own few-row matmul.

A decoder layer has four weight matrices (qkv, o_proj, gate_up, down) and two residual adds.
:func:`matmuls_for` picks how one step runs them:

* :class:`DenseMatmuls` -- ``F.linear`` on the checkpoint's ``[out, in]`` matrices, as
  transformers does.  With ``exact=True`` (a step with a fresh prefill) every residual add is its
  own op after the matmul, so fp32 prefill and ``score`` logits match transformers bit for bit;
  any other step (decodes, prefix-hit prefills) folds each residual add into its matmul (an
  ``addmm`` accumulating onto the residual, which rounds differently: within the decode
  tolerance, one op fewer each).
* :class:`PackedMatmuls` -- bf16 on a CPU with oneDNN.  A matmul library keeps its weights in
  a blocked layout of its own; ``F.linear`` hands it the checkpoint's layout, so every call
  reorders the whole matrix first.  For a prefill of thousands of rows that copy is noise; for a
  decode step of 16 rows it is most of the work.  So the weights are reordered *once*
  (``torch.ops.mkldnn._reorder_linear_weight``: the packing PyTorch's own compiler emits for the
  CPU, see ``torch/_inductor/fx_passes/mkldnn_fusion.py``) and every step calls the packed kernel (``torch.ops.mkldnn._linear_pointwise``), with its
  epilogues: the residual add (``"add"``), SiLU on the gate (``"swish"``) and the gate-times-up
  product (``"mul"``) happen inside the matmul, so the MLP is three ops instead of five.
  Packed wins most at few rows and nothing at thousands (docs/BENCHMARKS.md, "Packed matmuls").
  In fp32 only steps without a fresh prefill use them: oneDNN's fp32
  kernel reduces in another order than the MKL call transformers makes, so a fresh prefill keeps
  ``F.linear`` and its logits keep matching transformers exactly.  The packed copy costs the memory of the weights
  again (the dense ones stay: prefills in fp32, the reference backend and the embedding use them).
* :class:`SkinnyMatmuls` -- steps of at most :func:`skinny_max_rows` rows (a decode batch, a
  prefix hit's new tokens: ``SKINNY_MAX_ROWS``, except bf16 on a CPU with AMX, where oneDNN's
  AMX kernel wins past ``SKINNY_BF16_MAX_ROWS_AMX``) on the ``cpu_kernels`` backend, whose C++ kernels include a matmul for few
  rows (``kernels/skinny_linear.cpp``: fp32 with AVX-512, bf16 with AVX512-BF16), which beats
  oneDNN's packed kernel and ``F.linear`` at these sizes in both dtypes (docs/BENCHMARKS.md,
  "Packed matmuls"); bf16 prefills keep oneDNN's packed kernel.  Longer steps go back to ``F.linear``.  Its
  packed copy replaces oneDNN's (the ``cpu_kernels`` backend never packs fp32 weights for oneDNN).

No compilation is involved: these are eager ops (ATen's, or minikv's registered C++ ops), run one
by one like every other op here.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import cpu_kernels
from .cpu_kernels import silu_mul, skinny_linear
from .model_state import prepared

# Steps of at most this many rows run on the few-row matmul (SkinnyMatmuls); past it, F.linear.  A
# conservative bound: the libraries catch up a little past it (docs/BENCHMARKS.md, "Packed matmuls").
SKINNY_MAX_ROWS = 48
# In bf16 on a CPU with AMX, oneDNN runs its packed matmul on the AMX tile unit, and that wins from
# about a dozen rows (docs/BENCHMARKS.md, "Packed matmuls").  So there bf16 steps of more than this
# many rows stay on oneDNN; without AMX (AVX512-BF16 only) the bound above holds.
SKINNY_BF16_MAX_ROWS_AMX = 8


@functools.lru_cache(maxsize=1)
def amx_available() -> bool:
    """Whether this CPU has AMX tiles that oneDNN may use (PyTorch's own check; False where the
    build lacks it)."""
    try:
        return bool(torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


def skinny_max_rows(model) -> int:
    """The most rows a step of ``model`` may have to run on the few-row matmul."""
    if model.dtype == torch.bfloat16 and amx_available():
        return SKINNY_BF16_MAX_ROWS_AMX
    return SKINNY_MAX_ROWS


def _packing_available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether oneDNN can pack weights of ``dtype`` on this CPU.  Its bf16 kernels need AVX-512
    (BW, VL, DQ), AVX-NE-CONVERT or AMX: on an AVX2-only CPU (many laptops, and some
    server CPUs) the reorder raises, so bf16 stays on ``F.linear``
    there, which ATen runs through its own bf16 fallback."""
    ops = getattr(torch.ops, "mkldnn", None)
    try:
        if not (torch.backends.mkldnn.is_available() and ops is not None and
                hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return False
        return dtype != torch.bfloat16 or _bf16_packing_supported()
    except (AttributeError, RuntimeError):  # a build without the ops: dense it is
        return False


@functools.lru_cache(maxsize=1)
def _bf16_packing_supported() -> bool:
    """PyTorch's own check of oneDNN's bf16 support (what its compiler asks before packing), and
    a probe of one tiny reorder behind it, since the check is a private API."""
    check = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if check is not None and not check():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=torch.bfloat16), 16)
        return True
    except RuntimeError:
        return False


class DenseMatmuls:
    """``F.linear`` on the checkpoint's matrices (see the module docstring for ``exact``).
    ``kernels``: SwiGLU's ``silu(gate) * up`` is minikv's one-pass C++ op (``cpu_kernels.silu_mul``,
    bit for bit ATen's ``F.silu(gate) * up`` in fp32, so exact steps may use it too)."""

    def __init__(self, model, exact: bool, kernels: bool = False):
        self.layers, self.exact, self.kernels = model.layers, exact, kernels

    def qkv(self, i: int, h: torch.Tensor) -> torch.Tensor:
        L = self.layers[i]
        return F.linear(h, L.qkv, L.qkv_bias)

    def o_proj(self, i: int, attn: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x + attn @ o_proj.T``, written into ``x`` (this forward's own residual stream)."""
        L = self.layers[i]
        return self._residual(x, attn, L.o_proj, L.o_bias)

    def mlp(self, i: int, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``x + down(silu(gate(h)) * up(h))``."""
        L = self.layers[i]
        gate_up = F.linear(h, L.gate_up, L.gate_up_bias)
        if self.kernels:
            act = silu_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate).mul_(up)
        return self._residual(x, act, L.down, L.down_bias)

    def _residual(self, x, a, weight, bias):
        if self.exact or bias is not None:
            return x.add_(F.linear(a, weight, bias))
        return F.linear(a, weight, x)  # a 2-D "bias": one addmm accumulating onto x


class PackedLayer:
    """One layer's weights in oneDNN's layout (gate and up apart: each gets its own epilogue)."""

    def __init__(self, L, rows_hint: int):
        pack = torch.ops.mkldnn._reorder_linear_weight
        inter = L.gate_up.shape[0] // 2
        self.qkv, self.o_proj, self.down = (pack(w, rows_hint) for w in (L.qkv, L.o_proj, L.down))
        self.gate, self.up = pack(L.gate_up[:inter].contiguous(), rows_hint), pack(L.gate_up[inter:].contiguous(), rows_hint)
        gb = L.gate_up_bias
        self.gate_bias, self.up_bias = (None, None) if gb is None else (gb[:inter], gb[inter:])
        self.qkv_bias, self.o_bias, self.down_bias = L.qkv_bias, L.o_bias, L.down_bias


class PackedMatmuls:
    """The same three calls on prepacked weights, residual adds and the SwiGLU inside the kernels."""

    def __init__(self, packed: list[PackedLayer]):
        self.packed = packed

    def qkv(self, i, h):
        P = self.packed[i]
        return torch.ops.mkldnn._linear_pointwise(h, P.qkv, P.qkv_bias, "none", [], "")

    def o_proj(self, i, attn, x):
        P = self.packed[i]
        return torch.ops.mkldnn._linear_pointwise.binary(attn, x, P.o_proj, P.o_bias, "add")

    def mlp(self, i, h, x):
        P, lp = self.packed[i], torch.ops.mkldnn._linear_pointwise
        gate = lp(h, P.gate, P.gate_bias, "swish", [], "")  # silu(gate(h)), SiLU being swish
        act = lp.binary(h, gate, P.up, P.up_bias, "mul")  # up(h) * silu(gate(h))
        return lp.binary(act, x, P.down, P.down_bias, "add")


class SkinnyLayer:
    """One layer's weights in the few-row matmul's panels (``cpu_kernels.skinny_pack``)."""

    def __init__(self, L):
        self.qkv, self.o_proj, self.gate_up, self.down = (
            (cpu_kernels.skinny_pack(w), w.shape[0]) for w in (L.qkv, L.o_proj, L.gate_up, L.down))
        self.qkv_bias, self.o_bias, self.gate_up_bias, self.down_bias = L.qkv_bias, L.o_bias, L.gate_up_bias, L.down_bias


class SkinnyMatmuls:
    """The same three calls on the few-row matmul: residual adds accumulate inside it, SwiGLU is
    the one-pass ``silu_mul`` between gate_up and down."""

    def __init__(self, layers: list[SkinnyLayer]):
        self.layers = layers

    def qkv(self, i, h):
        P = self.layers[i]
        return _bias(skinny_linear(h, *P.qkv), P.qkv_bias)

    def o_proj(self, i, attn, x):
        P = self.layers[i]
        return _bias(skinny_linear(attn, *P.o_proj, out=x), P.o_bias)

    def mlp(self, i, h, x):
        P = self.layers[i]
        act = silu_mul(_bias(skinny_linear(h, *P.gate_up), P.gate_up_bias))
        return _bias(skinny_linear(act, *P.down, out=x), P.down_bias)


def _bias(y: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return y if bias is None else y.add_(bias)


def skinny(model, kernels: bool) -> bool:
    """Whether ``model``'s steps of few rows run on the few-row matmul: the ``cpu_kernels`` backend's
    kernels on a CPU, in fp32 built with AVX-512 or in bf16 built with AVX512-BF16."""
    if not (kernels and model.device.type == "cpu" and cpu_kernels.available()):
        return False
    if model.dtype == torch.float32:
        return cpu_kernels.skinny_supported()
    return model.dtype == torch.bfloat16 and cpu_kernels.skinny_bf16_supported()


def _skinny_step(model, exact: bool, kernels: bool, rows: int) -> bool:
    return not exact and skinny(model, kernels) and rows <= skinny_max_rows(model)


def packs(model, exact: bool, kernels: bool = False) -> bool:
    """Whether a fused step of ``model`` runs on oneDNN-packed weights: on a CPU with the ops, in
    bf16, or in fp32 when the step has no fresh prefill (not held to transformers' exact
    rounding) and the few-row matmul is not in use (it has its own packed copy)."""
    if model.device.type != "cpu" or not _packing_available(model.dtype):
        return False
    if model.dtype == torch.float32 and skinny(model, kernels):
        return False
    return model.dtype == torch.bfloat16 or (model.dtype == torch.float32 and not exact)


def logits(model, hidden: torch.Tensor, exact: bool, kernels: bool = False) -> torch.Tensor:
    """``model.logits(hidden)`` (fp32 logits of the rows we sample from), the LM head packed when
    the step's matmuls are: the 49,152-wide head is the largest single matmul of a decode step."""
    if _skinny_step(model, exact, kernels, hidden.shape[0]):
        return skinny_linear(hidden, *skinny_head(model)).float()  # a no-op in fp32
    if not packs(model, exact, kernels):
        return model.logits(hidden)
    return torch.ops.mkldnn._linear_pointwise(hidden, packed_head(model), None, "none", [], "").float()


def skinny_head(model) -> tuple[torch.Tensor, int]:
    """The LM head in the few-row matmul's panels, with its width (packed once per model)."""
    state = prepared(model)
    if state.skinny_head is None:
        state.skinny_head = (cpu_kernels.skinny_pack(model.lm_head), model.lm_head.shape[0])
    return state.skinny_head


def packed_head(model) -> torch.Tensor:
    """The LM head in oneDNN's layout (packed once per model)."""
    state = prepared(model)
    if state.packed_head is None:
        state.packed_head = torch.ops.mkldnn._reorder_linear_weight(model.lm_head, 16)
    return state.packed_head


def prepare(model, kernels: bool = False) -> None:
    """Pack ``model``'s weights now, if any fused step of it would run on packed ones: the engine
    calls this when it is built, so that the reorder (a noticeable fraction of a second for
    SmolLM2) is paid at start-up, as vLLM pays its warm-up, not by the first request to reach a
    decode or a prefix hit, whose TTFT it would inflate several-fold.  In bf16 with the few-row matmul both copies are made: few-row steps use its
    panels, prefills oneDNN's.  Idempotent; forks sharing the weights share the packs."""
    if skinny(model, kernels):  # few-row steps (decodes, prefix hits)
        matmuls_for(model, exact=False, kernels=kernels, rows=1)
        skinny_head(model)
    if packs(model, exact=False, kernels=kernels):  # longer steps (bf16: prefills too)
        matmuls_for(model, exact=False, kernels=kernels)
        packed_head(model)


def matmuls_for(model, exact: bool, kernels: bool = False, rows: int | None = None):
    """The matmuls of one fused step of ``model`` over ``rows`` token rows (packed ones are built
    on first use and kept per model (``model_state.py``), so forks sharing its weights share them too).
    ``kernels``: the ``cpu_kernels`` backend's C++ ops may run (the few-row matmul; SwiGLU's one-pass op
    between dense matmuls: oneDNN-packed ones fuse SwiGLU already)."""
    if rows is not None and _skinny_step(model, exact, kernels, rows):
        state = prepared(model)
        if state.skinny is None:
            state.skinny = [SkinnyLayer(L) for L in model.layers]
        return SkinnyMatmuls(state.skinny)
    if not packs(model, exact, kernels):
        return DenseMatmuls(model, exact, kernels)
    state = prepared(model)
    if state.packed is None:
        state.packed = [PackedLayer(L, rows_hint=16) for L in model.layers]
    return PackedMatmuls(state.packed)
