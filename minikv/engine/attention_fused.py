"""The fused forward pass: the reference arithmetic, with the per-step work done once per step.

``attention.paged_attention`` (the reference) is written for reading: each layer loops over the
prefills, gathers every decoding sequence's blocks into a padded tensor and builds its masks.  On
a small model the layers are cheap, so that bookkeeping *is* the step: about 2,100 aten ops per
decode step for SmolLM2 at batch 16, each one a Python call and, on a GPU, a kernel launch.

This path computes the same thing (``tests/test_attention_fused.py`` holds it to 1e-4 of the
largest logit in fp32, greedy tokens identical) with three changes:

* **A plan per step, not per layer.**  :func:`build_plan` turns the batch into tensors once:
  the slot of every new token, for each *group* of sequences the pool block of every key
  block (short rows padded with the pool's always-zero pad block) and an additive mask, and
  the RoPE tables.  Every layer reuses them.
* **Few attention calls per layer.**  A fresh prefill (nothing cached) attends over its own new
  K/V: one causal SDPA per sequence, on *views* of the flat batch (no padding, no gather; the
  same kernel call as transformers, so ``score`` matches it bit for bit in fp32).  Padding such
  prefills into one batch wastes the work of every short row: on the 2-core CPU, 12 prompts of
  128-429 tokens took 26.9 ms per layer padded against 11.7 ms one by one (fp32; 11.0 vs 6.0 ms
  in bf16).  Prefix-hit prefills form one group and decodes another: the queries over keys read
  from the pool, with an additive mask, and grouped-query attention folded into the query length
  (the ``rep`` query heads of one KV head become ``rep`` query rows), so never ``enable_gqa``
  with a mask: on CUDA that pair falls back to SDPA's slow math kernel.
* **Fewer ops per layer.**  RoPE is ``x * cos + roll(x) * sin`` (rotate-half's sign folded
  into the sine table; with the ``paged`` backend's kernels, one C++ op with the same
  roundings in fp32 and bf16, ``paged_cpu.rope_``); residual adds are in place; ``rms_norm`` is one op; the pool already
  has the model's dtype, so nothing is cast.  A step without a fresh prefill goes further (fused
  multiply-adds, residuals inside the matmul): see :func:`fused_forward`.

Where it reads the pool: keys and values are gathered per group, whole blocks at a time and both
at once (one ``index_select`` on the interleaved ``pool.kv_blocks[layer]``: 2-3x faster on the CPU
than indexing every slot), padded to the group's longest context; new tokens' K and V are stored
with one ``index_copy_`` likewise.  The ``paged`` backend skips that copy for decodes: a ``"paged"``
group hands the block tables to minikv's C++ kernel (``paged_cpu.py``), which reads the pool in
place, as vLLM's PagedAttention does.  On CUDA a paged kernel (FlashInfer, or ``flex_attention``
with a paged block mask) would do the same; on the CPU ``flex_attention`` needs
``torch.compile``, which minikv never runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .matmuls import matmuls_for
from .paged_cpu import paged_decode, rms_norm as kernel_rms_norm, rope_ as kernel_rope_

# A prefix-hit group is split into one group per sequence when padding it to its longest member
# would more than double the query rows (one 4,000-token tail among short ones, say).
MAX_PAD_FACTOR = 2.0
# Decodes are split into two groups when that saves gathering at least this many blocks per layer.
# An extra group costs about ten ops per layer (~50 us on the 2-core CPU), a gathered block of
# SmolLM2 (K and V, 16 tokens) a few microseconds; 16 prompts of 128-473 tokens save ~90 blocks
# (3-4% of a decode step, measured), while short contexts never split.
MIN_BLOCKS_SAVED = 32


@dataclass
class Group:
    """One batched attention call over ``S`` sequences of one kind, ``n_max`` query rows each.

    ``kind`` is ``"fresh"`` (one prefill with nothing cached: causal attention over its own new
    K/V, exactly what transformers computes), ``"cached"`` (prefix-hit
    prefills: the new tokens over the whole context, read from the pool, with a mask),
    ``"decode"`` (one query per sequence, over the pool, with a mask) or ``"paged"`` (every
    decode, read in place by the C++ kernel: ``table`` is then [S, width] and
    ``ctx`` the context lengths; no mask, no gather)."""

    kind: str
    rows: torch.Tensor | slice  # [S, n_max] flat rows of the queries (decode: a slice, one row each)
    dest: torch.Tensor | slice  # flat rows of the real queries, in the order of ``keep``
    keep: torch.Tensor | None  # real rows of the padded [S * n_max] output (None: all of them)
    n_max: int
    table: torch.Tensor | None = None  # [S * width] pool block of every key block (pad block past the end; "paged": [S, width])
    mask: torch.Tensor | None = None  # [S, 1, rep * n_max or 1, c_max] additive (0 / -inf), model dtype
    ctx: torch.Tensor | None = None  # [S] context lengths ("paged" only)


@dataclass
class FusedPlan:
    """Everything the fused layers need about one step, built once (:func:`build_plan`)."""

    slots: torch.Tensor  # [T] pool slot of each new token
    cos: torch.Tensor  # [T, 1, head_dim]; not exact: [T, q_heads + 2 * kv_heads, head_dim], 1 on v's heads
    sin: torch.Tensor  # same shape, rotate-half's sign folded in (not exact: 0 on v's heads)
    groups: list[Group]
    exact: bool = True  # a fresh prefill is in the step: keep transformers' op order (see fused_forward)
    kernels: bool = False  # the "paged" backend: minikv's C++ CPU kernels (paged_cpu.py) where they apply
    rope_kernel: bool = False  # RoPE by minikv's one-pass op (the kernels, fp32 or bf16): cos/sin stay [T, 1, head_dim]


def to_device(values, dtype, device) -> torch.Tensor:
    """A host list as a tensor on ``device``; on CUDA through pinned memory, without blocking."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def _padded_rows(starts, news, n_max, device):
    """``(rows, dest, keep)``: [S, n_max] flat rows of each sequence's queries (padding repeats
    its last row: finite, never kept), the flat rows of the real queries, and their indices in
    the padded [S * n_max] output."""
    rows = to_device([[st + min(i, n - 1) for i in range(n_max)] for st, n in zip(starts, news)], torch.long, device)
    keep = to_device([i * n_max + j for i, n in enumerate(news) for j in range(n)], torch.long, device)
    dest = to_device([st + j for st, n in zip(starts, news) for j in range(n)], torch.long, device)
    return rows, dest, keep


def _group(kind, starts, news, contexts, tables, *, block_size, pad_block, rep, dtype, device) -> Group:
    """Plan one group: sequence ``i`` has ``news[i]`` new tokens at flat rows ``starts[i]...``,
    ``contexts[i]`` tokens in all (cached + new) and block table ``tables[i]``."""
    n_max = max(news)
    if kind == "fresh":  # one sequence, is_causal over its own rows: a view, no mask, no pool read
        rows = slice(starts[0], starts[0] + n_max)
        return Group(kind, rows, rows, None, n_max)
    width = max(map(len, tables))
    table = to_device([t + [pad_block] * (width - len(t)) for t in tables], torch.long, device)
    ctx = to_device(contexts, torch.long, device)
    if kind == "paged":  # the kernel follows the table itself and stops at each context length
        rows = slice(starts[0], starts[0] + len(starts))
        return Group(kind, rows, rows, None, n_max, table, ctx=ctx)
    if kind == "decode":  # the query is the last position; it sees the whole context
        rows = slice(starts[0], starts[0] + len(starts))
        return Group(kind, rows, rows, None, n_max, table.flatten(), decode_mask(ctx, width * block_size, dtype))
    # causal over the context: query i sits at position context - new + i
    keys = torch.arange(width * block_size, device=device)
    qpos = (ctx - to_device(news, torch.long, device))[:, None] + torch.arange(n_max, device=device)
    allowed = (keys[None, None, :] <= qpos[:, :, None]) & (keys[None, None, :] < ctx[:, None, None])
    allowed = allowed[:, None].expand(-1, rep, -1, -1).reshape(len(news), 1, rep * n_max, -1)
    return Group(kind, *_padded_rows(starts, news, n_max, device), n_max, table.flatten(), _additive(allowed, dtype))


def _additive(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """The boolean mask as SDPA's additive one: 0 where a query may look, -inf where it may not."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))


def decode_mask(ctx: torch.Tensor, num_keys: int, dtype) -> torch.Tensor:
    """[S, 1, 1, num_keys] additive mask of a decode group: sequence ``i`` sees its first
    ``ctx[i]`` key slots, never the rest of its last block or the pad block past it."""
    keys = torch.arange(num_keys, device=ctx.device)
    return _additive((keys[None, :] < ctx[:, None])[:, None, None, :], dtype)


def build_plan(model, positions: torch.Tensor, slots: torch.Tensor, prefills: list[tuple],
               decodes: list[tuple], block_size: int, pad_block: int, paged: bool = False) -> FusedPlan:
    """``prefills``: ``(start_row, num_new, context_len, block_table)`` per prefilling sequence;
    ``decodes``: ``(row, context_len, block_table)`` per decoding one (rows after the prefills).
    ``paged``: all decodes form one ``"paged"`` group for the C++ kernel (it pads nothing, so
    there is nothing to gain from splitting them by length).  Prefix-hit prefills stay on SDPA
    over a gathered copy: a causal multi-query version of the kernel was tried and lost, because
    one sequence gives it only ``kv_heads`` tasks and it computes a row at a time where SDPA's
    kernel works in tiles: one prefill over a 1,024-token context took 0.7x (8 new tokens), 2.5x
    (28) and 3.3x (256) the time of gather + SDPA in fp32, 1.8-6.7x in bf16 (measured, 2-core CPU)."""
    s, device, dtype = model.shape, model.device, model.dtype
    cos, sin = model.rotary(positions)  # [T, 1, D], the model's dtype
    half = s.head_dim // 2
    sin = sin * torch.cat([-sin.new_ones(half), sin.new_ones(half)])  # rotate-half's sign, folded in
    # Only a fresh prefill is held to transformers' exact rounding (its logits, and ``score``'s, match
    # bit for bit); prefix-hit prefills and decodes reduce in another order anyway (2e-4).
    exact = any(p[1] == p[2] for p in prefills)
    # minikv's RoPE op rotates q and k in place in one pass, bit for bit ATen's ops (pointwise.cpp)
    rope_kernel = paged and dtype in (torch.float32, torch.bfloat16)
    if not exact and not rope_kernel:  # tables over q, k *and* v heads (v: cos 1, sin 0), so one fused op ropes them all
        qk, t = s.num_heads + s.num_kv_heads, positions.shape[0]
        cos = torch.cat([cos.expand(t, qk, -1), cos.new_ones(t, s.num_kv_heads, s.head_dim)], dim=1)
        sin = torch.cat([sin.expand(t, qk, -1), sin.new_zeros(t, s.num_kv_heads, s.head_dim)], dim=1)
    kw = dict(block_size=block_size, pad_block=pad_block, rep=s.num_heads // s.num_kv_heads,
              dtype=dtype, device=device)
    groups = []
    for kind in ("fresh", "cached"):
        mine = [p for p in prefills if (p[1] == p[2]) == (kind == "fresh")]
        if not mine:
            continue
        news = [p[1] for p in mine]
        padded_ok = kind == "cached" and len(mine) * max(news) <= MAX_PAD_FACTOR * sum(news)
        chunks = [mine] if padded_ok else [[p] for p in mine]  # fresh: always one per sequence
        for c in chunks:
            groups.append(_group(kind, [p[0] for p in c], [p[1] for p in c], [p[2] for p in c], [p[3] for p in c], **kw))
    for c in ([decodes] if paged and decodes else _split_decodes(decodes, block_size)):
        groups.append(_group("paged" if paged else "decode", [d[0] for d in c], [1] * len(c), [d[1] for d in c], [d[2] for d in c], **kw))
    return FusedPlan(slots, cos, sin, groups, exact=exact, kernels=paged, rope_kernel=rope_kernel)


def _split_decodes(decodes: list[tuple], block_size: int) -> list[list[tuple]]:
    """The decodes (sorted by context length, rows in that order) as one group, or two when that
    saves gathering ``MIN_BLOCKS_SAVED`` blocks: a group reads ``S * width`` blocks, width being
    its longest context, so short contexts batched with a long one pay for its length."""
    if len(decodes) < 2:
        return [decodes] if decodes else []
    widths = [-(-d[1] // block_size) for d in decodes]
    one = len(widths) * widths[-1]
    cost, i = min((i * widths[i - 1] + (len(widths) - i) * widths[-1], i) for i in range(1, len(widths)))
    return [decodes[:i], decodes[i:]] if one - cost >= MIN_BLOCKS_SAVED else [decodes]


def attend(layer: int, q: torch.Tensor, kv: torch.Tensor, pool, plan: FusedPlan,
           scale: float) -> torch.Tensor:
    """Attention of the flat queries ``q`` ([T, q_heads, D]; ``kv``: the new tokens' K and V heads,
    [T, 2 * kv_heads, D], already written to the pool).  Returns [T, q_heads * D]."""
    t, heads, dim = q.shape
    kv_heads = pool.num_kv_heads
    rep = heads // kv_heads
    if len(plan.groups) > 1:
        out = q.new_empty(t, heads * dim)
    if any(g.kind == "fresh" for g in plan.groups):  # they attend over the new K/V themselves
        k, v = kv.chunk(2, dim=1)
    for g in plan.groups:
        if g.kind == "paged":  # one query row per sequence; K and V read where they lie in the pool
            o = paged_decode(q if g.rows == slice(0, t) else q[g.rows], pool.kv_blocks[layer], g.table, g.ctx, scale)
        elif g.kind == "fresh":  # [S, heads, n_max, D] over [S, kv_heads, n_max, D], as transformers does
            qg, kg, vg = (x[g.rows].view(-1, g.n_max, x.shape[1], dim).transpose(1, 2) for x in (q, k, v))
            o = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale, enable_gqa=True)
            o = o.transpose(1, 2).reshape(-1, heads * dim)
        else:
            kg, vg = _read(pool.kv_blocks[layer], g)  # [S, kv_heads, c_max, D] each
            if g.kind == "decode":  # [S, kv_heads, rep, D]: the rep query heads of a KV head as rows
                qg = (q if g.rows == slice(0, t) else q[g.rows]).view(-1, kv_heads, rep, dim)
            else:  # [S, n_max, heads, D] -> [S, kv_heads, rep * n_max, D]
                qg = q[g.rows].view(-1, g.n_max, kv_heads, rep, dim).permute(0, 2, 3, 1, 4).reshape(
                    -1, kv_heads, rep * g.n_max, dim)
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=g.mask, scale=scale)
            if g.kind == "decode":
                o = o.view(-1, heads * dim)
            else:
                o = o.view(-1, kv_heads, rep, g.n_max, dim).permute(0, 3, 1, 2, 4).reshape(-1, heads * dim)
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
    layer's interleaved ``[blocks, block_size, 2, kv_heads, D]`` pool with one ``index_select``.

    The copy is [S * width, block_size, 2, kv_heads, D], which is [S, c_max, 2, kv_heads, D] in
    memory; SDPA wants heads before positions, so we hand it that memory with the axes swapped
    (one ``as_strided`` each for K and V, V starting ``kv_heads * D`` elements in: views, no copy)."""
    x = blocks.index_select(0, g.table)
    heads, dim = x.shape[3], x.shape[4]
    s = g.mask.shape[0]
    c_max = x.shape[0] * x.shape[1] // s
    size, stride = (s, heads, c_max, dim), (c_max * 2 * heads * dim, dim, 2 * heads * dim, 1)
    return x.as_strided(size, stride), x.as_strided(size, stride, heads * dim)


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
    for i, L in enumerate(model.layers):
        h = rms(x, L.input_norm)
        qkv = mm.qkv(i, h).view(t, -1, dim)
        if plan.rope_kernel:  # the same arithmetic as the exact branch below, one pass instead of four ops
            kernel_rope_(qkv, plan.cos, plan.sin, s.num_heads + s.num_kv_heads)
        elif exact:  # RoPE on q and k, in place: x * cos + rotate_half(x) * sin, tables broadcast over heads
            qk = qkv[:, : s.num_heads + s.num_kv_heads]
            rot = qk.roll(dim // 2, -1).mul_(plan.sin)
            qk.mul_(plan.cos).add_(rot)
        else:  # the same over q, k and v at once (v's table: cos 1, sin 0), multiply-adds fused
            qkv = (qkv * plan.cos).addcmul_(qkv.roll(dim // 2, -1), plan.sin)
        q, kv = qkv.split([s.num_heads, 2 * s.num_kv_heads], dim=1)  # kv: K heads then V heads, as a pool slot
        pool.kv_slots[i].index_copy_(0, plan.slots, kv)  # K and V of every new token, one write
        x = mm.o_proj(i, attend(i, q, kv, pool, plan, model.scale), x)  # x + o_proj(attention)
        x = mm.mlp(i, rms(x, L.post_norm), x)  # x + down(silu(gate) * up)
    return rms(x, model.norm)


def _norm(model, exact: bool, kernels: bool):
    """The step's RMSNorm: minikv's one-pass C++ op with the kernels, except where an fp32 step
    is held to transformers' exact rounding (its sum of squares runs in another order than
    ATen's: ~1e-6 apart); else ``F.rms_norm``, one ATen op (five inside)."""
    eps, shape = model.shape.rms_eps, (model.shape.hidden_size,)
    if kernels and not (exact and model.dtype == torch.float32):
        return lambda x, w: kernel_rms_norm(x, w, eps)
    return lambda x, w: F.rms_norm(x, shape, w, eps)
