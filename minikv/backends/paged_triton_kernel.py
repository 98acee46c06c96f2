"""Paged attention in Triton: new tokens attend to K/V *where it lies in the pool*.

This file is the kernel and nothing else; it imports Triton at the top, so only
``paged_triton.py`` imports it, lazily, on a machine that has Triton (torch's CUDA builds ship
it; ``make triton`` installs it beside minikv for the interpreter, ``TRITON_INTERPRET=1``).

What one launch computes
------------------------
A step's flat batch holds the new tokens of several sequences, one after another.  Sequence
``s`` has ``n`` new tokens at flat rows ``start ... start + n - 1`` and ``ctx`` tokens in all
(cached + new).  Its K/V -- the cached prefix *and* the new tokens' own, written into the pool
before attention runs -- sits in the pool blocks its block table names, ``block_size`` tokens
per block.  New token ``i`` sits at position ``ctx - n + i`` and sees every position up to its
own (causal).  One formula covers every kind of sequence a step holds:

* a decode is ``n = 1``: one query over its whole context;
* a prefix hit is a few new tokens over a long cached prefix;
* a fresh prefill is ``n = ctx``: plain causal self-attention.

How it reads the pool
---------------------
The pool of one layer is ``[blocks, block_size, 2, kv_heads, head_dim]`` (K and V of a slot side
by side, ``kv_pool.py``).  The reference path copies a sequence's blocks out into one contiguous
tensor and hands that to SDPA: per layer, a copy of the whole context.  Here the loop over keys
walks the block table instead: key tile ``j`` *is* pool block ``table[s, j]``, loaded straight
from the pool by address.  Nothing is gathered, nothing padded to the longest sequence, and no
mask tensor exists: the causal limit is a comparison of positions inside the kernel.  That is
the idea of vLLM's PagedAttention, written here from the formula up.

How the work is split
---------------------
One program per (sequence, KV head, tile of query rows).  Grouped-query attention (GQA) is
folded into the rows: the ``rep`` query heads that share one KV head become ``rep`` rows of the
tile (row ``r`` is new token ``r // rep``, query head ``kv_head * rep + r % rep``), so one K/V
tile loaded from the pool serves all of them, and a decode (one token, ``rep`` heads) still
fills a tile worth a matrix multiply.

Softmax is computed online (flash attention): the scores of one key tile at a time, a running
maximum ``m`` and sum ``l`` per row, the accumulator rescaled whenever the maximum grows.  All of
that is fp32 whatever the pool's dtype; the two matrix multiplies take the pool's dtype (bf16 or
fp16 on tensor cores, fp32 exactly: ``PRECISION = "ieee"``, never TF32's 10-bit mantissa).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr, kv_ptr, table_ptr, seqs_ptr, out_ptr, scale_log2,
    q_row_stride, q_head_stride,  # q: [rows, q_heads, HEAD_DIM], last axis contiguous
    kv_block_stride, kv_slot_stride, kv_v_offset, kv_head_stride,  # one layer's pool, in elements
    table_stride, out_row_stride,  # table: [S, width] block ids; out: [rows, q_heads * HEAD_DIM]
    REP: tl.constexpr,  # query heads per KV head
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,  # the pool's block is the key tile
    BLOCK_M: tl.constexpr,  # query rows (token, head pairs) per program
    PRECISION: tl.constexpr,
):
    seq, kv_head, tile = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(seqs_ptr + seq * 3)  # (first flat row, new tokens, context length)
    n = tl.load(seqs_ptr + seq * 3 + 1)
    ctx = tl.load(seqs_ptr + seq * 3 + 2)

    # This tile's query rows.  Rows past the sequence's n * REP (the grid is sized for the
    # longest sequence) are computed as copies of its last token, so that every row has finite
    # numbers, and never stored.
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    real = rows < n * REP
    token = tl.minimum(rows // REP, n - 1)
    head = kv_head * REP + rows % REP
    q_pos = ctx - n + token  # absolute position of each row's token: it sees keys 0 ... q_pos
    dims = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + (start + token)[:, None] * q_row_stride + head[:, None] * q_head_stride + dims[None, :])

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of each row's scores (log2 units)
    l = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)  # running sum of exp2(score - m) * V

    # Keys past the tile's last query are hidden from every row of it: stop there.  The first
    # key tile always holds position 0, which every row sees, so ``m`` is finite after it and
    # a later tile that a row sees nothing of adds exactly zero (exp2(-inf - m) = 0).
    last_pos = ctx - n + tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // REP, n - 1)
    slots = tl.arange(0, BLOCK_SIZE)
    for j in range(0, tl.cdiv(last_pos + 1, BLOCK_SIZE)):
        # The block table turns key tile j into a pool block: the only indirection paging needs.
        block = tl.load(table_ptr + seq * table_stride + j).to(tl.int64)
        kv = kv_ptr + block * kv_block_stride + slots[:, None] * kv_slot_stride \
            + kv_head * kv_head_stride + dims[None, :]
        k = tl.load(kv)  # [BLOCK_SIZE, HEAD_DIM], read in place
        v = tl.load(kv + kv_v_offset)

        # Scores in log2 units (scale * log2(e) folded in), so that exp2 is the exponential.
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        key_pos = j * BLOCK_SIZE + slots
        # Causal: a row sees keys at or before its position.  That also hides the slots past ctx
        # in the last block (q_pos < ctx), whatever stale K/V they hold (lesson 05).
        s = tl.where(key_pos[None, :] <= q_pos[:, None], s, float("-inf"))

        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)  # rescales what was summed under the old maximum
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    o = acc / l[:, None]
    out = out_ptr + (start + token)[:, None] * out_row_stride + head[:, None] * HEAD_DIM + dims[None, :]
    tl.store(out, o.to(out_ptr.dtype.element_ty), mask=real[:, None])
