"""Smaller pieces of the public API: fork, reset_prefix_cache, snapshot, chat, CLI generate."""
from __future__ import annotations

import subprocess
import sys

import pytest

from minikv import LLM, SamplingParams

P = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
TEXT = "a prompt long enough to fill several blocks of the pool " * 2


def test_fork_shares_weights_not_cache():
    base = LLM("tiny-random", device="cpu", block_size=4, enable_prefix_caching=True)
    child = base.fork(num_blocks=64, cache_isolation="request")
    assert child.engine.model is base.engine.model
    assert child.engine.pool.k_cache.data_ptr() != base.engine.pool.k_cache.data_ptr()
    assert child.engine.num_blocks == 64 and child.engine.config.cache_isolation == "request"
    base.generate(TEXT, P)
    assert child.generate(TEXT, P)[0].outputs[0].token_ids == base.generate(TEXT, P)[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="'dtype'"):
        base.fork(dtype="bfloat16")


def test_reset_prefix_cache_all_or_one_tenant():
    llm = LLM("tiny-random", device="cpu", block_size=4, enable_prefix_caching=True)
    llm.generate(TEXT, P, tenant="a")
    llm.generate(TEXT, P, tenant="b")
    n_b = sum(1 for b in llm.engine.block_manager.cached
              if llm.engine.block_manager.blocks[b].writer_tenant == "b")
    assert llm.engine.reset_prefix_cache("b") == n_b > 0
    assert llm.generate(TEXT, P, tenant="b")[0].num_cached_tokens == 0
    assert llm.generate(TEXT, P, tenant="a")[0].num_cached_tokens > 0
    assert llm.engine.reset_prefix_cache() > 0
    assert not llm.engine.block_manager.hash_table
    llm.engine.check_invariants()


def test_snapshot_tracks_writers_holders_and_summary():
    llm = LLM("tiny-random", device="cpu", block_size=4, num_blocks=32, enable_prefix_caching=True)
    eng = llm.engine
    eng.add_request("x", TEXT[:40], P, tenant="alice")
    eng.add_request("y", TEXT[:40], P, tenant="alice")
    eng.step()
    snap = eng.snapshot()
    used = [b for b in snap.blocks if b.state == "used"]
    assert used and all(b.tenant == "alice" for b in used)
    assert snap.summary().startswith(f"step {snap.step}: used[alice={len(used)}]")
    assert set(snap.running) == {"x", "y"}
    while eng.has_unfinished_requests():
        eng.step()
    after = eng.snapshot()
    assert after.num_cached > 0 and after.num_free + after.num_cached == 32


def test_cli_generate_prints_a_completion():
    out = subprocess.run([sys.executable, "-m", "minikv", "generate", "--model", "tiny-random",
                          "--max-tokens", "5", "hello"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    ref = LLM("tiny-random", device="cpu").generate("hello", SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert ref.outputs[0].text in out.stdout
