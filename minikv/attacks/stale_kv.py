"""Stale KV blocks: reading a previous request's K/V, and turning those bytes back into text.

Lesson 05 (``course/05_leak_stale_blocks.ipynb``) uses everything here.  Two halves:

**The inversion** (attacker side, needs only the model weights, which are public).  At layer 0
nothing has mixed tokens yet, so a slot's K/V is a function of *one* token (and, for K, its
position)::

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

**The bugs** (engine side, deliberately wrong, used only by the lesson and its tests).  The
engine itself is correct; these helpers re-create two realistic bug classes on top of it:

* :func:`unmasked_decode_attention` -- decode attention that forgets to mask the unwritten
  slots of a sequence's last block, so every decode step attends over whatever the block held
  before (patches ``minikv.engine.attention.context_mask`` for the duration of a ``with``);
* :class:`BuggyAbortBlockManager` / :func:`abort_recycles_held_blocks` -- an abort path that
  returns *every* block of the aborted request to the free list, even blocks another request
  still holds (the use-after-free class of bug).

:class:`StaleReadRecorder` records exactly which stale slots a decode read and the layer-0
bytes it read there, so a lesson can state precisely what the bug exposed.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..engine import attention as _attention
from ..engine.block_manager import BlockManager
from ..engine.model import apply_rotary, rms_norm

__all__ = [
    "Layer0Table", "layer0_kv_table", "invert_layer0", "render_tokens",
    "read_slots", "StaleRead", "StaleReadRecorder", "unmasked_decode_attention",
    "buggy_context_mask", "SprayResult", "spray_stale_reads",
    "BuggyAbortBlockManager", "abort_recycles_held_blocks",
]

NO_TOKEN = -1


# ====================================================================== the inversion


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


def _nearest(x: torch.Tensor, rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` nearest table rows (squared L2) for each row of ``x``, non-finite rows -> inf."""
    d = (x * x).sum(1, keepdim=True) - 2 * x @ rows.T + (rows * rows).sum(1)[None]
    d = torch.nan_to_num(d, nan=float("inf"), posinf=float("inf"), neginf=float("inf"))
    d[~torch.isfinite(x).all(1)] = float("inf")
    dist, idx = torch.topk(d, k, dim=1, largest=False)
    return dist.clamp_min(0), idx


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


# ====================================================================== bug 1: no mask


def buggy_context_mask(context_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """BUGGY stand-in for ``attention.context_mask``: every gathered slot is "valid".

    The author assumed a block only ever holds this sequence's tokens; the unwritten tail
    of a reused block (and the padding entries of the batch's block table) are read too.
    """
    return torch.ones(context_lens.shape[0], 1, 1, max_len, dtype=torch.bool, device=context_lens.device)


@dataclass
class StaleRead:
    """The stale slots one decoding sequence attended to in one step (layer 0)."""

    step: int
    request_id: str
    context_len: int
    slots: list[tuple[int, int]]  # (physical block id, slot) read past the sequence's length
    #                               (padding entries of the block table included)
    k: torch.Tensor  # [len(slots), kv_heads, head_dim]: the layer-0 K bytes it read there
    v: torch.Tensor


@dataclass
class StaleReadRecorder:
    """Records, for every decode step run under the bug, the slots past each sequence's length
    that attention consumed, with the layer-0 K/V bytes found there.

    Decode rows are matched to requests through the scheduler's running list (decodes come first,
    in order), which holds for every step without a preemption -- the lessons' setting.
    """

    engine: object
    reads: list[StaleRead] = field(default_factory=list)
    _pending: list = field(default_factory=list)

    def on_gather(self, layer: int, block_tables: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        if layer == 0:
            self._pending.append((block_tables.clone(), k.clone(), v.clone()))

    def on_mask(self, context_lens: torch.Tensor, max_len: int) -> None:
        if not self._pending:
            return
        tables, k, v = self._pending.pop()  # the decode gather is the last one of layer 0
        self._pending.clear()
        running = [s.request_id for s in self.engine.scheduler.running]
        bs, width = self.engine.block_size, tables.shape[1] * self.engine.block_size
        for row, n in enumerate(context_lens.tolist()):
            # every gathered slot past the sequence's length: the tail of its last block, and
            # whole padding blocks when a longer sequence widened the batch's block table
            slots = [(int(tables[row, p // bs]), p % bs) for p in range(n, width)]
            self.reads.append(StaleRead(self.engine.step_count, running[row], n, slots,
                                        k[row, n:width].clone(), v[row, n:width].clone()))


@contextlib.contextmanager
def unmasked_decode_attention(engine=None):
    """Run the engine with BUGGY decode attention that does not mask unwritten slots.

    Inside the ``with`` block, ``minikv.engine.attention.context_mask`` is replaced by
    :func:`buggy_context_mask`.  With ``engine`` given, yields a :class:`StaleReadRecorder`
    that logs what each decode read past its length; the engine is restored on exit.
    """
    original = _attention.context_mask
    recorder = StaleReadRecorder(engine) if engine is not None else None
    original_gather = engine.pool.gather if engine is not None else None

    def mask(context_lens, max_len):
        if recorder is not None:
            recorder.on_mask(context_lens, max_len)
        return buggy_context_mask(context_lens, max_len)

    def gather(layer, block_tables):
        k, v = original_gather(layer, block_tables)
        recorder.on_gather(layer, block_tables, k, v)
        return k, v

    _attention.context_mask = mask
    if engine is not None:
        engine.pool.gather = gather
    try:
        yield recorder
    finally:
        _attention.context_mask = original
        if engine is not None:
            del engine.pool.gather  # back to the class method


@dataclass
class SprayResult:
    """What ``n`` concurrent attacker requests got: their tokens, the logits of the decode step
    (the step whose attention read stale slots under the bug) and the recorded stale reads."""

    request_ids: list[str]
    token_ids: list[list[int]]
    decode_logits: torch.Tensor  # [n, vocab]
    reads: list[StaleRead]

    @property
    def k(self) -> torch.Tensor:
        """Layer-0 K bytes of every stale slot read, [slots, kv_heads, head_dim]."""
        return torch.cat([r.k for r in self.reads]) if self.reads else torch.zeros(0)

    @property
    def v(self) -> torch.Tensor:
        return torch.cat([r.v for r in self.reads]) if self.reads else torch.zeros(0)

    @property
    def slots(self) -> list[tuple[int, int]]:
        return [s for r in self.reads for s in r.slots]


def spray_stale_reads(engine, prompt_ids: list[int], n_requests: int, *, tenant: str | None = None,
                      buggy: bool = True) -> SprayResult:
    """The attacker's move: ``n_requests`` concurrent greedy requests of ``prompt_ids``, two
    output tokens each (``ignore_eos``), run to completion.

    With a prompt of exactly ``k * block_size`` tokens, each request's first decode token needs
    a fresh block: it writes slot 0 and, under :func:`unmasked_decode_attention` (``buggy``),
    attends over slots 1..block_size-1 -- whatever the block's previous owner left there.
    """
    from ..engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    ids = [engine.new_request_id() for _ in range(n_requests)]
    saved, engine.logit_trace = engine.logit_trace, []
    ctx = unmasked_decode_attention(engine) if buggy else contextlib.nullcontext()
    done: dict[str, list[int]] = {}
    try:
        with ctx as recorder:
            for rid in ids:
                engine.add_request(rid, list(prompt_ids), params, tenant=tenant)
            while len(done) < n_requests:
                for out in engine.step():
                    if out.finished and out.request_id in ids:
                        done[out.request_id] = list(out.outputs[0].token_ids)
        per_req = {rid: [step[rid] for step in engine.logit_trace if rid in step] for rid in ids}
    finally:
        engine.logit_trace = saved
    logits = torch.stack([per_req[rid][-1] for rid in ids])
    reads = sorted(recorder.reads, key=lambda r: ids.index(r.request_id)) if recorder else []
    return SprayResult(ids, [done[rid] for rid in ids], logits, reads)


# ============================================================= bug 2: abort recycles held blocks


class BuggyAbortBlockManager(BlockManager):
    """BUGGY: on abort, every block of the request goes straight back to the free list.

    The abort path was written as if an aborted request owned its blocks exclusively.  A block
    shared with another running request (a prefix-cache hit) is recycled while that request
    still reads it: the next allocation hands the same physical block to a second owner.  This
    is the use-after-free class of bug (recycling memory that something still uses).
    Finishes and preemptions still take the correct path.
    """

    def free(self, seq) -> None:
        if seq.finish_reason != "abort":
            return super().free(seq)
        recycled = []
        for bid in reversed(seq.block_table):
            block = self.blocks[bid]
            block.ref_count -= 1
            block.holders.remove(seq.request_id)
            self.cached_free.pop(bid, None)
            if bid not in self.free_ids:
                self.free_ids.append(bid)  # BUG: ignores block.ref_count (other holders)
                recycled.append(bid)
        seq.block_table = []
        seq.num_computed_tokens = 0
        self._emit("free", recycled, seq)
        self._emit("release", recycled, seq)


@contextlib.contextmanager
def abort_recycles_held_blocks(engine):
    """Swap ``engine``'s block manager to :class:`BuggyAbortBlockManager` inside a ``with``.

    The engine's state is left as the bug made it (possibly inconsistent); use a throw-away
    engine.  On exit the correct class is restored for subsequent calls.
    """
    bm = engine.block_manager
    original = type(bm)
    bm.__class__ = BuggyAbortBlockManager
    try:
        yield bm
    finally:
        bm.__class__ = original
