"""The fused backend's prefix-hit step, in plain PyTorch: the plan made once, the layers lean.

A prefix hit computes a few new tokens against many cached ones.  Its arithmetic is small, so on
a small model its cost is the number of ops it dispatches (each a Python call, and on a GPU a
kernel launch), and a hit must dispatch fewer than a miss (``tests/test_paged_prefill.py``).  The
general fused path (``fused_plan.build_plan``) spends more ops per layer on a hit: every layer
views, permutes and reshapes its queries, indexes its padded rows and unpicks SDPA's output.  Here everything that
is the same in every layer is done once per step (:func:`hit_plan`), and a layer is 16 ops
(``attention_fused._hit_forward``; the ``cpu_kernels`` backend's C++ kernels get it to nine)::

    rms_norm, qkv matmul                                  2
    RoPE: index_select (rotate-half), mul(out=), addcmul_  3   in 2-D: no view of the matmul's output
    new K/V into the pool, needed blocks out of it         2   index_copy_, index_select(out=)
    queries folded (copy_ into a view made once), SDPA     2
    output unfolded (view, copy_ into a view made once)    2
    o_proj (+ residual), rms_norm, MLP (+ residual)        5   packed oneDNN; dense bf16 has two more

Grouped-query attention is folded into the query length, as ``attention_fused.attend`` does for
its ``"cached"`` groups (the ``rep`` query heads of one KV head become ``rep * n`` query rows, in
head-major order), so that SDPA never gets ``enable_gqa`` with a mask (on CUDA that pair falls
back to SDPA's math kernel).  The mask, the RoPE tables and every buffer and view are made here,
once; all sequences of the step (hits, and decodes as one-token hits) form one group, padded to
the longest when that costs at most ``MAX_PAD_FACTOR`` (else the step takes the general path).

Thirty layers at 16 ops cannot reach the 300-op budget of ``tests/test_paged_prefill.py`` without
fusing ops into kernels: that is the ``cpu_kernels`` backend (the counts: docs/BENCHMARKS.md,
"Fused backend").
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.model_runner import to_device_split
from .fused_plan import MAX_PAD_FACTOR, kv_views, rope_tables
from .model_state import prepared


@dataclass
class HitPlan:
    """What every layer of a hit step reads or writes (made by :func:`hit_plan`)."""

    slots: torch.Tensor  # [T] pool slot of each new token
    cos: torch.Tensor  # [T, (q_heads + 2 * kv_heads) * D], 1 in v's columns
    sin: torch.Tensor  # the same, rotate-half's sign folded in, 0 in v's columns
    qkv: torch.Tensor  # [T, (q_heads + 2 * kv_heads) * D]: each layer's roped q/k/v
    q: torch.Tensor  # [T, q_heads, D] view of ``qkv``
    kv: torch.Tensor  # [T, 2 * kv_heads, D] view of ``qkv``: what goes to the pool
    table: torch.Tensor  # [S * width] pool block of every key block (pad block past a context)
    gathered: torch.Tensor  # [S * width, block_size, 2, kv_heads, D]: each layer's blocks
    k: torch.Tensor  # [S, kv_heads, c_max, D] view of ``gathered``
    v: torch.Tensor
    mask: torch.Tensor  # [S, 1, rep * n_max, c_max] additive, in the folded rows' order
    q_src: torch.Tensor  # [S, kv_heads, rep, n_max, D] view of the (padded) queries
    q_fold: torch.Tensor  # [S, kv_heads, rep * n_max, D]: what SDPA reads
    q_dst: torch.Tensor  # [S, kv_heads, rep, n_max, D] view of ``q_fold``
    out: torch.Tensor  # [S * n_max, q_heads * D]: each layer's attention output (padded rows too)
    out_dst: torch.Tensor  # [S, kv_heads, rep, n_max, D] view of ``out``
    rows: torch.Tensor | None = None  # padded: [S * n_max] row of ``qkv`` behind each padded row
    q_pad: torch.Tensor | None = None  # padded: [S * n_max, heads, D], the rows gathered
    keep: torch.Tensor | None = None  # padded: [T] rows of ``out`` that are real queries
    exact: bool = False  # (what run_model asks every plan: never transformers' exact rounding)
    kernels: bool = False


def hit_seqs(prefills: list[tuple], decodes: list[tuple]) -> list[tuple] | None:
    """``(start_row, num_new, context_len, block_table)`` of every sequence when the step can run
    as one hit group: prefix hits (no fresh prefill), decodes as one-token hits, and padding to the
    longest tail costing at most ``MAX_PAD_FACTOR``.  None otherwise."""
    if not prefills or any(p[1] == p[2] for p in prefills):
        return None
    seqs = list(prefills) + [(d[0], 1, d[1], d[2]) for d in decodes]
    news = [q[1] for q in seqs]
    return seqs if len(seqs) * max(news) <= MAX_PAD_FACTOR * sum(news) else None


def hit_lists(seqs: list[tuple], pad_block: int, rep: int) -> list[list[int]]:
    """The plan's host lists, to go to the device with the step's others in one copy: block tables
    (padded with ``pad_block``, flat), each folded query row's position (for the mask), and, when
    tails differ in length, the padded rows' sources and the real rows' places."""
    width, n_max = max(len(q[3]) for q in seqs), max(q[1] for q in seqs)
    table = [b for q in seqs for b in q[3] + [pad_block] * (width - len(q[3]))]
    # folded row (r, i) of sequence (start, n, ctx): query i, at position ctx - n + i (padding
    # repeats the last query: finite, never kept)
    qpos = [c - n + min(i, n - 1) for _, n, c, _ in seqs for _ in range(rep) for i in range(n_max)]
    if all(q[1] == n_max for q in seqs):
        return [table, qpos]
    rows = [st + min(i, n - 1) for st, n, _, _ in seqs for i in range(n_max)]
    keep = [k * n_max + i for k, (_, n, _, _) in enumerate(seqs) for i in range(n)]
    return [table, qpos, rows, keep]


def hit_plan(model, positions, slots, seqs, lists, block_size: int) -> HitPlan:
    """The plan of a hit step (``lists``: :func:`hit_lists` on the device)."""
    s, dtype = model.shape, model.dtype
    t, heads, kvh, dim = positions.shape[0], s.num_heads, s.num_kv_heads, s.head_dim
    rep, n_max, n_seqs = heads // kvh, max(q[1] for q in seqs), len(seqs)
    table, qpos, *padding = lists
    # RoPE over q, k and v at once, in 2-D (v's rows of the tables: cos 1, sin 0)
    cos_table, sin_table = rope_tables(model)
    idx = torch.where(prepared(model).rope_heads_v, s.max_position, positions.view(-1, 1))  # [T, heads]
    cos, sin = cos_table[idx].view(t, -1), sin_table[idx].view(t, -1)
    qkv = cos.new_empty(cos.shape)
    qkv3 = qkv.view(t, -1, dim)
    q = qkv3[:, :heads]
    gathered = torch.empty(table.shape[0], block_size, 2, kvh, dim, dtype=dtype, device=model.device)
    k, v = kv_views(gathered, n_seqs)
    c_max = k.shape[2]
    hidden = torch.arange(c_max, device=model.device) > qpos.view(n_seqs, 1, rep * n_max, 1)
    mask = torch.zeros(hidden.shape, dtype=dtype, device=model.device).masked_fill_(hidden, float("-inf"))
    plan_rows = q_pad = keep = None
    if padding:  # each layer gathers the padded rows of q first
        plan_rows, keep = padding
        q_pad = qkv3.new_empty(n_seqs * n_max, heads, dim)
        q_rows = q_pad
    else:
        q_rows = q
    q_src = q_rows.view(n_seqs, n_max, kvh, rep, dim).permute(0, 2, 3, 1, 4)
    q_fold = qkv.new_empty(n_seqs, kvh, rep * n_max, dim)
    out = qkv.new_empty(n_seqs * n_max, heads * dim)
    return HitPlan(slots, cos, sin, qkv, q, qkv3[:, heads:], table, gathered, k, v, mask, q_src, q_fold,
                   q_fold.view(n_seqs, kvh, rep, n_max, dim),
                   out, out.view(n_seqs, n_max, kvh, rep, dim).permute(0, 2, 3, 1, 4), plan_rows, q_pad, keep)


def rope_perm(model) -> torch.Tensor:
    """[(q_heads + 2 * kv_heads) * D] column indices that rotate every head's halves (what
    ``x.roll(D // 2, -1)`` does per head), for one ``index_select`` on the 2-D qkv; made once per model."""
    state = prepared(model)
    if state.rope_perm is None:
        s = model.shape
        d = torch.arange(s.head_dim, device=model.device)
        heads = torch.arange(s.num_heads + 2 * s.num_kv_heads, device=model.device)[:, None]
        state.rope_perm = (heads * s.head_dim + (d + s.head_dim // 2) % s.head_dim).view(-1)
    return state.rope_perm
