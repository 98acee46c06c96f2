"""The pool's interleaved layout: one tensor ``[layer, block, slot, 2, kv_head, head_dim]``, with
``k_cache`` / ``v_cache`` as views of it.

What must hold: the fused path's single write (``kv_slots``) and single gather (``kv_blocks``,
``attention_fused._read``) see exactly what the reference's separate K and V calls see, and
whatever lessons, scrubbers and attacks do to ``k_cache`` / ``v_cache`` happens to the pool.
"""
from __future__ import annotations

import torch

from minikv.backends.attention_fused import _read
from minikv.backends.fused_plan import Group, decode_mask
from minikv.engine.kv_pool import KVPool

LAYERS, BLOCKS, BS, KV, D = 2, 6, 4, 3, 8


def _pool() -> KVPool:
    return KVPool(LAYERS, BLOCKS, BS, KV, D, torch.float32, "cpu")


def _random_tokens(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, KV, D, generator=g), torch.randn(t, KV, D, generator=g)


def test_views_have_the_documented_shape_and_share_the_one_tensor():
    pool = _pool()
    assert tuple(pool._kv.shape) == (LAYERS, BLOCKS + 2, BS, 2, KV, D)
    assert tuple(pool.k_cache.shape) == tuple(pool.v_cache.shape) == (LAYERS, BLOCKS, BS, KV, D)
    for view in (pool.k_cache, pool.v_cache, pool.k_slots[1], pool.kv_slots[1], pool.kv_blocks[1]):
        assert view.untyped_storage().data_ptr() == pool._kv.untyped_storage().data_ptr()
    pool.v_cache[1, 2, 3, 0, 5] = 7.0  # a lesson's write through the view lands in the V half
    assert pool._kv[1, 2, 3, 1, 0, 5] == 7.0 and pool._kv[1, 2, 3, 0, 0, 5] == 0.0
    assert pool.nbytes == 2 * LAYERS * BLOCKS * BS * KV * D * 4


def test_one_interleaved_write_equals_the_reference_write_of_k_then_v():
    a, b = _pool(), _pool()
    slots = torch.tensor([0, 5, 9, 22, 23])  # blocks 0, 1, 2, 5; slot 23 is block 5's last
    k, v = _random_tokens(len(slots), seed=1)
    for layer in range(LAYERS):
        a.write(layer, slots, k + layer, v - layer)  # the reference: K, then V
        b.kv_slots[layer].index_copy_(0, slots, torch.cat([k + layer, v - layer], dim=1))  # fused: [T, 2 * KV, D]
    assert torch.equal(a._kv, b._kv)
    assert torch.equal(b.k_cache[0, 5, 3], k[4]) and torch.equal(b.v_cache[0, 5, 3], v[4])
    assert torch.equal(b.k_cache[1, 2, 1], k[2] + 1) and torch.equal(b.v_cache[1, 2, 1], v[2] - 1)


def test_the_fused_read_returns_the_reference_gathers_k_and_v():
    pool = _pool()
    slots = torch.arange(BLOCKS * BS)
    k, v = _random_tokens(len(slots), seed=2)
    pool.write(1, slots, k, v)
    tables = torch.tensor([[4, 1, 0], [2, BLOCKS, BLOCKS], [5, 3, BLOCKS]])  # short rows padded with the pad block
    ctx = torch.tensor([12, 3, 7])
    g = Group("decode", slice(0, 3), slice(0, 3), None, 1, tables.flatten(), decode_mask(ctx, 3 * BS, torch.float32))
    kf, vf = _read(pool.kv_blocks[1], g)  # [S, KV, 3 * BS, D]
    kr, vr = pool.gather(1, tables)  # [S, 3 * BS, KV, D]
    assert tuple(kf.shape) == (3, KV, 3 * BS, D)
    assert torch.equal(kf, kr.transpose(1, 2)) and torch.equal(vf, vr.transpose(1, 2))
    assert not torch.equal(kf, vf)  # V really starts KV * D elements in, not at K
    assert kf[1, :, BS:].abs().sum() == 0 and vf[1, :, BS:].abs().sum() == 0  # the pad block reads as zeros


def test_scrubbing_through_the_views_zeroes_k_and_v_of_exactly_those_blocks():
    pool = _pool()
    pool._kv.fill_(1.0)
    pool.zero_blocks([1, 4])  # index_fill_ on k_cache and v_cache, the exercise's solution
    zeroed = pool._kv[:, [1, 4]]
    assert zeroed.abs().sum() == 0  # both halves of the interleaved slots
    kept = pool._kv[:, [0, 2, 3, 5]]
    assert kept.eq(1.0).all()  # K and V of the neighbours, interleaved with nothing scrubbed
    assert pool._kv[:, BLOCKS:].eq(1.0).all()  # pad and scratch blocks: not the scrubber's
