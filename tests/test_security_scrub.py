"""Tests for minikv.security.scrub on a tiny fake pool."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.overrides import TorchFunctionMode

from minikv.engine.kv_pool import KVPool
from minikv.grading.scrubbing import BLOCKS, FakePool  # the tensors of a pool, nonzero random numbers
from minikv.security.scrub import (SCRUBBERS, UNSAFE_SCRUBBERS, NoScrub, Scrubber, ScrubOnAlloc, ScrubOnFree,
                                   make_scrubber, zero_blocks)

def _assert_scrubbed_exactly(pool, before_k, before_v, ids):
    ids = set(ids)
    for b in range(BLOCKS):
        for cache, before in ((pool.k_cache, before_k), (pool.v_cache, before_v)):
            if b in ids:
                assert torch.count_nonzero(cache[:, b]) == 0, f"block {b} not zeroed in every layer"
            else:
                assert torch.equal(cache[:, b], before[:, b]), f"block {b} was touched"


HOOK_CASES = [(ScrubOnAlloc, "on_alloc"), (ScrubOnFree, "on_free")]


@pytest.mark.parametrize("cls, hook", HOOK_CASES)
def test_scrub_hook_zeroes_exactly_the_given_blocks(cls, hook):
    pool = FakePool()
    k, v = pool.k_cache.clone(), pool.v_cache.clone()
    getattr(cls(), hook)(pool, [1, 5, 6])
    _assert_scrubbed_exactly(pool, k, v, [1, 5, 6])


@pytest.mark.parametrize("cls, hook", HOOK_CASES)
def test_the_other_hook_leaves_data_alone(cls, hook):
    other = "on_free" if hook == "on_alloc" else "on_alloc"
    pool = FakePool()
    k, v = pool.k_cache.clone(), pool.v_cache.clone()
    getattr(cls(), other)(pool, [0, 2, 7])
    assert torch.equal(pool.k_cache, k) and torch.equal(pool.v_cache, v)


def test_no_scrub_leaves_the_previous_owners_data():
    pool = FakePool()
    k, v = pool.k_cache.clone(), pool.v_cache.clone()
    scrubber = NoScrub()
    scrubber.on_free(pool, [0, 1])
    scrubber.on_alloc(pool, [0, 1])
    assert torch.equal(pool.k_cache, k) and torch.equal(pool.v_cache, v)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, BLOCKS - 1), max_size=12), st.sampled_from(HOOK_CASES))
def test_any_block_set_including_duplicates_and_empty(ids, case):
    cls, hook = case
    pool = FakePool()
    k, v = pool.k_cache.clone(), pool.v_cache.clone()
    getattr(cls(), hook)(pool, ids)
    _assert_scrubbed_exactly(pool, k, v, ids)


def test_hooks_attribute_says_which_hooks_zero_memory():
    # the engine/audit can use `hooks` to log only scrubs that really happened
    for name, cls in SCRUBBERS.items():
        for hook in ("on_free", "on_alloc"):
            pool = FakePool()
            getattr(cls(), hook)(pool, [3])
            zeroed = torch.count_nonzero(pool.k_cache[:, 3]) == 0
            assert zeroed == (hook in cls.hooks), (name, hook)


def test_kv_pool_zero_blocks_is_the_one_scrub():
    pool = KVPool(3, 6, 4, 2, 5, torch.float32, "cpu")
    pool.k_cache.fill_(1.0)
    pool.v_cache.fill_(1.0)
    pool.zero_blocks((4, 2))
    for cache in (pool.k_cache, pool.v_cache):
        assert [int(torch.count_nonzero(cache[:, b])) == 0 for b in range(6)] == [False, False, True, False, True, False]


def test_empty_list_is_a_no_op_on_the_direct_path():
    pool = FakePool()
    k = pool.k_cache.clone()
    zero_blocks(pool, [])
    assert torch.equal(pool.k_cache, k)


class _CountTorchCalls(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def test_one_indexed_operation_per_tensor_not_a_loop_over_blocks():
    counts = []
    for ids in ([2], [0, 1, 3, 4, 5, 7]):
        pool = FakePool()
        with _CountTorchCalls() as mode:
            ScrubOnFree().on_free(pool, ids)
        counts.append(mode.calls)
    assert counts[0] == counts[1]  # the work does not grow with the number of blocks
    assert counts[0].count("index_fill_") == 2


def test_registry_and_protocol():
    assert set(SCRUBBERS) == {"none", "on_free", "on_alloc"}
    assert UNSAFE_SCRUBBERS == frozenset({"none"})
    for name, cls in SCRUBBERS.items():
        scrubber = make_scrubber(name)
        assert type(scrubber) is cls and isinstance(scrubber, Scrubber)
        assert scrubber.name == name and scrubber.unsafe == (name in UNSAFE_SCRUBBERS)


def test_every_registered_scrubber_is_a_setting_and_a_flag():
    """The registry is the one list: the config and the CLI follow it."""
    from minikv.cli import build_parser
    from minikv.engine import config

    assert set(SCRUBBERS) == set(config.SCRUB_POLICIES)
    for name in SCRUBBERS:
        assert build_parser().parse_args(["generate", "--model", "m", "x", "--scrub", name]).scrub == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "x", "--scrub", "sometimes"])


@pytest.mark.parametrize("bad", ["on-free", "ON_ALLOC", "", None, 1])
def test_make_scrubber_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match="on_alloc") as err:
        make_scrubber(bad)
    assert repr(bad) in str(err.value)
