"""Attention over the KV pool by gathering: each sequence's blocks copied out, then masked SDPA.

One engine step runs a *flat* batch: the new tokens of every scheduled sequence, concatenated
(no padding).  Linear layers see that flat batch at once; attention is the only place where
sequences must stay apart, and it happens in two shapes:

* **prefill** (a sequence brings several new tokens): causal attention of those tokens over
  the sequence's whole context, cached prefix included;
* **decode** (one new token per sequence): all decoding sequences at once, each attending to
  its own blocks, gathered from the pool through a padded block-table tensor.

Production engines fuse the gather into the attention kernel (vLLM's PagedAttention,
FlashInfer) and read K/V where they lie; here the gather is explicit -- a copy, hence the name
:func:`gather_attention` -- so the reader can see each slot being read.  (``minikv.backends``
has kernels that read in place.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from .kv_pool import KVPool


def context_mask(context_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, 1, 1, max_len] boolean mask of the slots each decoding query may attend to.

    The gathered blocks are whole blocks: slots past a sequence's length hold whatever the block
    held before (a previous request's K/V, if nobody scrubbed).  Forgetting this mask is one of
    the stale-block bugs of lesson 05.
    """
    pos = torch.arange(max_len, device=context_lens.device)
    return (pos[None, :] < context_lens[:, None])[:, None, None, :]


@dataclass
class PrefillItem:
    start: int  # offset of this sequence's new tokens in the flat batch
    num_new: int  # new tokens this step
    context_len: int  # cached + new tokens
    block_table: torch.Tensor  # [num_blocks] physical ids (long)


@dataclass
class AttentionMetadata:
    """Everything attention needs to know about the flat batch, built once per step."""

    slots: torch.Tensor  # [T] flat slot index of each new token
    prefills: list[PrefillItem]
    decode_start: int  # decode tokens occupy flat rows [decode_start, T)
    decode_block_tables: torch.Tensor | None  # [B, max_blocks], padded with block 0
    decode_context_lens: torch.Tensor | None  # [B]
    # which gathered slots decode may attend to, and who sees the gather: test-only seams
    # (``LLMEngine.set_decode_mask`` / ``set_kv_read_observer``, see ``seams.py``)
    decode_mask: Callable[[torch.Tensor, int], torch.Tensor] = context_mask
    on_decode_read: Callable | None = None


def causal_mask(num_new: int, context_len: int, device) -> torch.Tensor:
    """[num_new, context_len] mask: new token j (absolute position context_len - num_new + j)
    sees every earlier position and itself."""
    q_pos = torch.arange(context_len - num_new, context_len, device=device)
    return torch.arange(context_len, device=device)[None, :] <= q_pos[:, None]


def gather_attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    pool: KVPool, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, q_heads, D]; k, v: [T, kv_heads, D] for the new tokens.  Returns [T, q_heads, D].
    Writes the new K/V into the pool, then gathers every context block it reads into a copy."""
    pool.write(layer, meta.slots, k, v)
    out = torch.empty_like(q)
    for p in meta.prefills:
        qs = q[p.start:p.start + p.num_new].transpose(0, 1)[None]  # [1, H, n, D]
        if p.context_len == p.num_new:  # nothing cached: use the fresh K/V directly
            ks, vs = (x[p.start:p.start + p.num_new] for x in (k, v))
            mask, causal = None, True
        else:  # a prefix hit: read the cached part back from the pool
            ks, vs = pool.gather(layer, p.block_table[None])
            ks, vs = ks[0, :p.context_len], vs[0, :p.context_len]
            mask, causal = causal_mask(p.num_new, p.context_len, q.device), False
        o = F.scaled_dot_product_attention(qs, ks.transpose(0, 1)[None].to(q.dtype),
                                           vs.transpose(0, 1)[None].to(q.dtype), attn_mask=mask,
                                           is_causal=causal, scale=scale, enable_gqa=True)
        out[p.start:p.start + p.num_new] = o[0].transpose(0, 1)
    if meta.decode_block_tables is not None:
        kd, vd = pool.gather(layer, meta.decode_block_tables)  # [B, S, kv_heads, D]
        if meta.on_decode_read is not None:
            meta.on_decode_read(layer, meta.decode_block_tables, meta.decode_context_lens, kd, vd)
        qd = q[meta.decode_start:].unsqueeze(2)  # [B, H, 1, D]
        mask = meta.decode_mask(meta.decode_context_lens, kd.shape[1])
        o = F.scaled_dot_product_attention(qd, kd.transpose(1, 2).to(q.dtype), vd.transpose(1, 2).to(q.dtype),
                                           attn_mask=mask, scale=scale, enable_gqa=True)
        out[meta.decode_start:] = o.squeeze(2)
    return out
