"""The fused forward pass: the reference arithmetic, with the per-step work done once per step.

``attention.gather_attention`` (the reference) is written for reading: each layer loops over the
prefills, gathers every decoding sequence's blocks into a padded tensor and builds its masks.  On
a small model the layers are cheap, so that bookkeeping *is* the step: about 2,100 aten ops per
decode step for SmolLM2 at batch 16, each one a Python call and, on a GPU, a kernel launch.

This path computes the same thing (``tests/test_attention_fused.py`` holds it to 1e-4 of the
largest logit in fp32, greedy tokens identical) with three changes:

* **A plan per step, not per layer.**  :func:`~minikv.backends.fused_plan.build_plan` turns the
  batch into tensors once (``fused_plan.py``): the slot of every new token, the groups of
  sequences with their block tables and masks, the RoPE tables, and the buffers the layers
  write into.  Every layer reuses them.
* **Few attention calls per layer.**  A fresh prefill (nothing cached) attends over its own new
  K/V: one causal SDPA per sequence, on *views* of the flat batch (no padding, no gather; the
  same kernel call as transformers, so ``score`` matches it bit for bit in fp32).  Padding such
  prefills into one batch wastes the work of every short row (docs/BENCHMARKS.md, "Fused
  backend").  With the ``cpu_kernels`` backend's kernels, every fresh prefill of a step goes to one call
  of minikv's causal prefill kernel instead (``cpu_kernels.prefill_attention``: faster than
  SDPA one sequence at a time; not SDPA's bits, so ``score`` keeps SDPA).  Prefix-hit prefills form one group and decodes another: the queries over keys read
  from the pool, with an additive mask, and grouped-query attention folded into the query length
  (the ``rep`` query heads of one KV head become ``rep`` query rows), so never ``enable_gqa``
  with a mask: on CUDA that pair falls back to SDPA's slow math kernel.
* **Fewer ops per layer.**  RoPE is ``x * cos + roll(x) * sin`` (rotate-half's sign folded
  into the sine table; with the ``cpu_kernels`` backend's kernels, one C++ op with the same
  roundings in fp32 and bf16, ``cpu_kernels.rope_``); residual adds are in place; ``rms_norm`` is one op; the pool already
  has the model's dtype, so nothing is cast.  A step without a fresh prefill goes further (fused
  multiply-adds, residuals inside the matmul, q/k/v roped into the plan's buffer, blocks gathered
  into another, whose views the plan made once): see :func:`fused_forward`.  SmolLM2's decode
  step at batch 16 is 15 ops per layer and 492 in all (``tests/test_attention_fused.py``).

Where it reads the pool: keys and values are gathered per group, whole blocks at a time and both
at once (one ``index_select`` on the interleaved ``pool.kv_blocks[layer]``: one copy per block,
not per slot), padded to the group's longest context; new tokens' K and V are stored
with one ``index_copy_`` likewise.  The ``cpu_kernels`` backend skips that copy for decodes: a ``"paged"``
group hands the block tables to minikv's C++ kernel (``cpu_kernels.py``), which reads the pool in
place, as vLLM's PagedAttention does.  On CUDA a paged kernel (FlashInfer, or ``flex_attention``
with a paged block mask) would do the same; on the CPU ``flex_attention`` needs
``torch.compile``, which minikv never runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .fused_hit import HitPlan, rope_perm
from .fused_plan import FusedPlan, Group, kv_views
from .matmuls import matmuls_for
from .cpu_kernels import paged_decode, paged_prefill, prefill_attention, rms_norm as kernel_rms_norm, rope_ as kernel_rope_
from .cpu_kernels import rope_store_ as kernel_rope_store_
from .paged_triton import paged_attention as triton_attention


def attend(layer: int, q: torch.Tensor, kv: torch.Tensor, pool, plan: FusedPlan,
           scale: float) -> torch.Tensor:
    """Attention of the flat queries ``q`` ([T, q_heads, D]; ``kv``: the new tokens' K and V heads,
    [T, 2 * kv_heads, D], already written to the pool).  Returns [T, q_heads * D]."""
    t, heads, dim = q.shape
    kv_heads = pool.num_kv_heads
    rep = heads // kv_heads
    if len(plan.groups) > 1 or plan.groups[0].kind in ("causal", "triton"):
        out = q.new_empty(t, heads * dim)
    if any(g.kind in ("fresh", "causal") for g in plan.groups):  # they attend over the new K/V themselves
        k, v = kv.chunk(2, dim=1)
    for g in plan.groups:
        if g.kind == "causal":  # every fresh prefill, one kernel call writing its rows of ``out``
            prefill_attention(q, k, v, g.table, scale, out=out)
            continue
        if g.kind == "triton":  # hits and decodes, K/V read where they lie in the pool (CUDA)
            triton_attention(q, pool.kv_blocks[layer], g.table, g.ctx, scale, out=out, n_max=g.n_max)
            continue
        if g.kind == "paged":  # one query row per sequence; K and V read where they lie in the pool
            o = paged_decode(q if g.rows == slice(0, t) else q[g.rows], pool.kv_blocks[layer], g.table, g.ctx, scale)
        elif g.kind == "fresh":  # [S, heads, n_max, D] over [S, kv_heads, n_max, D], as transformers does
            qg, kg, vg = (x[g.rows].view(-1, g.n_max, x.shape[1], dim).transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True)
            o = o.transpose(1, 2).reshape(-1, heads * dim)
        else:
            kg, vg = _read(pool.kv_blocks[layer], g)  # [S, kv_heads, c_max, D] each
            if g.kind == "decode":  # [S, kv_heads, rep, D]: the rep query heads of a KV head as rows
                qg = g.q if g.q is not None else (q if g.rows == slice(0, t) else q[g.rows]).view(-1, kv_heads, rep, dim)
            else:  # [S, n_max, heads, D] -> [S, kv_heads, rep * n_max, D]
                qg = q[g.rows].view(-1, g.n_max, kv_heads, rep, dim).permute(0, 2, 3, 1, 4).reshape(
                    -1, kv_heads, rep * g.n_max, dim)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale)
            # reshape, not view: SDPA's output need not be contiguous.  On CUDA the kernel SDPA
            # picks for fp32 with a mask can return [S, kv_heads, rows, D] laid out as
            # [S, rows, kv_heads, D], which no view can flatten; reshape copies only then.
            if g.kind == "decode":
                o = o.reshape(-1, heads * dim)
            else:
                o = o.reshape(-1, kv_heads, rep, g.n_max, dim).permute(0, 3, 1, 2, 4).reshape(-1, heads * dim)
        if g.keep is not None:
            o = o[g.keep]
        if len(plan.groups) == 1:
            return o
        if isinstance(g.dest, slice):
            out[g.dest] = o
        else:
            out.index_copy_(0, g.dest, o)
    return out


def _read(blocks: torch.Tensor, g: Group) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's keys and values, each [S, kv_heads, c_max, D]: whole blocks copied out of one
    layer's interleaved ``[blocks, block_size, 2, kv_heads, D]`` pool with one ``index_select``,
    into the group's buffer when the plan made one (its K/V views made once for all layers,
    ``fused_plan.kv_views``)."""
    if g.gathered is None:
        return kv_views(blocks.index_select(0, g.table), g.mask.shape[0])
    torch.index_select(blocks, 0, g.table, out=g.gathered)
    return g.k, g.v


@torch.inference_mode()
def fused_forward(model, input_ids: torch.Tensor, pool, plan: FusedPlan) -> torch.Tensor:
    """Hidden states [T, hidden] of the flat batch (``LlamaModel.forward``'s contract)."""
    s = model.shape
    x = F.embedding(input_ids, model.embed)
    t, dim, norm = input_ids.shape[0], s.head_dim, (s.hidden_size,)
    # A step with a fresh prefill keeps transformers' own op sequence, so that prefill and ``score``
    # logits match it bit for bit in fp32.  Other steps (decodes, prefix-hit prefills) are held to
    # the decode tolerance (2e-4; attention over the pool reduces in another order anyway), so they
    # may fuse multiply-adds: RoPE with ``addcmul_``, each residual add inside its matmul
    # (``matmuls.py``).  Fewer ops per layer, each a Python dispatch on the CPU and a kernel
    # launch on a GPU.
    exact = plan.exact
    mm = matmuls_for(model, exact, plan.kernels, rows=t)  # F.linear, oneDNN-packed or few-row (matmuls.py)
    rms = _norm(model, exact, plan.kernels)
    if isinstance(plan, HitPlan):  # prefix hits without the kernels: 16 ops per layer (fused_hit.py)
        return _hit_forward(model, x, pool, plan, mm, rms)
    if plan.in_place:  # prefix hits on the kernels: nine ops per layer, K/V read where they lie
        return _in_place_forward(model, x, pool, plan, mm, rms)
    for i, L in enumerate(model.layers):
        h = rms(x, L.input_norm)
        qkv = mm.qkv(i, h).view(t, -1, dim)
        if plan.rope_kernel:  # the same arithmetic as the exact branch below, one pass instead of four ops
            kernel_rope_(qkv, plan.cos, plan.sin, s.num_heads + s.num_kv_heads)
        elif exact:  # RoPE on q and k, in place: x * cos + rotate_half(x) * sin, tables broadcast over heads
            qk = qkv[:, : s.num_heads + s.num_kv_heads]
            rot = qk.roll(dim // 2, -1).mul_(plan.sin)
            qk.mul_(plan.cos).add_(rot)
        else:  # the same over q, k and v at once (v's table: cos 1, sin 0), multiply-adds fused,
            rot = qkv.roll(dim // 2, -1)  # into the plan's buffer, whose views the plan made already
            torch.mul(qkv, plan.cos, out=plan.qkv).addcmul_(rot, plan.sin)
        if plan.qkv is not None:
            q, kv = plan.q, plan.kv
        else:
            q, kv = qkv.split([s.num_heads, 2 * s.num_kv_heads], dim=1)  # kv: K heads then V heads, as a pool slot
        pool.kv_slots[i].index_copy_(0, plan.slots, kv)  # K and V of every new token, one write
        x = mm.o_proj(i, attend(i, q, kv, pool, plan, model.scale), x)  # x + o_proj(attention)
        x = mm.mlp(i, rms(x, L.post_norm), x)  # x + down(silu(gate) * up)
    return rms(x, model.norm)


def _in_place_forward(model, x, pool, plan: FusedPlan, mm, rms) -> torch.Tensor:
    """The layers of an ``"in_place"`` plan (``fused_plan.in_place_plan``): RoPE and the pool write
    are one op on the qkv matmul's 2-D output (``cpu_kernels.rope_store_``), and the paged prefill
    kernel reads q from that output and K/V from the pool, writing the plan's one output buffer.
    No view, split, gather, mask or reshape is dispatched per layer."""
    g, heads = plan.groups[0], model.shape.num_heads
    for i, L in enumerate(model.layers):
        qkv = kernel_rope_store_(mm.qkv(i, rms(x, L.input_norm)), plan.cos, plan.sin, plan.positions,
                                 pool.kv_slots[i], plan.slots)
        attn = paged_prefill(qkv, pool.kv_blocks[i], g.ctx, g.table, model.scale, heads, plan.out)
        x = mm.o_proj(i, attn, x)
        x = mm.mlp(i, rms(x, L.post_norm), x)
    return rms(x, model.norm)


def _hit_forward(model, x, pool, plan: HitPlan, mm, rms) -> torch.Tensor:
    """The layers of a hit plan (``fused_hit.hit_plan``), in ATen ops only.  Every tensor a layer
    reads or writes besides the matmuls' outputs is a buffer or a view the plan made, so no view,
    mask, cast or index tensor is made per layer (the module docstring of ``fused_hit`` counts them)."""
    perm = rope_perm(model)
    for i, L in enumerate(model.layers):
        qkv = mm.qkv(i, rms(x, L.input_norm))  # [T, (heads + 2 * kv_heads) * D]
        # RoPE: x * cos + rotate_half(x) * sin, the halves swapped by one index_select on the 2-D rows
        torch.mul(qkv, plan.cos, out=plan.qkv).addcmul_(qkv.index_select(1, perm), plan.sin)
        pool.kv_slots[i].index_copy_(0, plan.slots, plan.kv)  # the new K/V, then the context's blocks back
        torch.index_select(pool.kv_blocks[i], 0, plan.table, out=plan.gathered)
        if plan.q_pad is not None:  # tails of different lengths: the padded rows first
            torch.index_select(plan.q, 0, plan.rows, out=plan.q_pad)
        plan.q_dst.copy_(plan.q_src)  # the rep query heads of a KV head as rows
        o = F.scaled_dot_product_attention(plan.q_fold, plan.k, plan.v, attn_mask=plan.mask, scale=model.scale)
        plan.out_dst.copy_(o.reshape(plan.out_dst.shape))  # reshape: SDPA's output need not be contiguous
        attn = plan.out if plan.keep is None else plan.out.index_select(0, plan.keep)
        x = mm.o_proj(i, attn, x)
        x = mm.mlp(i, rms(x, L.post_norm), x)
    return rms(x, model.norm)


def _norm(model, exact: bool, kernels: bool):
    """The step's RMSNorm: minikv's one-pass C++ op with the kernels, except where an fp32 step
    is held to transformers' exact rounding (its sum of squares runs in another order than
    ATen's: ~1e-6 apart); else ``F.rms_norm``, one ATen op (five inside)."""
    eps, shape = model.shape.rms_eps, (model.shape.hidden_size,)
    if kernels and not (exact and model.dtype == torch.float32):
        return lambda x, w: kernel_rms_norm(x, w, eps)
    return lambda x, w: F.rms_norm(x, shape, w, eps)
