"""Turning layer-0 K/V bytes back into text: the attacker's half of lesson 05.

The inversion needs only the model weights, which are public.  At layer 0 nothing has mixed
tokens yet, so a slot's K/V is a function of *one* token (and, for K, its position)::

    V0(t)    = W_v . RMSNorm(embed[t])                 (the same vector at every position)
    K0(t, p) = RoPE_p( W_k . RMSNorm(embed[t]) )       (a rotation of a fixed vector)

:func:`layer0_kv_table` tabulates both for the whole vocabulary; :func:`invert_layer0` matches
observed slots against the table: nearest neighbour for V, and for K a rotation-invariant
signature (RoPE rotates pairs of coordinates, so each pair's length is position-free) followed
by an exhaustive position search done as one matrix product.  Input: K or V bytes only --
no token ids, no positions, no block metadata.  Output: token ids (``-1`` for a slot that
matches no token: zeros, never-written memory) and, for K, the position each token had.
This is the simplest case of the reconstruction attacks of "Shadow in the Cache" (Luo et al.,
NDSS 2026): at layer 0 a single lookup over the vocabulary suffices.

:func:`read_slots` is the attacker's input: the raw bytes a memory dump (or a bug that hands
slots to the wrong reader) exposes; :func:`render_tokens` turns recovered ids back into text.
How such bytes reach an attacker in the first place is :mod:`minikv.attacks.engine_bugs`'s
subject (lesson 05 uses both modules).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..engine.model import apply_rotary, rms_norm

__all__ = ["NO_TOKEN", "Layer0Table", "layer0_kv_table", "invert_layer0", "render_tokens", "read_slots"]

NO_TOKEN = -1



@dataclass
class Layer0Table:
    """Layer-0 K (before RoPE) and V of every vocabulary token, plus what RoPE needs.

    ``v``: [vocab, kv_heads * head_dim]; ``k``: [vocab, kv_heads, head_dim] (un-rotated);
    ``k_sig``: [vocab, kv_heads * head_dim / 2], the length of every rotated pair of ``k``;
    ``inv_freq``: [head_dim / 2] RoPE frequencies; ``rope_scale``: RoPE's cos/sin scale.
    """

    v: torch.Tensor
    k: torch.Tensor
    k_sig: torch.Tensor
    inv_freq: torch.Tensor
    rope_scale: float
    max_position: int
    kv_heads: int
    head_dim: int

    @property
    def vocab_size(self) -> int:
        return self.v.shape[0]


def _pair_lengths(k: torch.Tensor) -> torch.Tensor:
    """[N, H, D] -> [N, H * D/2]: lengths of the pairs (x[i], x[i + D/2]) RoPE rotates."""
    a, b = k.chunk(2, dim=-1)
    return torch.sqrt(a * a + b * b).flatten(1)


@torch.inference_mode()
def layer0_kv_table(model, chunk: int = 8192) -> Layer0Table:
    """Tabulate layer-0 K (un-rotated) and V for every token of ``model``'s vocabulary.

    Uses the model's own ``rms_norm`` and fused ``qkv`` weights, in fp32, chunked so the
    49,152-token table of SmolLM2 never needs more than a few MB of scratch.
    """
    s, layer = model.shape, model.layers[0]
    q_size, kv_size = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    w = layer.qkv[q_size:].float()  # only the K and V rows of the fused matrix
    bias = layer.qkv_bias[q_size:].float() if layer.qkv_bias is not None else None
    norm = layer.input_norm.float()
    ks, vs = [], []
    for start in range(0, s.vocab_size, chunk):
        x = model.embed[start:start + chunk].float()
        kv = F.linear(rms_norm(x, norm, s.rms_eps), w, bias)
        k, v = kv.split([kv_size, kv_size], dim=-1)
        ks.append(k.reshape(-1, s.num_kv_heads, s.head_dim))
        vs.append(v)
    k = torch.cat(ks)
    return Layer0Table(v=torch.cat(vs), k=k, k_sig=_pair_lengths(k), inv_freq=model.inv_freq.float().cpu(),
                       rope_scale=float(model.rope_scale), max_position=int(s.max_position),
                       kv_heads=s.num_kv_heads, head_dim=s.head_dim)


def _as_slots(x: torch.Tensor, table: Layer0Table) -> torch.Tensor:
    """Accept [N, kv_heads, head_dim] or [N, kv_heads * head_dim]; return fp32 [N, H, D]."""
    x = torch.as_tensor(x).detach().float().cpu()
    if x.dim() == 2 and x.shape[1] == table.kv_heads * table.head_dim:
        x = x.view(-1, table.kv_heads, table.head_dim)
    if x.dim() != 3 or tuple(x.shape[1:]) != (table.kv_heads, table.head_dim):
        raise ValueError(f"expected slots of shape [N, {table.kv_heads}, {table.head_dim}] "
                         f"(or [N, {table.kv_heads * table.head_dim}]), got {tuple(x.shape)}")
    return x


_NEAREST_CHUNK = 256  # rows of x per distance matrix: 256 x 49,152 fp32 is 50 MB


def _nearest(x: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` nearest table rows (squared L2) for each row of ``x``, non-finite rows -> inf.

    Chunked over ``x``: the distance matrix is [len(x), vocabulary], and a whole pool's slots
    against SmolLM2's 49,152 rows would need gigabytes (a lesson 05 kernel peaked at 6.7 GB)."""
    row_sq = (rows * rows).sum(1)[None]
    dists, idxs = [], []
    for start in range(0, x.shape[0], _NEAREST_CHUNK):
        xc = x[start:start + _NEAREST_CHUNK]
        d = (xc * xc).sum(1, keepdim=True) - 2 * xc @ rows.T + row_sq
        d = torch.nan_to_num_(d, nan=float("inf"), posinf=float("inf"), neginf=float("inf"))
        d[~torch.isfinite(xc).all(1)] = float("inf")
        dist, idx = torch.topk(d, k, dim=1, largest=False)
        dists.append(dist.clamp_min(0))
        idxs.append(idx)
    if not dists:
        return x.new_zeros((0, k)), torch.zeros((0, k), dtype=torch.long, device=x.device)
    return torch.cat(dists), torch.cat(idxs)


def _rotation_scores(obs: torch.Tensor, raw: torch.Tensor, table: Layer0Table,
                     positions: torch.Tensor) -> torch.Tensor:
    """<RoPE_p(raw_n), obs_n> for every row n and every position p, as one matmul.

    For a pair (a1, a2) rotated by angle w and an observed pair (b1, b2):
    <R(w) a, b> = cos(w) (a1 b1 + a2 b2) + sin(w) (a1 b2 - a2 b1).
    Summing over heads and pairs gives [N, 2 * D/2] coefficients against [2 * D/2, P] cos/sin.
    """
    a1, a2 = raw.chunk(2, dim=-1)
    b1, b2 = obs.chunk(2, dim=-1)
    c = (a1 * b1 + a2 * b2).sum(1)  # [N, D/2] (summed over kv heads)
    s = (a1 * b2 - a2 * b1).sum(1)
    ang = positions.float()[:, None] * table.inv_freq[None, :]  # [P, D/2], like model.rotary
    return table.rope_scale * (c @ ang.cos().T + s @ ang.sin().T)  # [N, P]


_K_CHUNK = 512


def _rotate(raw: torch.Tensor, positions: torch.Tensor, table: Layer0Table) -> torch.Tensor:
    """RoPE of un-rotated keys ``raw`` [N, H, D] at ``positions`` [N], exactly as the model does."""
    freqs = positions.float()[:, None] * table.inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = (emb.cos() * table.rope_scale)[:, None, :], (emb.sin() * table.rope_scale)[:, None, :]
    return apply_rotary(raw, cos, sin)


def _invert_k(x: torch.Tensor, table: Layer0Table, tol: float, p_max: int,
              candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[0]
    # 1. RoPE only rotates pairs: their lengths identify the token whatever the position.
    _, cand = _nearest(_pair_lengths(x), table.k_sig, min(candidates, table.vocab_size))
    positions = torch.arange(p_max)
    best = torch.full((n,), float("-inf"))
    ids = torch.full((n,), NO_TOKEN, dtype=torch.long)
    pos = torch.full((n,), NO_TOKEN, dtype=torch.long)
    for j in range(cand.shape[1]):
        raw = table.k[cand[:, j]]  # [N, H, D]
        # 2. Exhaustive position search, as one matmul: |R_p a - b|^2 = |a'|^2 + |b|^2 - 2 <R_p a, b>,
        # so the best position maximises <R_p a, b> minus the (position-free) |a'|^2 / 2.
        score, p = _rotation_scores(x, raw, table, positions).max(dim=1)
        score = score - 0.5 * table.rope_scale ** 2 * (raw * raw).flatten(1).sum(1)
        better = score > best
        best[better], ids[better], pos[better] = score[better], cand[better, j], p[better]
    # 3. Verify each answer directly (no cancellation-prone expansion): rotate and compare.
    found = ids >= 0
    match = _rotate(table.k[ids.clamp_min(0)], pos.clamp_min(0), table)
    ok = found & ((x - match).flatten(1).norm(dim=1) <= tol * match.flatten(1).norm(dim=1).clamp_min(1e-12))
    ids[~ok], pos[~ok] = NO_TOKEN, NO_TOKEN
    return ids, pos


@torch.inference_mode()
def invert_layer0(slots: torch.Tensor, table: Layer0Table, kind: str = "v", *, tol: float | None = None,
                  max_position: int | None = None, candidates: int = 4,
                  return_positions: bool = False):
    """Recover the token in each layer-0 K or V slot.  Returns a LongTensor of token ids.

    Args:
        slots: raw layer-0 K or V bytes, ``[N, kv_heads, head_dim]`` (or flattened heads).
        table: :func:`layer0_kv_table` of the model that wrote them.
        kind: ``"v"`` (position-free nearest neighbour) or ``"k"`` (signature + position search).
        tol: a slot is recognised when ``|slot - match| <= tol * |match|``; anything else
            (zeros, never-written memory, another model's K/V) gives ``-1``.  Default: 1e-3
            for fp32 slots, 3e-2 for bf16/fp16 ones (their rounding error is larger).
        max_position: highest position searched for K (default: the model's context length).
        candidates: tokens tried per K slot (by rotation-invariant signature) before the
            position search.
        return_positions: also return the recovered positions (``-1`` where unknown; always
            ``-1`` for V, which carries no position).

    Returns:
        ``ids`` or ``(ids, positions)``, each a LongTensor of shape ``[N]``.
    """
    if tol is None:
        tol = 3e-2 if torch.as_tensor(slots).dtype in (torch.bfloat16, torch.float16) else 1e-3
    x = _as_slots(slots, table)
    n = x.shape[0]
    ids = torch.full((n,), NO_TOKEN, dtype=torch.long)
    pos = torch.full((n,), NO_TOKEN, dtype=torch.long)
    if n == 0:
        return (ids, pos) if return_positions else ids
    if kind == "v":
        _, idx = _nearest(x.flatten(1), table.v, 1)
        match = table.v[idx[:, 0]]
        ok = (x.flatten(1) - match).norm(dim=1) <= tol * match.norm(dim=1).clamp_min(1e-12)
        ids[ok] = idx[ok, 0]
    elif kind == "k":
        p_max = int(max_position or table.max_position)
        for start in range(0, n, _K_CHUNK):  # bounds the [slots, positions] score matrix
            sl = slice(start, start + _K_CHUNK)
            ids[sl], pos[sl] = _invert_k(x[sl], table, tol, p_max, candidates)
    else:
        raise ValueError(f"kind must be 'k' or 'v', got {kind!r}")
    return (ids, pos) if return_positions else ids


def render_tokens(tokenizer, ids, positions=None, gap: str = "\u2591") -> str:
    """Text of recovered ``ids`` (``-1`` shown as ``gap``).  With ``positions``, tokens are
    put back in sequence order first and every missing position becomes a ``gap`` too."""
    ids = [int(t) for t in ids]
    if positions is not None:
        known = sorted({int(p): t for p, t in zip(positions, ids) if t != NO_TOKEN and int(p) >= 0}.items())
        if not known:
            return ""
        by_pos = dict(known)
        ids = [by_pos.get(p, NO_TOKEN) for p in range(known[0][0], known[-1][0] + 1)]
    out, run = [], []
    for t in ids + [NO_TOKEN]:
        if t == NO_TOKEN:
            if run:
                out.append(tokenizer.decode(run))
                run = []
            out.append(gap)
        else:
            run.append(t)
    return "".join(out)[:-1]


def read_slots(pool, slots, layer: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw K and V bytes of ``slots`` (an iterable of ``(block_id, slot)``) at ``layer``:
    two tensors ``[len(slots), kv_heads, head_dim]``.  This is what a memory dump, or a bug
    that hands these slots to the wrong reader, exposes."""
    slots = list(slots)
    if not slots:
        empty = pool.k_cache.new_zeros((0, pool.num_kv_heads, pool.head_dim))
        return empty, empty.clone()
    b = torch.tensor([s[0] for s in slots], dtype=torch.long, device=pool.device)
    o = torch.tensor([s[1] for s in slots], dtype=torch.long, device=pool.device)
    return pool.k_cache[layer, b, o].clone(), pool.v_cache[layer, b, o].clone()
