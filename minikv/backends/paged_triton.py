"""The ``triton`` backend's attention call: launch the Triton paged-attention kernel.

The kernel itself (``paged_triton_kernel.py``) is the textbook part; this module is the
plumbing around it: how one call of :func:`paged_attention` becomes a launch grid.  Whether
Triton is here at all is ``attention_backends.resolve_backend``'s question, asked before an
engine is built.

Triton is imported lazily, on the first launch, never when minikv is imported: the CPU builds
of torch do not ship it, and minikv's own environment never installs it (a second copy beside
torch's could change what ``torch.compile`` does).  On a CUDA machine torch brings it; on a
CPU, ``make triton`` installs it into ``.triton-site`` for the tests, which run the kernel in
Triton's interpreter (``TRITON_INTERPRET=1``, in a subprocess) to check it equals the reference.

The metadata is what the fused plan already sends for an ``"in_place"`` group
(``fused_plan.in_place_lists``): per sequence ``(first flat row, new tokens, context length)``
and its block table, padded to the longest with the pool's pad block (never read: the kernel
stops at each sequence's context).
"""
from __future__ import annotations

import math

import torch

# Query rows (token, head pairs) per program.  16 is the smallest tile ``tl.dot`` takes on a
# GPU; a decode of SmolLM2 (3 query heads per KV head) uses 3 of them, a 20-token hit 60 of 64.
BLOCK_M = 16


def paged_attention(q: torch.Tensor, kv_blocks: torch.Tensor, table: torch.Tensor, seqs: torch.Tensor,
                    scale: float, out: torch.Tensor | None = None, n_max: int | None = None) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its K/V in the pool.

    ``q``: [T, q_heads, D] (a view is fine if its last axis is contiguous); ``kv_blocks``: one
    layer's pool, [blocks, block_size, 2, kv_heads, D], the new tokens' K/V already written;
    ``table``: [S, width] block ids; ``seqs``: [S, 3] (or flat [3 * S]) long, each sequence's
    (first row of q, new tokens, context length).  Returns ``out``, [T, q_heads * D]: the rows of
    the sequences named are written, other rows are left alone.  ``n_max``: the most new tokens
    of any one sequence, if the caller knows it (the plan does, on the host)."""
    from .paged_triton_kernel import paged_attention_kernel  # imports triton: on first use only

    t, heads, dim = q.shape
    block_size, kv_heads = kv_blocks.shape[1], kv_blocks.shape[3]
    if q.stride(2) != 1 or not kv_blocks.is_contiguous():
        raise ValueError("paged_attention needs q's last axis and the pool contiguous")
    if dim & (dim - 1) or block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"paged_attention needs a power-of-two head_dim and block_size >= 16, "
                         f"got {dim} and {block_size}")
    seqs = seqs.view(-1, 3)
    if out is None:
        out = q.new_empty(t, heads * dim)
    rep = heads // kv_heads
    # The longest sequence's new tokens decide the grid's third axis: a tile of another
    # sequence past its own rows finds nothing real and stores nothing.  Reading that length
    # back from a device tensor would stall the GPU, so the caller says it when it can.
    n_max = n_max if n_max is not None else max_new_tokens(seqs, t)
    tiles = -(-n_max * rep // BLOCK_M)
    grid = (seqs.shape[0], kv_heads, tiles)
    paged_attention_kernel[grid](
        q, kv_blocks, table, seqs, out, scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        kv_blocks.stride(0), kv_blocks.stride(1), kv_blocks.stride(2), kv_blocks.stride(3),
        table.stride(0), out.stride(0),
        REP=rep, HEAD_DIM=dim, BLOCK_SIZE=block_size, BLOCK_M=BLOCK_M,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # tf32: Triton's default; fp32 only
    )
    return out


def max_new_tokens(seqs: torch.Tensor, rows: int) -> int:
    """An upper bound of the new tokens of any one sequence, without a device-to-host read: on
    the CPU the exact maximum, on a GPU the step's row count minus one row per other sequence."""
    if seqs.device.type == "cpu":
        return int(seqs[:, 1].max())
    return rows - seqs.shape[0] + 1

