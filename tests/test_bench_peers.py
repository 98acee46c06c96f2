"""``make bench-peers``'s round logic (scripts/bench_peers.py), on a stand-in engine.

The real run needs vLLM (minutes to start); what can go wrong in the script itself is the order of
a round: a throughput run that is served from the cache, a "hit" that misses, or a "miss" whose
system prompt an earlier round already cached would all produce plausible, wrong numbers.  The
stand-in records every call and answers like a prefix cache of whole prompts' prefixes.
"""
from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest

from minikv.bench.base import random_prompts

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "bench_peers.py"


@pytest.fixture(scope="module")
def bench_peers():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class CacheStandIn:
    """Remembers the 64-token prefixes it has seen since the last reset; logs each call."""

    def __init__(self):
        self.seen, self.calls = set(), []

    def reset(self):
        self.seen.clear()
        self.calls.append(("reset",))

    def generate(self, prompts, max_tokens):
        for p in prompts:
            key = tuple(p[:64])
            self.calls.append(("hit" if key in self.seen else "miss", len(p), max_tokens))
            self.seen.add(key)
        return len(prompts) * max_tokens


def _work(rounds):
    return {"prompts": random_prompts(49152, 4, 32, 128, 5), "max_tokens": 8,
            "system": random_prompts(49152, 1, 1000, 1000, 0)[0],
            "questions": random_prompts(49152, 2 * rounds + 2, 20, 20, 1)}


def test_a_round_measures_a_cold_throughput_run_then_one_hit_and_one_fresh_miss(bench_peers):
    rounds, eng = 3, CacheStandIn()
    work = _work(rounds)
    side = bench_peers.Side(eng.generate, eng.reset, work)
    results = []
    for r in range(rounds):
        eng.calls.clear()
        results.append(side.round(r))
        kinds = [c[0] for c in eng.calls]
        # reset, the 4 throughput prompts (all prefilled: the reset emptied the cache), the priming
        # request, then the timed hit and the timed miss
        assert kinds[0] == "reset" and kinds[1:5] == ["miss"] * 4, eng.calls
        assert [c[2] for c in eng.calls[1:5]] == [8] * 4  # the throughput run generates max_tokens
        assert kinds[5:] == ["miss", "hit", "miss"], eng.calls  # prime, hit, a never-seen system prompt
        assert all(c[2] == 1 for c in eng.calls[5:])  # TTFT requests generate one token
    assert all(set(r) == {"throughput_s", "hit_s", "miss_s"} and min(r.values()) > 0 for r in results)


def test_every_round_asks_distinct_questions_and_distinct_misses(bench_peers):
    rounds = 4
    work = _work(rounds)
    asked = []

    def generate(prompts, max_tokens):
        asked.extend(tuple(p) for p in prompts if max_tokens == 1)
        return len(prompts) * max_tokens

    side = bench_peers.Side(generate, lambda: None, work)
    for r in range(rounds):
        side.round(r)
    timed = [p for i, p in enumerate(asked) if i % 3]  # each round: prime, hit, miss
    assert len(timed) == 2 * rounds and len(set(timed)) == 2 * rounds
    vocab_edge = min(1000, 49152 // 4)
    assert all(vocab_edge - 8 <= t < 49152 - vocab_edge + 8 for p in timed for t in p)  # flipped ids stay in the vocabulary


def test_summary_is_the_median_of_rounds_with_absolutes(bench_peers):
    work = _work(1)
    rounds = [{"throughput_s": 4.0, "hit_s": 0.1, "miss_s": 2.0}, {"throughput_s": 2.0, "hit_s": 0.3, "miss_s": 1.0},
              {"throughput_s": 3.0, "hit_s": 0.2, "miss_s": 4.0}]
    s = bench_peers.summarize(rounds, work)
    total = len(work["prompts"]) * work["max_tokens"]
    assert math.isclose(s["tokens_per_s"], total / 3.0)
    assert math.isclose(s["ttft_hit_ms"], 200.0) and math.isclose(s["ttft_miss_ms"], 2000.0)
    assert math.isclose(s["ttft_hit_over_miss"], 0.1)
    assert [round(x, 6) for x in s["rounds_tokens_per_s"]] == [round(total / t, 6) for t in (4.0, 2.0, 3.0)]


def test_rounds_below_one_are_refused(bench_peers, capsys):
    with pytest.raises(SystemExit) as e:
        bench_peers.main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds must be at least 1, got 0" in capsys.readouterr().err
