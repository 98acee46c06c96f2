"""The per-tenant cache quota: safe by default, explicit to turn off, honest about its limits.

Prime-and-probe (lesson 10): the attacker fills the pool with its own cached blocks, the victim
sends a request, and the attacker counts how many of its blocks the victim's allocation evicted
-- a meter of the victim's prompt length.  Per-tenant keys cannot stop it (the attacker only
touches its own blocks); a quota on cached blocks per tenant can.
"""
from __future__ import annotations

import random
import warnings

import pytest

from minikv import LLM, EngineConfig, SamplingParams, UnsafeSettingWarning

BS, POOL = 4, 32
ONE = SamplingParams(max_tokens=1, temperature=0.0)


@pytest.fixture(scope="module")
def donor():
    return LLM("tiny-random", device="cpu", num_blocks=8)


def _engine(donor, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        return donor.fork(enable_prefix_caching=True, block_size=BS, num_blocks=POOL, **kw).engine


def _prompt(rng, vocab, blocks):
    return [rng.randrange(3, vocab) for _ in range(blocks * BS + 1)]  # full blocks + 1 token


def _send(engine, rid, prompt, tenant):
    engine.add_request(rid, prompt, ONE, tenant=tenant)
    while engine.has_unfinished_requests():
        engine.step()


def _cached(engine, tenant):
    return sum(1 for b in engine.block_manager.blocks if b.hash is not None and b.writer_tenant == tenant)


def _attacker_blocks_lost(donor, victim_blocks, bystanders=0, **kw):
    """Prime (5 prompts of 7 blocks fill the 32-block pool), optionally let ``bystanders``
    other tenants cache one 7-block prompt each, then the victim sends ``victim_blocks``
    blocks; returns how many cached blocks the attacker lost to the victim's request."""
    engine = _engine(donor, **kw)
    rng, vocab = random.Random(14), engine.model.shape.vocab_size
    for i in range(5):
        _send(engine, f"prime-{i}", _prompt(rng, vocab, 7), "attacker")
    for i in range(bystanders):
        _send(engine, f"bystander-{i}", _prompt(rng, vocab, 7), f"bystander-{i}")
    before = _cached(engine, "attacker")
    if victim_blocks:
        _send(engine, "victim", _prompt(rng, vocab, victim_blocks), "victim")
    engine.check_invariants()
    return before - _cached(engine, "attacker")


def test_prime_and_probe_leaks_nothing_by_default_and_leaks_without_the_quota(donor):
    victims = (0, 8, 12, 20)
    default = [_attacker_blocks_lost(donor, v) for v in victims]
    unlimited = [_attacker_blocks_lost(donor, v, max_cached_blocks_per_tenant="unlimited") for v in victims]
    assert default == [0, 0, 0, 0], default
    assert unlimited[0] == 0 and 0 < unlimited[1] < unlimited[2] < unlimited[3], unlimited  # a volume meter


def test_the_quota_narrows_the_channel_but_many_tenants_at_quota_reopen_it(donor):
    """What the quota cannot do.  Six bystanders at quota (4 blocks each) plus the attacker's 4
    leave 4 of the 32 blocks free.  A victim request that fits in them evicts nothing; a bigger
    one must evict *someone's* cached blocks, the LRU picks the attacker's (primed first), and
    the signal is back.  Accounts are the attacker's to open: 7 accounts at quota do this
    alone, which is why no per-tenant quota defeats an attacker with many accounts."""
    assert _attacker_blocks_lost(donor, 0, bystanders=6) == 0
    assert _attacker_blocks_lost(donor, 2, bystanders=6) == 0  # 3 blocks: fits in the free space
    assert _attacker_blocks_lost(donor, 8, bystanders=6) > 0


def test_an_eviction_names_the_request_that_caused_it(donor):
    engine = _engine(donor, max_cached_blocks_per_tenant="unlimited")
    rng, vocab = random.Random(1), engine.model.shape.vocab_size
    for i in range(5):
        _send(engine, f"prime-{i}", _prompt(rng, vocab, 7), "attacker")
    events = []
    engine.block_manager.listeners.append(
        lambda event, ids, seq: events.extend(
            (seq.tenant if seq else None, engine.block_manager.blocks[b].writer_tenant) for b in ids)
        if event == "evict" else None)
    _send(engine, "victim", _prompt(rng, vocab, 8), "victim")
    assert events and set(events) == {("victim", "attacker")}  # who evicted, whose block
    events.clear()
    engine.reset_prefix_cache()  # the operator's own eviction names no request
    assert events and {who for who, _ in events} == {None}


def test_quota_trims_a_tenants_own_cache_and_names_its_request(donor):
    engine = _engine(donor)  # default quota: 32 // 8 = 4 blocks
    assert engine.block_manager.max_cached_per_tenant == POOL // 8
    evicted = []
    engine.block_manager.listeners.append(
        lambda event, ids, seq: evicted.extend((seq.request_id, engine.block_manager.blocks[b].writer_tenant)
                                               for b in ids) if event == "evict" else None)
    rng = random.Random(2)
    _send(engine, "big", _prompt(rng, engine.model.shape.vocab_size, 7), "alice")
    assert _cached(engine, "alice") == 4
    assert evicted == [("big", "alice")] * 3


def test_quota_settings_default_off_switch_and_shared_mode():
    def cfg(**kw):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            return EngineConfig(model="tiny-random", **kw), [str(x.message) for x in w]
    c, warned = cfg(enable_prefix_caching=True)
    assert (c.cache_quota(64), c.cache_quota(7), c.cache_quota(1000)) == (8, 1, 125) and not warned
    assert cfg(cache_isolation="request")[0].cache_quota(64) == 8
    assert cfg(max_cached_blocks_per_tenant=3)[0].cache_quota(64) == 3
    c, warned = cfg(enable_prefix_caching=True, max_cached_blocks_per_tenant="unlimited")
    assert c.cache_quota(64) is None
    assert "max_cached_blocks_per_tenant='unlimited'" in c.unsafe_settings() and "unlimited" in warned[0]
    c, warned = cfg(enable_prefix_caching=True, cache_isolation="shared")  # unbounded, and flagged as before
    assert c.cache_quota(64) is None and c.unsafe_settings() == ["cache_isolation='shared'"]
