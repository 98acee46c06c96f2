"""Lesson 06's attacks: contamination through content-only keys, poisoning through collisions.

On tiny-random (259-token byte vocabulary), with collisions crafted for that vocabulary:
the algebraic ``poly`` twin and a ``trunc32`` birthday pair.  The committed SmolLM2 pairs
(``builtin`` included) are checked on the course model when it is available.
"""
from __future__ import annotations

import warnings

import pytest

from minikv import LLM, UnsafeSettingWarning
from minikv.attacks.poisoning import (HitRecorder, contamination_demo, fit_block, poison_with_collision,
                                      reference_greedy, run_request)
from minikv.attacks.collisions import collides, load_committed_pairs, poly_collision, search_trunc32_collision

BS = 16
TINY_VOCAB = 259
A = [3 + (i * 7) % 200 for i in range(BS)]
B = [3 + (i * 11 + 5) % 200 for i in range(BS)]
S = [3 + (i * 13 + 1) % 200 for i in range(2 * BS)]
TAIL = [40, 41, 42, 43, 44]


def engine(path, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        return LLM(str(path), num_blocks=32, block_size=BS, enable_prefix_caching=True, seed=0, **kw).engine


@pytest.fixture(scope="module")
def trunc32_pair():
    pair = search_trunc32_collision(n_samples=2**17, seed=0, vocab_size=TINY_VOCAB)
    assert pair is not None and collides("trunc32", *pair)
    return pair


@pytest.fixture(scope="module")
def poly_pair():
    block = tuple(range(100, 100 + BS))
    twin = poly_collision(block, vocab_size=TINY_VOCAB)
    assert collides("poly", block, twin)
    return twin, block  # (attacker's block, victim's block)


@pytest.fixture(scope="module")
def contamination_ref(tiny_path):
    return reference_greedy(engine(tiny_path), B + S + TAIL, 4)


def test_reference_paths_agree(tiny_path):
    """The cache-off reference is the same whether computed by engine.score (cache on) or by a
    plain request on an engine without a prefix cache."""
    ids = B + S + TAIL
    toks_score, logits_score = reference_greedy(engine(tiny_path), ids, 4)
    off = LLM(str(tiny_path), num_blocks=32, block_size=BS, seed=0).engine
    toks_req, logits_req = reference_greedy(off, ids, 4)
    assert toks_score == toks_req
    assert max(float((a - b).abs().max()) for a, b in zip(logits_score, logits_req)) < 1e-4


# ------------------------------------------------------------------ contamination


@pytest.mark.parametrize("verify", [False, "tokens"])
def test_content_only_keys_contaminate(tiny_path, contamination_ref, verify):
    """chain_hashes=False: the victim hits a block with its own tokens computed after another
    prefix.  A tokens-only check cannot see the difference."""
    res = contamination_demo(engine(tiny_path, chain_hashes=False, verify_hits=verify), A, B, S, TAIL,
                             reference=contamination_ref)
    assert res.contaminated
    assert [(h.index, h.tokens_match, h.context_match) for h in res.victim.hits] == \
        [(0, True, True), (1, True, False), (2, True, False)]
    assert res.max_logit_diff > 1.0  # the wrong context changes the output


@pytest.mark.parametrize("settings", [dict(chain_hashes=False, verify_hits=True),
                                      dict(chain_hashes=True, verify_hits=False),
                                      dict()])  # the secure default
def test_full_verification_or_chaining_stops_contamination(tiny_path, contamination_ref, settings):
    eng = engine(tiny_path, **settings)
    res = contamination_demo(eng, A, B, S, TAIL, reference=contamination_ref)
    assert not res.contaminated and not res.victim.wrong_hits
    assert [h.index for h in res.victim.hits] == [0]  # only the correct first block is reused
    assert res.victim.token_ids == res.reference_tokens and res.max_logit_diff < 1e-4
    if settings.get("verify_hits", True) is True and not settings.get("chain_hashes", True):
        assert eng.block_manager.num_rejected_hits == 1


def test_contamination_demo_checks_block_sizes(tiny_path):
    with pytest.raises(ValueError, match="first_a must be exactly one block"):
        contamination_demo(engine(tiny_path), A[:-1], B, S, TAIL)
    with pytest.raises(ValueError, match="shared must be a whole number of blocks"):
        contamination_demo(engine(tiny_path), A, B, S[:-1], TAIL)


# ------------------------------------------------------------------ collision poisoning


@pytest.mark.parametrize("algo", ["poly", "trunc32"])
def test_collision_poisons_without_verification(tiny_path, poly_pair, trunc32_pair, algo):
    a, b = poly_pair if algo == "poly" else trunc32_pair
    res = poison_with_collision(engine(tiny_path, hash_algo=algo, cache_isolation="shared", verify_hits=False),
                                a, b, TAIL, attacker_tenant="mallory", victim_tenant="alice")
    assert res.keys_equal and res.poisoned
    assert res.victim.num_cached_tokens == BS
    assert not res.victim.hits[0].tokens_match
    assert res.max_logit_diff > 1.0


@pytest.mark.parametrize("verify", ["tokens", True])
@pytest.mark.parametrize("algo", ["poly", "trunc32"])
def test_verification_rejects_colliding_blocks(tiny_path, poly_pair, trunc32_pair, algo, verify):
    a, b = poly_pair if algo == "poly" else trunc32_pair
    eng = engine(tiny_path, hash_algo=algo, cache_isolation="shared", verify_hits=verify)
    res = poison_with_collision(eng, a, b, TAIL, attacker_tenant="mallory", victim_tenant="alice")
    assert res.keys_equal and not res.poisoned and res.victim.hits == []
    assert eng.block_manager.num_rejected_hits == 1
    assert res.victim.token_ids == res.reference_tokens and res.max_logit_diff < 1e-4


def test_secure_default_ignores_collisions(tiny_path, poly_pair, trunc32_pair):
    eng = engine(tiny_path)  # sha256, chained, verified, tenant-keyed
    for a, b in (poly_pair, trunc32_pair):
        for attacker in ("mallory", "alice"):  # another tenant, and inside the victim's tenant
            res = poison_with_collision(eng, a, b, TAIL, attacker_tenant=attacker, victim_tenant="alice")
            assert not res.keys_equal and not res.victim.wrong_hits
            assert res.victim.token_ids == res.reference_tokens and res.max_logit_diff < 1e-4


def test_hit_recorder_marks_faithful_hits(tiny_path):
    eng = engine(tiny_path)
    ids = A + B + TAIL
    run_request(eng, ids, 1, "alice")
    run = run_request(eng, ids, 1, "alice")
    assert [(h.index, h.faithful) for h in run.hits] == [(0, True), (1, True)]
    with HitRecorder(eng) as rec:
        assert rec in eng.block_manager.listeners
    assert rec not in eng.block_manager.listeners


def test_fit_block():
    assert fit_block([1, 2, 3], 4, 0) == [1, 2, 3, 0]
    assert fit_block(list(range(6)), 4, 0) == [0, 1, 2, 3]


# ------------------------------------------------------------------ the course model


@pytest.mark.parametrize("algo", ["builtin", "trunc32", "poly"])
def test_committed_pairs_poison_smollm2(smollm2_path, algo):
    a, b = load_committed_pairs()[algo]
    question = [5248, 42, 1812, 314, 260, 3575, 282, 4649, 47, 19842, 42]  # arbitrary in-vocabulary tail
    kw = dict(hash_algo=algo, cache_isolation="shared")
    res = poison_with_collision(engine(smollm2_path, verify_hits=False, **kw), a, b, question, max_tokens=2)
    assert res.keys_equal and res.poisoned and res.max_logit_diff > 1.0
    safe = poison_with_collision(engine(smollm2_path, verify_hits=True, **kw), a, b, question, max_tokens=2)
    assert not safe.poisoned and safe.victim.token_ids == safe.reference_tokens
