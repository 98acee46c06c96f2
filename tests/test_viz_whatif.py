"""The what-if widget and the oracle game (lesson 03) on tiny-random: the counts they show are the
engine's, and isolation works in both directions (same tenant still hits, other tenants do not)."""
from __future__ import annotations

import warnings

import pytest

from minikv.engine.config import UnsafeSettingWarning
from minikv.viz.oracle_game import SECRET, OracleGame, play_guess
from minikv.viz.whatif import Scenario, WhatIf, run_whatif


def shown_text(html_widget) -> str:
    """The text an HTML widget shows, its lines joined by " | " (as ``summary()`` joins them)."""
    import html
    import re
    return " | ".join(html.unescape(t) for t in re.findall(r"<div[^>]*>(.*?)</div>", html_widget.value))


@pytest.fixture(scope="module")
def llm(tiny_path):
    from minikv import LLM
    return LLM(str(tiny_path), num_blocks=64, enable_prefix_caching=True)


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        yield


def test_shared_has_cross_tenant_hits_tenant_has_none(llm):
    shared = run_whatif(llm, Scenario(cache_isolation="shared"))
    tenant = run_whatif(llm, Scenario(cache_isolation="tenant"))
    assert shared.cross_tenant_hits > 0 and shared.same_tenant_hits > 0
    assert tenant.cross_tenant_hits == 0
    assert tenant.same_tenant_hits > 0                       # alice's and bob's retries still hit
    assert tenant.hit_rate("carol") == 0 < shared.hit_rate("carol")   # carol only ever asks once
    assert "cross-tenant hits=0 " in tenant.summary() and "isolation=tenant" in tenant.summary()


def test_widget_switches_isolation_both_ways(llm):
    wi = WhatIf(llm, Scenario(cache_isolation="shared"))
    assert wi.result.cross_tenant_hits > 0 and shown_text(wi.summary) == wi.result.summary()
    first_png = wi.image.value
    wi.isolation.value = "tenant"                              # what the dropdown does
    assert wi.result.scenario.cache_isolation == "tenant"
    assert wi.result.cross_tenant_hits == 0 and wi.result.same_tenant_hits > 0
    assert shown_text(wi.summary) == wi.result.summary() and wi.image.value != first_png
    wi.isolation.value = "shared"                              # and back again
    assert wi.result.cross_tenant_hits > 0


def test_public_prefix_and_request_isolation(llm):
    public = run_whatif(llm, Scenario(cache_isolation="tenant", public_system=True))
    assert public.public_hits > 0 and public.cross_tenant_hits == 0
    assert public.hit_rate("carol") > 0                        # the public system prompt only
    none = run_whatif(llm, Scenario(cache_isolation="request"))
    assert none.same_tenant_hits == none.cross_tenant_hits == none.public_hits == 0


def test_other_controls_change_the_run(llm):
    base = run_whatif(llm, Scenario(cache_isolation="tenant"))
    tight = run_whatif(llm, Scenario(cache_isolation="tenant", max_cached_blocks_per_tenant=2))
    assert tight.same_tenant_hits < base.same_tenant_hits     # a quota of 2 blocks keeps less
    big = run_whatif(llm, Scenario(block_size=32))
    assert big.snapshot.block_size == 32 and "block_size=32" in big.summary()
    assert run_whatif(llm, Scenario(cache_isolation="selective")).cross_tenant_hits == 0



def test_every_quota_choice_reaches_the_engine(llm):
    wi = WhatIf(llm, Scenario(cache_isolation="tenant"))
    rates = {}
    for q in ("default", 2, "unlimited"):                      # "default" is None in EngineConfig
        wi.quota.value = q
        assert wi.quota.value == q and wi.result.scenario.max_cached_blocks_per_tenant == q
        assert f"quota={q} " in shown_text(wi.summary)
        rates[q] = wi.result.same_tenant_hits
    assert rates[2] < rates["default"] < rates["unlimited"]    # 64-block pool: default quota is 8


def test_bad_isolation_is_refused(llm):
    with pytest.raises(ValueError, match="'open'"):
        run_whatif(llm, Scenario(cache_isolation="open"))


def test_oracle_game_correct_partial_and_wrong_guess(llm):
    right = play_guess(llm, SECRET)
    assert right.shared_cached > 0 and right.isolated_cached == 0
    assert right.shared_cached == (right.prompt_tokens - 1) // 8 * 8   # every full block; the last token is computed
    half = play_guess(llm, SECRET[:32] + "0000-0000 today.")         # right start, wrong end: a partial hit
    assert 0 < half.shared_cached < right.shared_cached and half.isolated_cached == 0
    wrong = play_guess(llm, "Hello, what is the weather like?")
    assert wrong.shared_cached == wrong.isolated_cached == 0
    assert "cached_tokens shared=0 isolated=0" in wrong.summary()
    with pytest.raises(ValueError, match="guess"):
        play_guess(llm, "")


def test_oracle_game_times_every_repeat(llm):
    res = play_guess(llm, SECRET, repeats=3)
    assert len(res.shared_ttft_s) == len(res.isolated_ttft_s) == 3
    assert all(t > 0 for t in res.shared_ttft_s + res.isolated_ttft_s)
    assert "over 3 repeats" in res.timing() and "quartiles" in res.timing() and res.ttft_ratio() > 0
    with pytest.raises(ValueError, match="repeats"):
        play_guess(llm, SECRET, repeats=0)


def test_oracle_widget_plays_on_enter(llm):
    game = OracleGame(llm)
    assert game.image.layout.display == "none"                  # no picture yet: no broken-image icon
    game.guess.value = SECRET                                   # what typing + Enter does
    assert game.result.guess == SECRET and shown_text(game.summary) == game.result.summary()
    assert "isolated=0" in game.summary.value and game.image.value
    assert game.image.layout.display != "none" and shown_text(game.timing) == game.result.timing()


def test_summaries_wrap():
    from minikv.viz.whatif import lines_html
    out = lines_html("a <b> & c", "d")
    assert out.count("<div") == 2 and "white-space: normal" in out and "&lt;b&gt; &amp; c" in out
