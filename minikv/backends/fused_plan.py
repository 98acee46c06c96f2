"""The fused backend's plan: what every layer of one step needs, built once for the step.

``attention.gather_attention`` (the reference) works out, in every layer, which rows belong to
which sequence, gathers the blocks and builds the masks.  The answers are the same in all
layers, so the fused backend (``attention_fused.py``) asks once per step: :func:`build_plan`
turns the batch into tensors (the slot of every new token; per *group* of sequences the pool
block of every key block, short rows padded with the pool's always-zero pad block, and an
additive mask; the RoPE tables), and allocates the buffers the layers write into:

* ``FusedPlan.qkv``: a step that is not held to transformers' exact rounding writes each layer's
  roped q/k/v here (``torch.mul(..., out=)``), so the views every layer reads (q, the K/V that
  go to the pool, each decode group's queries) are made once, not 30 times;
* ``Group.gathered``: a group that reads the pool (``"decode"``, ``"cached"``) gathers its
  blocks into the same buffer in every layer (``index_select(..., out=)``), so its K and V
  views are made once too.

A view costs no arithmetic, but it is an op: a Python dispatch on the CPU, and every op of a
small model's decode step is overhead the step pays.  SmolLM2 at batch 16, counted with
``torch.profiler``: 644 ops per step when every layer made its own views and the plan computed
its RoPE tables and sent its metadata in seven tensors; 492 with the buffers, the tables looked up
(:func:`rope_tables`) and the metadata sent in one tensor per step and one per group (``tests/test_attention_fused.py`` holds it
to at most 500).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..engine.model_runner import to_device, to_device_split
from .model_state import prepared

# A prefix-hit group is split into one group per sequence when padding it to its longest member
# would more than double the query rows (one 4,000-token tail among short ones, say).
MAX_PAD_FACTOR = 2.0
# Decodes are split into two groups when that saves gathering at least this many blocks per layer.
# An extra group costs about ten ops per layer, a gathered block of SmolLM2 (K and V, 16 tokens)
# a few microseconds, so only a large saving pays for it; short contexts never split.
MIN_BLOCKS_SAVED = 32


@dataclass
class Group:
    """One batched attention call over ``S`` sequences of one kind, ``n_max`` query rows each.

    ``kind`` is ``"fresh"`` (one prefill with nothing cached: causal attention over its own new
    K/V, exactly what transformers computes), ``"causal"`` (with the kernels: *every* fresh
    prefill of the step, in one call of the C++ kernel; ``table`` is then [S, 2], each
    sequence's first row and length), ``"cached"`` (prefix-hit
    prefills: the new tokens over the whole context, read from the pool, with a mask),
    ``"decode"`` (one query per sequence, over the pool, with a mask) or ``"paged"`` (every
    decode, read in place by the C++ kernel: ``table`` is then [S, width] and
    ``ctx`` the context lengths; no mask, no gather) or ``"triton"`` (CUDA: hits and decodes
    read in place by the Triton kernel; ``ctx`` [S, 3] each one's first row, new tokens, context)."""

    kind: str
    rows: torch.Tensor | slice  # [S, n_max] flat rows of the queries (decode: a slice, one row each)
    dest: torch.Tensor | slice  # flat rows of the real queries, in the order of ``keep``
    keep: torch.Tensor | None  # real rows of the padded [S * n_max] output (None: all of them)
    n_max: int
    table: torch.Tensor | None = None  # [S * width] pool block of every key block (pad block past the end; "paged": [S, width])
    mask: torch.Tensor | None = None  # [S, 1, rep * n_max or 1, c_max] additive (0 / -inf), model dtype
    ctx: torch.Tensor | None = None  # [S] context lengths ("paged" only)
    # Buffers for the layers (made by ``_bind``; None where a group does not read the pool):
    gathered: torch.Tensor | None = None  # [S * width, block_size, 2, kv_heads, D]: each layer's copy of the blocks
    k: torch.Tensor | None = None  # [S, kv_heads, c_max, D] view of ``gathered``
    v: torch.Tensor | None = None  # the same for V
    q: torch.Tensor | None = None  # decode, with ``FusedPlan.qkv``: [S, kv_heads, rep, D] view of its rows


@dataclass
class FusedPlan:
    """Everything the fused layers need about one step, built once (:func:`build_plan`)."""

    slots: torch.Tensor  # [T] pool slot of each new token
    cos: torch.Tensor  # [T, 1, head_dim]; not exact: [T, q_heads + 2 * kv_heads, head_dim], 1 on v's heads
    sin: torch.Tensor  # same shape, rotate-half's sign folded in (not exact: 0 on v's heads)
    groups: list[Group]
    exact: bool = True  # a fresh prefill is in the step: keep transformers' op order (see fused_forward)
    kernels: bool = False  # the "cpu_kernels" backend: minikv's C++ CPU kernels (cpu_kernels.py) where they apply
    rope_kernel: bool = False  # RoPE by minikv's one-pass op (the kernels, fp32 or bf16): cos/sin stay [T, 1, head_dim]
    qkv: torch.Tensor | None = None  # not exact, no RoPE kernel: [T, q_heads + 2 * kv_heads, D], each layer's roped q/k/v
    q: torch.Tensor | None = None  # [T, q_heads, D] view of ``qkv``
    kv: torch.Tensor | None = None  # [T, 2 * kv_heads, D] view: K heads then V heads, as a pool slot
    in_place: bool = False  # one "in_place" group: RoPE and the pool write in one op, attention in place (the kernels)
    out: torch.Tensor | None = None  # in_place: [T, q_heads * D], every layer's attention output
    positions: torch.Tensor | None = None  # in_place: [T] position of each row (cos/sin are then whole tables)


def _padded_rows(starts, news, n_max, device):
    """``(rows, dest, keep)``: [S, n_max] flat rows of each sequence's queries (padding repeats
    its last row: finite, never kept), the flat rows of the real queries, and their indices in
    the padded [S * n_max] output."""
    rows, keep, dest = to_device_split([[st + min(i, n - 1) for st, n in zip(starts, news) for i in range(n_max)],
                                        [i * n_max + j for i, n in enumerate(news) for j in range(n)],
                                        [st + j for st, n in zip(starts, news) for j in range(n)]], device)
    return rows.view(len(news), n_max), dest, keep


def _group(kind, starts, news, contexts, tables, *, block_size, pad_block, rep, dtype, device) -> Group:
    """Plan one group: sequence ``i`` has ``news[i]`` new tokens at flat rows ``starts[i]...``,
    ``contexts[i]`` tokens in all (cached + new) and block table ``tables[i]``."""
    n_max = max(news)
    if kind == "fresh":  # one sequence, is_causal over its own rows: a view, no mask, no pool read
        rows = slice(starts[0], starts[0] + n_max)
        return Group(kind, rows, rows, None, n_max)
    if kind == "causal":  # the kernel writes each sequence's rows of the step's output itself
        seqs = to_device([[st, n] for st, n in zip(starts, news)], torch.long, device)
        return Group(kind, slice(0, 0), slice(0, 0), None, n_max, seqs)
    width = max(map(len, tables))
    table, ctx = to_device_split([[b for t in tables for b in t + [pad_block] * (width - len(t))], contexts], device)
    if kind == "paged":  # the kernel follows the table itself and stops at each context length
        rows = slice(starts[0], starts[0] + len(starts))
        return Group(kind, rows, rows, None, n_max, table.view(len(tables), width), ctx=ctx)
    if kind == "decode":  # the query is the last position; it sees the whole context
        rows = slice(starts[0], starts[0] + len(starts))
        return Group(kind, rows, rows, None, n_max, table, decode_mask(ctx, width * block_size, dtype))
    # causal over the context: query i sits at position context - new + i
    keys = torch.arange(width * block_size, device=device)
    qpos = (ctx - to_device(news, torch.long, device))[:, None] + torch.arange(n_max, device=device)
    allowed = (keys[None, None, :] <= qpos[:, :, None]) & (keys[None, None, :] < ctx[:, None, None])
    allowed = allowed[:, None].expand(-1, rep, -1, -1).reshape(len(news), 1, rep * n_max, -1)
    return Group(kind, *_padded_rows(starts, news, n_max, device), n_max, table,
                 torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf")))


def _triton_group(seqs: list[tuple], pad_block: int, device) -> Group:
    """One ``"triton"`` group of ``seqs`` (``(start_row, num_new, context_len, block_table)``): ``table``
    [S, width], ``ctx`` [S, 3] (first row, new tokens, context length); the kernel writes the rows."""
    table, meta = to_device_split(in_place_lists(seqs, [], pad_block), device)
    return Group("triton", slice(0, 0), slice(0, 0), None, max(q[1] for q in seqs),
                 table.view(len(seqs), -1), ctx=meta.view(len(seqs), 3))


def decode_mask(ctx: torch.Tensor, num_keys: int, dtype) -> torch.Tensor:
    """[S, 1, 1, num_keys] additive mask of a decode group (0 where a query may look, -inf where
    not): sequence ``i`` sees its first ``ctx[i]`` key slots, never the rest of its last block or
    the pad block past it."""
    s = ctx.shape[0]
    hidden = torch.arange(num_keys, device=ctx.device) >= ctx.view(s, 1, 1, 1)
    return torch.zeros(hidden.shape, dtype=dtype, device=ctx.device).masked_fill_(hidden, float("-inf"))


def kv_views(gathered: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V, each [S, kv_heads, c_max, D], of ``S`` sequences' blocks copied out of one layer's
    interleaved pool: ``gathered`` is [S * width, block_size, 2, kv_heads, D], which is
    [S, c_max, 2, kv_heads, D] in memory.  SDPA wants heads before positions, so it gets that
    memory with the axes swapped (one ``as_strided`` each, V starting ``kv_heads * D`` elements
    in: views, no copy)."""
    heads, dim = gathered.shape[3], gathered.shape[4]
    c_max = gathered.shape[0] * gathered.shape[1] // s
    size, stride = (s, heads, c_max, dim), (c_max * 2 * heads * dim, dim, 2 * heads * dim, 1)
    return gathered.as_strided(size, stride), gathered.as_strided(size, stride, heads * dim)


def rope_tables(model) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each [max_position + 1, head_dim] in the model's dtype: row ``p`` holds
    position ``p``'s angles (sin with rotate-half's sign folded in); the extra last row is
    (1, 0), what a V head gets, so that one fused op can rope q, k and v alike.  Built once and
    kept per model (``model_state.py``): a step then looks its rows up (one op each) instead of computing them
    (about 20 ops).  Computed by ``model.rotary`` itself, so the same angles."""
    state = prepared(model)
    if state.rope_tables is None:
        s = model.shape
        cos, sin = model.rotary(torch.arange(s.max_position, device=model.device))  # [P, 1, D]
        half = s.head_dim // 2
        sign = torch.cat([-sin.new_ones(half), sin.new_ones(half)])
        state.rope_tables = (torch.cat([cos[:, 0], cos.new_ones(1, s.head_dim)]),
                              torch.cat([sin[:, 0] * sign, sin.new_zeros(1, s.head_dim)]))
        state.rope_heads_v = torch.arange(s.num_heads + 2 * s.num_kv_heads, device=model.device) >= \
            s.num_heads + s.num_kv_heads
    return state.rope_tables


def build_plan(model, positions: torch.Tensor, slots: torch.Tensor, prefills: list[tuple],
               decodes: list[tuple], block_size: int, pad_block: int, paged: bool = False,
               causal_kernel: bool = False, extra_groups: tuple[Group, ...] = (), triton: bool = False) -> FusedPlan:
    """``prefills``: ``(start_row, num_new, context_len, block_table)`` per prefilling sequence;
    ``decodes``: ``(row, context_len, block_table)`` per decoding one (rows after the prefills);
    ``extra_groups``: groups planned by the caller (``cuda_graphs.py``'s static decode group).
    ``paged``: all decodes form one ``"paged"`` group for the C++ kernel (it pads nothing, so
    there is nothing to gain from splitting them by length).  ``causal_kernel`` (with ``paged``):
    all fresh prefills form one ``"causal"`` group for the prefill kernel, faster than SDPA one
    sequence at a time.  It reduces in another order than SDPA, so its prefills are no longer
    transformers' bits, though within the decode tolerance (2e-4 of the largest logit).  ``score``, whose
    logits are the ones compared with transformers', leaves it off and stays bit for bit.  ``triton``: hits
    and decodes in one group for the Triton kernel (``paged_triton.py``).  A step of prefix hits without a fresh
    prefill runs :func:`in_place_plan` instead (the tiled kernel reading the pool in place, which
    beats gather + SDPA on hits of a few dozen new tokens: docs/BENCHMARKS.md, "CPU kernels")."""
    s, device, dtype = model.shape, model.device, model.dtype
    # Only a fresh prefill is held to transformers' exact rounding (its logits, and ``score``'s, match
    # bit for bit); prefix-hit prefills and decodes reduce in another order anyway (2e-4).
    exact = any(p[1] == p[2] for p in prefills)
    # minikv's RoPE op rotates q and k in place in one pass, bit for bit ATen's ops (pointwise.cpp)
    rope_kernel = paged and dtype in (torch.float32, torch.bfloat16)
    causal_kernel = causal_kernel and rope_kernel  # the same library, the same dtypes
    kw = dict(block_size=block_size, pad_block=pad_block, rep=s.num_heads // s.num_kv_heads,
              dtype=dtype, device=device)
    if exact or rope_kernel:  # computed as transformers computes them: [T, 1, D], broadcast over heads
        cos, sin = model.rotary(positions)
        half = s.head_dim // 2
        sin = sin * torch.cat([-sin.new_ones(half), sin.new_ones(half)])  # rotate-half's sign, folded in
    else:  # looked up over q, k *and* v heads (v: cos 1, sin 0), so one fused op ropes them all
        cos_table, sin_table = rope_tables(model)
        rows = torch.where(prepared(model).rope_heads_v, s.max_position, positions.view(-1, 1))  # [T, heads]
        cos, sin = cos_table[rows], sin_table[rows]
    groups = []
    if triton and (hits := [p for p in prefills if p[1] < p[2]] + [(d[0], 1, d[1], d[2]) for d in decodes]):
        groups.append(_triton_group(hits, pad_block, device))
        prefills, decodes = [p for p in prefills if p[1] == p[2]], []
    for kind in ("fresh", "cached"):
        mine = [p for p in prefills if (p[1] == p[2]) == (kind == "fresh")]
        if not mine:
            continue
        news = [p[1] for p in mine]
        padded_ok = (kind == "cached" and len(mine) * max(news) <= MAX_PAD_FACTOR * sum(news)) or \
            (kind == "fresh" and causal_kernel)  # the kernel: one call, nothing padded
        chunks = [mine] if padded_ok else [[p] for p in mine]  # fresh on SDPA: one per sequence
        for c in chunks:
            groups.append(_group("causal" if kind == "fresh" and causal_kernel else kind,
                                 [p[0] for p in c], [p[1] for p in c], [p[2] for p in c], [p[3] for p in c], **kw))
    for c in ([decodes] if paged and decodes else _split_decodes(decodes, block_size)):
        groups.append(_group("paged" if paged else "decode", [d[0] for d in c], [1] * len(c), [d[1] for d in c], [d[2] for d in c], **kw))
    plan = FusedPlan(slots, cos, sin, groups + list(extra_groups), exact=exact, kernels=paged, rope_kernel=rope_kernel)
    _bind(plan, model, block_size)
    return plan


def reads_in_place(model, paged: bool, prefills: list[tuple]) -> bool:
    """Whether a step runs the ``"in_place"`` plan (:func:`in_place_plan`): the kernels, a dtype they
    take, prefix hits, and no fresh prefill (a fresh one keeps transformers' op order)."""
    return paged and model.dtype in (torch.float32, torch.bfloat16) and bool(prefills) and \
        all(p[1] < p[2] for p in prefills)


def in_place_lists(prefills: list[tuple], decodes: list[tuple], pad_block: int) -> list[list[int]]:
    """The host lists of an ``"in_place"`` group, to be sent with the step's other metadata in one
    copy (``to_device_split``): every block table padded to the longest with ``pad_block``, flat,
    and (first row, new tokens, context length) of every sequence, flat; hits first, then decodes
    as one new token each."""
    seqs = [(p[0], p[1], p[2], p[3]) for p in prefills] + [(d[0], 1, d[1], d[2]) for d in decodes]
    width = max(len(q[3]) for q in seqs)
    return [[b for q in seqs for b in q[3] + [pad_block] * (width - len(q[3]))],
            [v for q in seqs for v in q[:3]]]


def in_place_plan(model, positions, slots, table, seqs) -> FusedPlan:
    """The plan of a step with prefix hits and no fresh prefill, on the kernels (``table`` and
    ``seqs``: :func:`in_place_lists` on the device, flat): every sequence in one ``"in_place"`` group
    for the paged prefill kernel, which reads the pool in place, so nothing is gathered, padded or
    masked.  RoPE's tables are looked up by the kernel at each row's position
    (:func:`rope_tables`), and one output buffer serves every layer.  Per layer that leaves nine
    ops: two norms, four matmuls, SwiGLU, ``rope_store_`` and the attention
    (``attention_fused.fused_forward``); per step, the buffer and the logits' few."""
    cos_table, sin_table = rope_tables(model)
    s = model.shape
    group = Group("in_place", slice(0, 0), slice(0, 0), None, 0, table, ctx=seqs)
    out = torch.empty(positions.shape[0], s.num_heads * s.head_dim, dtype=model.dtype, device=model.device)
    return FusedPlan(slots, cos_table, sin_table, [group], exact=False, kernels=True, rope_kernel=True,
                     in_place=True, out=out, positions=positions)


def _bind(plan: FusedPlan, model, block_size: int) -> None:
    """Allocate the step's buffers and make their views (module docstring)."""
    s = model.shape
    if not (plan.exact or plan.rope_kernel):
        plan.qkv = plan.cos.new_empty(plan.cos.shape)
        plan.q, plan.kv = plan.qkv.split([s.num_heads, 2 * s.num_kv_heads], dim=1)
    for g in plan.groups:
        if g.kind in ("decode", "cached"):
            g.gathered = torch.empty(g.table.shape[0], block_size, 2, s.num_kv_heads, s.head_dim,
                                     dtype=model.dtype, device=model.device)
            g.k, g.v = kv_views(g.gathered, g.mask.shape[0])
        if g.kind == "decode" and plan.q is not None:
            g.q = plan.q[g.rows].view(-1, s.num_kv_heads, s.num_heads // s.num_kv_heads, s.head_dim)


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
