"""The leak the course teaches is there on the path it reads.

Lessons 01-03 build their engines on ``attention_backend="reference"`` (the plain PyTorch code of
``minikv/engine/``), and lesson 03 times a prefix hit against a miss there: a hit is the timing
oracle of lesson 04.  This keeps that true of the reference backend on SmolLM2: a prompt of about a
thousand tokens whose prefix is cached must take well under half the time of the same-length miss,
as medians over interleaved repeats (a relation, side by side in one run, never an absolute time).
The control shows the test can fail: with prefix caching off, the "hit" is one more miss and the
relation does not hold.
"""
from __future__ import annotations

import statistics

import pytest
import torch

from minikv import LLM, SamplingParams

pytestmark = [pytest.mark.model, pytest.mark.slow]

PREFIX, TAIL = 992, 16  # 62 blocks of 16 cached on a hit, then a fresh tail: about 1,000 tokens
REPEATS = 7


def _miss_hit_pairs(llm, repeats: int) -> tuple[list[float], list[float], list[int]]:
    """``repeats`` times: a fresh random prefix with one tail (a miss), then the same prefix with
    another tail (a hit, if the engine caches prefixes).  TTFTs of each kind, and the hits' cached
    token counts."""
    gen = torch.Generator().manual_seed(0)
    vocab = llm.engine.model.shape.vocab_size
    ids = lambda n: torch.randint(100, vocab, (n,), generator=gen).tolist()  # noqa: E731
    one = SamplingParams(max_tokens=1, temperature=0.0)
    miss, hit, cached = [], [], []
    for _ in range(repeats):
        prefix = ids(PREFIX)
        first = llm.generate([prefix + ids(TAIL)], one)[0]
        second = llm.generate([prefix + ids(TAIL)], one)[0]
        assert first.num_cached_tokens == 0
        miss.append(first.metrics.ttft_s)
        hit.append(second.metrics.ttft_s)
        cached.append(second.num_cached_tokens)
    return miss, hit, cached


@pytest.fixture(scope="module")
def reference(smollm2_path):
    return LLM(str(smollm2_path), attention_backend="reference", num_blocks=160, block_size=16,
               enable_prefix_caching=True, max_cached_blocks_per_tenant="unlimited")


@pytest.mark.filterwarnings("ignore::minikv.UnsafeSettingWarning")
def test_reference_backend_prefix_hit_costs_under_half_a_miss(reference):
    assert reference.engine.attention_backend == "reference"
    miss, hit, cached = _miss_hit_pairs(reference, REPEATS)
    assert cached == [PREFIX] * REPEATS  # every full block of the shared prefix came from the cache
    ratio = statistics.median(hit) / statistics.median(miss)
    assert ratio < 0.5, (f"reference backend: median hit {1e3 * statistics.median(hit):.0f} ms is "
                         f"{ratio:.2f} of the median miss {1e3 * statistics.median(miss):.0f} ms")


@pytest.mark.filterwarnings("ignore::minikv.UnsafeSettingWarning")
def test_control_without_prefix_caching_the_gap_is_gone(reference):
    no_cache = reference.fork(enable_prefix_caching=False)
    miss, again, cached = _miss_hit_pairs(no_cache, 2)  # two misses per pair: their ratio is near 1
    assert cached == [0] * 2
    assert statistics.median(again) / statistics.median(miss) > 0.5
