"""The prefix-cache oracle attack of lesson 04 (``minikv.attacks.prefix_oracle``), on tiny-random.

Both directions, as everywhere in minikv's isolation tests: under ``cache_isolation="shared"`` the
count oracle must recover the victim's secret, and under ``"tenant"`` it must recover nothing while
the victim's own requests still hit (a test that only checks "no hit" also passes when nothing is
cached at all).  The secret is built from the model's own ranking -- its token ``i`` is the model's
``RANKS[i]``-th choice -- so it lies inside the attacker's top-k but is not the greedy guess, and
the number of probes is known in advance.  No test asserts on a timing.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.attacks import prefix_oracle as po

K = 3
RANKS = (1, 2, 0)          # rank of each secret token among the model's candidates
VICTIM, ATTACKER = "victim", "mallory"
PREFIX = "Clinic note. The patient suffers from"    # byte-level: cut to 32 tokens below
SUFFIX = ". Answer kindly, briefly, and never give medical advice to anyone."


def _llm(block_size: int, isolation: str = "shared") -> LLM:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        return LLM("tiny-random", device="cpu", dtype="float32", block_size=block_size,
                   num_blocks=2048 // block_size, enable_prefix_caching=True, cache_isolation=isolation)


def _scenario(llm: LLM):
    """(known prefix, secret, known suffix, victim prompt) with the secret on a block boundary."""
    tok = llm.get_tokenizer()
    prefix = (tok(PREFIX, add_special_tokens=False).input_ids * 2)[:32]
    secret: list[int] = []
    for r in RANKS:
        secret.append(po.rank_candidates(llm.engine, prefix + secret, K)[r])
    suffix = tok(SUFFIX, add_special_tokens=False).input_ids
    question = tok(" Q: when is my next appointment?", add_special_tokens=False).input_ids
    return prefix, secret, suffix, prefix + secret + suffix + question


def _attack(llm: LLM, prefix, secret, suffix):
    return po.recover_secret_by_count(llm, prefix, len(secret), suffix, attacker_tenant=ATTACKER, k=K)


def _expected_probes(block_size: int) -> int:
    """Depth-first search cost: a block with unknown tokens of ranks r1..ru costs
    sum(r_i * K**(u - i)) + 1 probes (every earlier sibling subtree is exhausted first)."""
    total, i = 0, 0
    while i < len(RANKS):
        u = min(block_size - (32 + i) % block_size, len(RANKS) - i)
        total += sum(r * K ** (u - 1 - j) for j, r in enumerate(RANKS[i:i + u])) + 1
        i += u
    return total


def test_count_oracle_recovers_a_secret_the_model_alone_misses():
    llm = _llm(block_size=1)
    prefix, secret, suffix, victim = _scenario(llm)
    assert po.greedy_fill(llm.engine, prefix, len(secret)) != secret  # model-only baseline fails
    assert po.token_ranks(llm.engine, prefix, secret) == list(RANKS)
    llm.generate([victim], SamplingParams(max_tokens=2, temperature=0.0), tenant=VICTIM)
    rec = _attack(llm, prefix, secret, suffix)
    assert rec.complete and rec.token_ids == secret
    assert rec.probes == _expected_probes(1) == sum(r + 1 for r in RANKS)
    assert rec.probes_per_block == [r + 1 for r in RANKS]
    assert [hit for *_, hit in rec.trace].count(True) == len(secret)
    llm.engine.check_invariants()


@pytest.mark.parametrize("isolation", ["tenant", "request"])
def test_count_oracle_fails_cleanly_when_the_cache_is_isolated(isolation):
    llm = _llm(block_size=1, isolation=isolation)
    prefix, secret, suffix, victim = _scenario(llm)
    llm.generate([victim], SamplingParams(max_tokens=2, temperature=0.0), tenant=VICTIM)
    rec = _attack(llm, prefix, secret, suffix)
    assert not rec.complete and rec.token_ids == []
    assert rec.probes == K                        # every candidate for the first token missed
    assert not any(hit for *_, hit in rec.trace)
    # the other direction: caching still works inside the victim's own domain
    again = po.probe_cached_tokens(llm, victim, VICTIM)
    assert again == (len(victim) - 1 if isolation == "tenant" else 0)


def test_probe_count_grows_with_block_size():
    probes = {}
    for bs in (1, 2, 4, 8, 16):
        llm = _llm(block_size=bs)
        prefix, secret, suffix, victim = _scenario(llm)
        llm.generate([victim], SamplingParams(max_tokens=1, temperature=0.0), tenant=VICTIM)
        rec = _attack(llm, prefix, secret, suffix)
        assert rec.complete and rec.token_ids == secret, bs
        assert rec.probes == _expected_probes(bs), bs
        probes[bs] = rec.probes
    counts = [probes[bs] for bs in sorted(probes)]
    assert counts == sorted(counts) and counts[-1] > counts[0]
    assert probes[16] == 1 * K**2 + 2 * K + 0 + 1  # the whole secret is one block's search


def test_self_priming_and_forgetting():
    llm = _llm(block_size=16)
    prefix, secret, suffix, victim = _scenario(llm)
    llm.generate([victim], SamplingParams(max_tokens=1, temperature=0.0), tenant=VICTIM)
    wrong = list(secret)
    wrong[0] = next(t for t in po.rank_candidates(llm.engine, prefix, K) if t != secret[0])
    tail = suffix + [0]
    end = 32 + len(secret) + len(suffix)          # the probe shares end // 16 blocks on a hit
    assert po.probe_cached_tokens(llm, prefix + wrong + tail, ATTACKER) == 32          # miss
    assert po.probe_cached_tokens(llm, prefix + wrong + tail, ATTACKER) == end // 16 * 16  # own entry
    assert po.forget_tenant_blocks(llm, ATTACKER) > 0
    assert po.probe_cached_tokens(llm, prefix + wrong + tail, ATTACKER) == 32          # miss again
    assert po.probe_cached_tokens(llm, prefix + secret + tail, ATTACKER) == end // 16 * 16
    po.forget_tenant_blocks(llm, ATTACKER)
    assert all(llm.engine.block_manager.blocks[b].writer_tenant != ATTACKER
               for b in llm.engine.block_manager.cached)
    llm.engine.check_invariants()


def test_timing_rounds_shape_and_hygiene():
    llm = _llm(block_size=16)
    prefix, secret, suffix, victim = _scenario(llm)
    llm.generate([victim], SamplingParams(max_tokens=1, temperature=0.0), tenant=VICTIM)
    wrong = [(secret[0] + 1) % llm.engine.model.shape.vocab_size] + secret[1:]
    probes = [prefix + secret + suffix + [0], prefix + wrong + suffix + [0]]
    ttft = po.timing_rounds(llm, probes, rounds=3, attacker_tenant=ATTACKER, background_max=5)
    assert ttft.shape == (3, 2) and np.isfinite(ttft).all() and (ttft > 0).all()
    bm = llm.engine.block_manager
    assert not any(bm.blocks[b].writer_tenant in (ATTACKER, "bystander") for b in bm.cached)
    assert po.probe_cached_tokens(llm, probes[0], ATTACKER) > 32  # the victim's blocks survived
    llm.engine.check_invariants()


def test_repeats_needed_on_synthetic_timings():
    rng = np.random.default_rng(0)
    clear = rng.normal(1.0, 0.01, (20, 3))
    clear[:, 1] -= 0.5                              # candidate 1 is always much faster
    assert po.repeats_needed(clear, 1) == 1
    noisy = rng.normal(1.0, 0.1, (20, 3))           # no candidate is faster
    assert po.repeats_needed(noisy, 1, max_repeats=10) is None
    outlier = clear[:4].copy()
    outlier[0, 1] = 9.0                             # one slow hit: only the median of 3 absorbs it
    assert po.repeats_needed(outlier, 1) == 3


def test_worst_case_and_bad_input():
    assert po.worst_case_probes_per_token(1, 3, 3) == 3
    assert po.worst_case_probes_per_token(16, 3, 3) == 27 / 3
    assert po.worst_case_probes_per_token(4, 16, 3) == 4 * 3**4 / 16
    llm = _llm(block_size=16)
    prefix, secret, suffix, _ = _scenario(llm)
    with pytest.raises(ValueError, match="known_suffix_ids"):
        _attack(llm, prefix, secret, suffix[:3])
    with pytest.raises(ValueError, match="k must be"):
        po.rank_candidates(llm.engine, prefix, 0)
