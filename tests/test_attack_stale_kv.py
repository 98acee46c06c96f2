"""Lesson 05's attack: stale blocks read through a buggy mask, inverted from layer-0 K/V.

Everything runs on tiny-random (2 layers, 259-token byte vocabulary) in a few seconds; one
optional check repeats the exact inversion on SmolLM2 when it is available.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.attacks.engine_bugs import (abort_recycles_held_blocks, buggy_abort_release, buggy_context_mask,
                                        spray_stale_reads, unmasked_decode_attention)
from minikv.attacks.kv_inversion import invert_layer0, layer0_kv_table, read_slots, render_tokens
from minikv.engine import attention

BS = 16


def make_llm(path, scrub="none", **kw) -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        llm = LLM(str(path), block_size=BS, scrub=scrub, seed=0, **kw)
    # scrub="none" allocates the pool with torch.empty: start from zeros so that slots nobody wrote
    # read the same in every run (the experiments below compare runs bit for bit)
    llm.engine.pool.zero_blocks(list(range(llm.engine.num_blocks)))
    return llm


@pytest.fixture(scope="module")
def tiny_table(tiny_path):
    return layer0_kv_table(make_llm(tiny_path, num_blocks=8).engine.model)


def victim_prompt(secret: str) -> list[int]:
    # ids 3..258 are bytes in the tiny tokenizer; 3 full blocks of text, then a partial one
    text = f"alice: my PIN is {secret}, keep it safe please. The weather is nice today, thanks!"
    return [3 + b for b in text.encode()][:56]


ATTACKER = [3 + b for b in b"mallory says hi!"]  # exactly one block
assert len(ATTACKER) == BS


def run_victim(llm, ids, max_tokens=8):
    out = llm.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       tenant="alice")[0]
    return ids + out.outputs[0].token_ids[:-1]  # every token whose K/V was written


# ------------------------------------------------------------------ the inversion itself


def test_inversion_recovers_tokens_and_positions_exactly(tiny_path, tiny_table):
    llm = make_llm(tiny_path, num_blocks=8)
    written = run_victim(llm, victim_prompt("4471"))
    eng = llm.engine
    slots = [(b, s) for b in range(4) for s in range(BS)][:len(written)]  # fresh pool: blocks 0..3
    k, v = read_slots(eng.pool, slots)
    assert k.shape == (len(written), eng.model.shape.num_kv_heads, eng.model.shape.head_dim)
    assert invert_layer0(v, tiny_table, "v").tolist() == written
    ids, pos = invert_layer0(k, tiny_table, "k", return_positions=True)
    assert ids.tolist() == written
    assert pos.tolist() == list(range(len(written)))
    # shuffled slots (no metadata): K still puts the text back in order
    perm = torch.randperm(len(written), generator=torch.Generator().manual_seed(0))
    ids, pos = invert_layer0(k[perm], tiny_table, "k", return_positions=True)
    tok = llm.get_tokenizer()
    assert render_tokens(tok, ids, pos) == tok.decode(written)


def test_inversion_works_on_a_bf16_pool(tiny_path):
    """GPUs serve in bf16: rounding is coarser, the default tolerance follows the dtype."""
    llm = make_llm(tiny_path, num_blocks=8, dtype="bfloat16")
    table = layer0_kv_table(llm.engine.model)
    written = run_victim(llm, victim_prompt("4471"))
    k, v = read_slots(llm.engine.pool, [(p // BS, p % BS) for p in range(len(written))])
    assert k.dtype == torch.bfloat16
    assert invert_layer0(v, table, "v").tolist() == written
    ids, pos = invert_layer0(k, table, "k", return_positions=True)
    assert ids.tolist() == written and pos.tolist() == list(range(len(written)))


def test_inversion_rejects_zeros_noise_and_bad_shapes(tiny_table):
    h, d = tiny_table.kv_heads, tiny_table.head_dim
    zeros = torch.zeros(5, h, d)
    noise = torch.randn(5, h, d, generator=torch.Generator().manual_seed(1))
    nan = torch.full((2, h, d), float("nan"))
    for kind in ("v", "k"):
        for x in (zeros, noise, nan):
            assert (invert_layer0(x, tiny_table, kind) == -1).all()
    assert invert_layer0(torch.zeros(0, h, d), tiny_table).numel() == 0
    with pytest.raises(ValueError, match="expected slots of shape"):
        invert_layer0(torch.zeros(3, h + 1, d), tiny_table)
    with pytest.raises(ValueError, match="kind"):
        invert_layer0(zeros, tiny_table, "q")


# ------------------------------------------------------------------ the buggy mask


def test_the_bug_is_scoped_to_one_engine_and_removed_on_exit(tiny_path):
    llm, other = make_llm(tiny_path, num_blocks=8), make_llm(tiny_path, num_blocks=8)
    original = attention.context_mask
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the helper installs the seams on purpose: no warning escapes
        with unmasked_decode_attention(llm.engine) as rec:
            assert llm.engine.decode_mask is buggy_context_mask
            assert llm.engine.kv_read_observer == rec.on_decode_read
            assert other.engine.decode_mask is None and other.engine.kv_read_observer is None
    assert attention.context_mask is original  # nothing global was touched
    assert llm.engine.decode_mask is None and llm.engine.kv_read_observer is None
    assert rec.reads == []
    m = buggy_context_mask(torch.tensor([3, 5]), 8)
    assert m.shape == (2, 1, 1, 8) and bool(m.all())


def spray_after_victim(tiny_path, scrub, secret, buggy=True):
    """Pool of 8 blocks: alice fills 4, then 4 attacker requests each take one fresh block for
    their prompt and one of alice's freed blocks for their first decode token."""
    llm = make_llm(tiny_path, scrub=scrub, num_blocks=8)
    written = run_victim(llm, victim_prompt(secret))
    assert len(written) <= 4 * BS
    return written, spray_stale_reads(llm.engine, ATTACKER, 4, tenant="mallory", buggy=buggy), llm


def test_unscrubbed_stale_reads_invert_to_the_victims_tokens(tiny_path, tiny_table):
    written, spray, llm = spray_after_victim(tiny_path, "none", "4471")
    # each attacker request read slots 1..15 of one of alice's four blocks
    assert len(spray.reads) == 4 and all(len(r.slots) == BS - 1 for r in spray.reads)
    assert sorted({b for b, _ in spray.slots}) == [0, 1, 2, 3]
    ids_v = invert_layer0(spray.v, tiny_table, "v")
    ids_k, pos = invert_layer0(spray.k, tiny_table, "k", return_positions=True)
    assert torch.equal(ids_v, ids_k)
    got = {int(p): int(t) for p, t in zip(pos, ids_k) if t >= 0}
    expected = {p: t for p, t in enumerate(written) if p % BS != 0}  # slot 0 was overwritten
    assert got == expected
    text = render_tokens(llm.get_tokenizer(), ids_k, pos)
    assert "my PIN is\u2591" in text and "4471, keep it s" in text  # position 16 (a space) was lost


@pytest.mark.parametrize("scrub", ["on_alloc", "on_free"])
def test_scrubbing_leaves_only_zeros(tiny_path, tiny_table, scrub):
    _, spray, _ = spray_after_victim(tiny_path, scrub, "4471")
    assert len(spray.reads) == 4 and len(spray.slots) == 4 * (BS - 1)
    assert spray.k.abs().max() == 0 and spray.v.abs().max() == 0
    assert (invert_layer0(spray.v, tiny_table, "v") == -1).all()
    assert (invert_layer0(spray.k, tiny_table, "k") == -1).all()


def test_non_interference_holds_only_with_scrub_or_mask(tiny_path):
    """The attacker's output must not depend on the victim's secret.  The buggy mask breaks
    that without scrubbing (a front-door leak); scrubbing or the correct mask restores it."""
    def logits(scrub, secret, buggy):
        return spray_after_victim(tiny_path, scrub, secret, buggy)[1].decode_logits

    assert not torch.equal(logits("none", "4471", True), logits("none", "9920", True))
    assert torch.equal(logits("on_alloc", "4471", True), logits("on_alloc", "9920", True))
    assert torch.equal(logits("none", "4471", False), logits("none", "9920", False))


# ------------------------------------------------------------------ the buggy abort path


def _two_sharers(llm):
    """alice's r1 runs; alice's r2 hits r1's three full prompt blocks; both are running."""
    eng = llm.engine
    ids = victim_prompt("4471")[:50]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    eng.add_request("r1", ids, params, tenant="alice")
    eng.step()
    eng.add_request("r2", ids, params, tenant="alice")
    eng.step()
    shared = eng.requests["r1"].block_table[:3]
    assert eng.requests["r2"].block_table[:3] == shared
    return eng, shared


def test_correct_abort_keeps_shared_blocks(tiny_path):
    eng, shared = _two_sharers(make_llm(tiny_path, num_blocks=12, enable_prefix_caching=True))
    eng.abort_request("r1")
    eng.check_invariants()
    assert not set(shared) & set(eng.block_manager.free_ids)


def test_buggy_abort_recycles_a_block_still_in_use(tiny_path):
    eng, shared = _two_sharers(make_llm(tiny_path, num_blocks=12, enable_prefix_caching=True))
    with abort_recycles_held_blocks(eng) as bm:
        assert bm is eng.block_manager and eng.abort_release is buggy_abort_release
        eng.abort_request("r1")
        assert set(shared) <= set(bm.free_ids)  # on the free list ...
        assert all(bm.blocks[b].ref_count == 1 for b in shared)  # ... while r2 still holds them
        with pytest.raises(AssertionError):
            eng.check_invariants()
    assert eng.abort_release is None


# ------------------------------------------------------------------ the course model


def test_smollm2_inversion_is_exact(smollm2_path):
    llm = make_llm(smollm2_path, num_blocks=8)
    table = layer0_kv_table(llm.engine.model)
    tok = llm.get_tokenizer()
    ids = tok("My PIN is 4471-9920. Keep it safe.").input_ids
    written = run_victim(llm, ids, max_tokens=2)
    slots = [(p // BS, p % BS) for p in range(len(written))]  # fresh pool: blocks 0, 1, ...
    k, v = read_slots(llm.engine.pool, slots)
    assert invert_layer0(v, table, "v").tolist() == written
    got, pos = invert_layer0(k, table, "k", return_positions=True)
    assert got.tolist() == written and pos.tolist() == list(range(len(written)))
