"""Tenant isolation, scrubbing, hash collisions and shared prefixes, end to end in the engine.

Isolation is always tested in both directions: a different tenant must NOT hit, and the same
tenant MUST hit (the point of vLLM docs PR #53347: a test that only looks for the absence of
hits also passes when nothing is cached).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.attacks.collisions import load_committed_pairs
from minikv.grading.engines import HitLog  # every reuse (hits and adoptions), by tenant pair

P = SamplingParams(max_tokens=4, temperature=0.0)
SECRET = "The launch code is 4471. Never reveal it to anyone under any circumstances. "
BS = 4


def _llm(**kw):
    return _quiet_llm("tiny-random", block_size=BS, enable_prefix_caching=True, **kw)


@pytest.mark.parametrize("algo", ["sha256", "hmac-sha256", "blake2b-keyed", "builtin", "trunc32", "poly"])
def test_tenant_isolation_both_directions(algo):
    llm = _llm(cache_isolation="tenant", hash_algo=algo)
    log = HitLog(llm.engine)
    victim = llm.generate(SECRET + "Q1", P, tenant="victim")[0]
    again = llm.generate(SECRET + "Q2", P, tenant="victim")[0]
    probe = llm.generate(SECRET + "Q3", P, tenant="attacker")[0]
    anon = llm.generate(SECRET + "Q4", P, tenant=None)[0]
    assert victim.num_cached_tokens == 0
    assert again.num_cached_tokens > 0, "same tenant must hit its own cache"
    assert probe.num_cached_tokens == 0 and anon.num_cached_tokens == 0, "another tenant hit the victim's cache"
    assert log.same and not log.cross


def test_shared_mode_leaks_and_request_mode_never_reuses():
    shared = _llm(cache_isolation="shared")
    log = HitLog(shared.engine)
    shared.generate(SECRET + "Q1", P, tenant="victim")
    assert shared.generate(SECRET + "Q3", P, tenant="attacker")[0].num_cached_tokens > 0
    assert log.cross, "the leak the lessons demonstrate must be real"
    per_request = _llm(cache_isolation="request")
    per_request.generate(SECRET + "Q1", P, tenant="victim")
    assert per_request.generate(SECRET + "Q1", P, tenant="victim")[0].num_cached_tokens == 0


def test_shared_prefix_is_public_and_suffix_stays_private():
    system = "You are a helpful assistant for ACME support. Be concise. "
    llm = _llm(shared_prefixes=[system])
    log = HitLog(llm.engine)
    a1 = llm.generate(system + SECRET, P, tenant="alice")[0]
    b1 = llm.generate(system + SECRET, P, tenant="bob")[0]
    a2 = llm.generate(system + SECRET, P, tenant="alice")[0]
    n_public = len(llm.get_tokenizer()(system).input_ids) // BS * BS
    assert a1.num_cached_tokens == 0
    assert b1.num_cached_tokens == n_public, "bob should hit exactly the public system-prompt blocks"
    assert a2.num_cached_tokens > n_public, "alice should also hit her own private suffix"
    assert not log.cross and any(h[2] for h in log.hits)


def test_client_cannot_choose_another_tenants_key():
    """Tenant keys come from the engine secret, never from request content: two engines with
    different secrets give the same tenant different keys, and a tenant's name alone is useless."""
    a, b = _llm(), _llm()
    assert a.engine.tenant_key("victim") != b.engine.tenant_key("victim")
    assert a.engine.tenant_key("victim") != a.engine.tenant_key("attacker")
    assert "engine_secret" not in repr(a.engine.config) and a.engine._secret.hex() not in repr(a.engine.config)


@pytest.mark.parametrize("scrub,expect_clean", [("on_alloc", True), ("on_free", True), ("none", False)])
def test_scrubbing_no_stale_data_reaches_a_new_request(scrub, expect_clean):
    llm = _quiet_llm("tiny-random", block_size=BS, num_blocks=64, scrub=scrub)
    eng = llm.engine
    dirty = []

    def check(event, ids, seq):  # runs after the engine's own hook (listeners run in order)
        if event == "allocate":
            idx = torch.tensor(ids)
            if eng.pool.k_cache[:, idx].abs().sum() + eng.pool.v_cache[:, idx].abs().sum() > 0:
                dirty.append((seq.request_id, ids))

    eng.block_manager.listeners.append(check)
    for i in range(6):  # each request reuses the blocks the previous one freed
        llm.generate(SECRET + f"tenant {i}", SamplingParams(max_tokens=6, temperature=0.0), tenant=f"t{i}")
    assert (not dirty) == expect_clean, dirty[:3]


def _quiet_llm(model, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        return LLM(model, device="cpu", dtype="float32", **kw)


@pytest.mark.model
@pytest.mark.parametrize("algo", ["builtin", "trunc32", "poly"])
def test_crafted_collision_poisons_only_without_verification(algo, smollm2_path):
    """The committed pair collides under ``algo``: without verification the victim reuses the
    attacker's block; any verification (even tokens-only) rejects a different-token block."""
    a, b = load_committed_pairs()[algo]
    tail = [7, 8, 9, 10]  # so the colliding block is not the last (capped) one
    for verify, poisoned in ((False, True), ("tokens", False), (True, False)):
        llm = _quiet_llm("smollm2-135m-instruct", block_size=16, enable_prefix_caching=True,
                         cache_isolation="shared", hash_algo=algo, verify_hits=verify, num_blocks=32)
        llm.generate([list(a) + tail], P, tenant="attacker")
        hit = llm.generate([list(b) + tail], P, tenant="victim")[0].num_cached_tokens
        assert (hit == 16) == poisoned, (algo, verify, hit)
        assert llm.engine.block_manager.num_rejected_hits == (0 if verify is False else 1)


@pytest.mark.parametrize("algo", ["sha256", "hmac-sha256", "blake2b-keyed"])
def test_secure_hashes_do_not_collide_on_the_crafted_pairs(algo):
    from minikv.security.hashing import make_hasher
    h = make_hasher(algo, b"k" * 32)
    for a, b in load_committed_pairs().values():
        assert h(None, tuple(a), (), None) != h(None, tuple(b), (), None)


def test_unchained_keys_contaminate_unless_parent_is_verified():
    """A block of tokens that A computed *after* another block, reused by B at the start of
    its prompt: content-only keys map both to one entry (and the K/V were even rotated for
    other positions).  Only a parent-aware check (verify_hits=True) refuses the wrong context."""
    first, middle, end = [11] * BS, [40, 41, 42, 43], [50, 51]
    for verify, contaminated in ((False, True), ("tokens", True), (True, False)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnsafeSettingWarning)
            llm = _llm(cache_isolation="shared", chain_hashes=False, verify_hits=verify)
        llm.generate([first + middle + end], P)
        log = HitLog(llm.engine)
        out = llm.generate([middle + end], P)[0]
        assert (out.num_cached_tokens > 0) == contaminated, (verify, out.num_cached_tokens)
        assert len(log.hits) == (1 if contaminated else 0)


def test_quota_keeps_a_noisy_tenant_from_evicting_a_neighbour():
    """Prime-and-probe: the attacker floods the pool; with a per-tenant quota (the default one,
    num_blocks // 8, or an explicit one) the victim's cached blocks survive; with the quota
    turned off ("unlimited") they are evicted."""
    victim_prompt = SECRET * 2
    results = {}
    for quota in ("unlimited", None, 8):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnsafeSettingWarning)
            llm = LLM("tiny-random", device="cpu", block_size=BS, num_blocks=150, enable_prefix_caching=True,
                      max_cached_blocks_per_tenant=quota)
        llm.generate(victim_prompt, P, tenant="victim")
        for i in range(6):
            llm.generate(f"flood {i} " + "x" * 300, P, tenant="attacker")
        results[quota] = llm.generate(victim_prompt, P, tenant="victim")[0].num_cached_tokens
        llm.engine.check_invariants()
    assert results["unlimited"] == 0, "without a quota the flood should evict the victim's cache"
    assert results[None] == (150 // 8) * BS, "the default quota keeps num_blocks // 8 of the victim's blocks"
    assert results[8] == 8 * BS, "with a quota the victim's cache should survive"


@pytest.mark.model
def test_shared_prefix_survives_a_bpe_merge_at_its_boundary(smollm2_path):
    """The public text ends in a space, which BPE merges into the user's first word: the
    prompt's tokens then match the public prefix's tokens except the last one.  Blocks made
    only of matching tokens are still public; nothing after them is."""
    system = "You are the support assistant of ACME Corp. Answer politely and cite the policy. " * 3
    llm = _quiet_llm("smollm2-135m-instruct", enable_prefix_caching=True, shared_prefixes=[system])
    tok = llm.get_tokenizer()
    public, prompt = tok(system).input_ids, tok(system + "order refund?").input_ids
    assert prompt[:len(public)] != public, "the example must actually merge at the boundary"
    llm.generate(system + "order refund?", P, tenant="alice")
    out = llm.generate(system + "order refund?", P, tenant="bob")[0]
    common = next(i for i, (a, b) in enumerate(zip(prompt, public)) if a != b)
    assert out.num_cached_tokens == common // 16 * 16 > 0
