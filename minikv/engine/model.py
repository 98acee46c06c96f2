"""The Llama forward pass, written out in minikv.

The weights come from a transformers checkpoint (see ``loader.py``) but none of transformers'
``forward`` code runs: every step below is here to read.  A Llama decoder layer is

    h = x + Attention(RMSNorm(x))          # with rotary position embeddings on q and k
    y = h + MLP(RMSNorm(h))                 # MLP(x) = down(silu(gate(x)) * up(x))

Like vLLM, q/k/v projections are fused into one matrix (and gate/up into another), so each
layer does two big matmuls instead of five smaller ones.  Inputs are a *flat* batch of tokens
(no padding); ``positions`` tells rotary embeddings where each token sits in its sequence, and
``AttentionMetadata`` tells attention which tokens belong together.
"""
from __future__ import annotations

import hashlib
from dataclasses import astuple, dataclass

import torch
import torch.nn.functional as F

from .attention import AttentionMetadata, gather_attention
from .kv_pool import KVPool


@dataclass
class ModelShape:
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_eps: float
    max_position: int


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 even for bf16 weights, as the reference implementation does.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) by a position-dependent angle ("rotate half" layout)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Layer:
    """Weights of one decoder layer (plain tensors; no nn.Module machinery needed)."""

    #: The weights ``loader.from_hf`` gives every layer (a bias may be None), in a fixed order.
    WEIGHTS = ("input_norm", "post_norm", "qkv", "qkv_bias", "o_proj", "o_bias",
               "gate_up", "gate_up_bias", "down", "down_bias")

    def __init__(self, w: dict[str, torch.Tensor]):
        self.__dict__.update(w)


class LlamaModel:
    def __init__(self, shape: ModelShape, embed: torch.Tensor, layers: list[Layer], norm: torch.Tensor,
                 lm_head: torch.Tensor, inv_freq: torch.Tensor, rope_scale: float = 1.0):
        self.shape, self.embed, self.layers, self.norm, self.lm_head = shape, embed, layers, norm, lm_head
        self.inv_freq, self.rope_scale = inv_freq.float(), rope_scale
        self.scale = shape.head_dim ** -0.5

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def fingerprint(self) -> str:
        """A digest of exactly these weights (SHA-256 over the shape and every tensor's bytes).

        It names *which model* wrote a K/V block that leaves the process (a KV tier): two engines
        agree on it only if their K/V would agree.  A model's path or name would not do: the same
        checkpoint under two paths would never share, and two fine-tunes of one base (often with
        the base's embeddings, frozen) under one name would share K/V that differ.  Hashing every
        weight is the only cheap test that cannot be fooled by a copy: SmolLM2-135M in fp32 is
        540 MB, hashed once per model object (engines that share weights share the result).
        """
        if getattr(self, "_fingerprint", None) is None:
            h = hashlib.sha256(repr(("minikv/model-fingerprint/v1", astuple(self.shape), self.rope_scale)).encode())
            tensors = [self.embed, self.norm, self.lm_head, self.inv_freq]
            tensors += [getattr(L, n, None) for L in self.layers for n in Layer.WEIGHTS]
            for t in tensors:  # None (no bias) is hashed as a marker, so a missing bias is not a shift
                h.update(b"-" if t is None else repr((t.dtype, tuple(t.shape))).encode())
                if t is not None:
                    h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.rope_scale, emb.sin() * self.rope_scale
        return cos[:, None, :].to(self.dtype), sin[:, None, :].to(self.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, pool: KVPool,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] of the flat batch, writing each layer's new K/V to ``pool``."""
        s = self.shape
        cos, sin = self.rotary(positions)
        x = F.embedding(input_ids, self.embed)
        q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        for i, L in enumerate(self.layers):
            h = rms_norm(x, L.input_norm, s.rms_eps)
            qkv = F.linear(h, L.qkv, L.qkv_bias)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = apply_rotary(q.view(-1, s.num_heads, s.head_dim), cos, sin)
            k = apply_rotary(k.view(-1, s.num_kv_heads, s.head_dim), cos, sin)
            attn = gather_attention(i, q, k, v.view(-1, s.num_kv_heads, s.head_dim), pool, meta, self.scale)
            x = x + F.linear(attn.reshape(-1, q_size), L.o_proj, L.o_bias)
            h = rms_norm(x, L.post_norm, s.rms_eps)
            gate, up = F.linear(h, L.gate_up, L.gate_up_bias).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, L.down, L.down_bias)
        return rms_norm(x, self.norm, s.rms_eps)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Project hidden states to vocabulary logits (only for rows we sample from: the
        49,152-wide projection is the most expensive matmul for a small model)."""
        return F.linear(hidden, self.lm_head).float()
