"""Decode block tables are padded with the pool's reserved pad block, never with block 0.

Block 0 is some request's block; padding with it would point every short row of a decode batch
at another tenant's K/V, hidden only by the mask.  The pad block (id ``num_blocks``) is one block
past the pool the block manager manages: never handed out, never written, so always zero.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from minikv import LLM
from minikv.engine import SamplingParams
from minikv.engine.kv_pool import KVPool


def test_pool_has_one_hidden_pad_block_outside_what_lessons_see():
    pool = KVPool(3, 10, 4, 2, 8, torch.float32, "cpu")
    assert pool.pad_block == 10
    assert tuple(pool.k_cache.shape) == tuple(pool.v_cache.shape) == (3, 10, 4, 2, 8)
    assert pool.nbytes == 2 * 3 * 10 * 4 * 2 * 8 * 4  # the pad block is not part of the pool's size
    pool.k_cache.fill_(1.0)  # everything a scrubber, lesson or attack can reach...
    pool.v_cache.fill_(1.0)
    pool.zero_blocks([0, 9])
    assert pool.gather(0, torch.tensor([[10, 10]]))[0].abs().sum() == 0  # ...leaves the pad block zero
    assert pool.gather(0, torch.tensor([[1, 10]]))[0][0, :4].eq(1).all()


@pytest.mark.filterwarnings("ignore:minikv. UNSAFE settings")
@pytest.mark.parametrize("backend", ["reference", "fused"])
def test_block_manager_never_hands_out_the_pad_block_and_it_stays_zero(backend):
    llm = LLM("tiny-random", device="cpu", attention_backend=backend, num_blocks=12, scrub="none",
              enable_prefix_caching=True, max_cached_blocks_per_tenant="unlimited")
    eng = llm.engine
    seen = set()
    p = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    # mixed lengths so decode rows get padded; enough requests to recycle every block
    for round_ in range(4):
        for i, n in enumerate((5, 30, 61)):
            eng.add_request(f"r{round_}-{i}", [3 + (round_ * 7 + i + j) % 250 for j in range(n)], p)
        while eng.has_unfinished_requests():
            eng.step()
            for seq in eng.scheduler.running:
                seen.update(seq.block_table)
    assert seen == set(range(12))  # every real block was used; the pad block (12) never was
    assert eng.pool._k[:, eng.pool.pad_block].abs().sum() == 0
    assert eng.pool._v[:, eng.pool.pad_block].abs().sum() == 0
    assert eng.pool.k_cache.abs().sum() > 0  # the run did write K/V (scrub="none" keeps them)
    snap = eng.snapshot()
    assert snap.num_blocks == 12 and [b.block_id for b in snap.blocks] == list(range(12))


def test_short_decode_rows_are_padded_with_the_pad_block_not_block_0():
    llm = LLM("tiny-random", device="cpu", attention_backend="reference", num_blocks=32)
    eng = llm.engine
    tables = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng.set_kv_read_observer(lambda layer, t, lens, k, v: tables.append((t.clone(), lens.clone(), k.clone())))
    p = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    eng.add_request("long", list(range(3, 70)), p)  # 5 blocks
    eng.add_request("short", list(range(3, 8)), p)  # 1 block: padded with 4 entries
    while eng.has_unfinished_requests():
        eng.step()
    t, lens, k = tables[0]
    short = int(lens.argmin())
    own = len(eng.block_manager.blocks)  # ids below this are the block manager's
    padded = t[short, 1:]
    assert padded.tolist() == [eng.pool.pad_block] * len(padded) and all(b < own for b in t[short, :1].tolist())
    assert k[short, eng.block_size:].abs().sum() == 0  # what the padding gathered: zeros
