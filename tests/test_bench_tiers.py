"""``python -m minikv.bench --only tiers`` (minikv/bench/tiers.py) on tiny-random with tiny sizes:
every figure is printed, hit rates are rates, and every ratio is the quotient of the absolutes
printed beside it.  Without Redis only the Redis rows are skipped, naming ``make redis``."""
from __future__ import annotations

import math
import re

import pytest

from minikv import LLM
from minikv.bench import SECTIONS, format_report
from minikv.bench.tiers import TARGETS, bench_tiers, format_tiers

SMALL = dict(prefix_tokens=64, repeats=2, workload_tokens=32)


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-random", device="cpu", dtype="float32")


def _with_half_ulp(printed: str) -> tuple[float, float]:
    """A printed decimal and half a unit in its last place: the most its rounding can have moved it."""
    decimals = len(printed.split(".")[1]) if "." in printed else 0
    return float(printed), 0.5 * 10.0 ** -decimals


def _check(report: dict, text: str, redis: bool) -> None:
    w, t = report["workload"], report["ttft"]
    for k in ("pool_hit_rate", "tier_hit_rate", "recompute"):
        assert 0.0 <= w[k] <= 1.0, (k, w[k])
    assert math.isclose(w["pool_hit_rate"] + w["tier_hit_rate"] + w["recompute"], 1.0)
    assert math.isclose(sum(w["tier_hit_rate_by_tier"].values()), w["tier_hit_rate"])
    assert set(w["tier_hit_rate_by_tier"]) == ({"host", "redis"} if redis else {"host"})
    assert w["pool_blocks"] < w["distinct_prefix_blocks"]  # the prefixes exceed the pool
    assert w["pool_hit_rate"] > 0 and w["tier_hit_rate_by_tier"]["host"] > 0 and w["recompute"] > 0
    assert w["first_request_hit_tokens"] == 0  # tenant-keyed: nobody hits another tenant's prefix
    assert f"pool hit rate {w['pool_hit_rate']:6.1%}" in text and f"recompute {w['recompute']:6.1%}" in text
    assert f"tier hit rate {w['tier_hit_rate']:6.1%}" in text
    kinds = ("pool_hit", "host_hit", "miss") + (("redis_hit",) if redis else ())
    for k in kinds:
        assert t[f"{k}_ms"] > 0 and f"{t[f'{k}_ms']:9.1f} ms" in text, k
        if k != "miss":
            assert math.isclose(t[f"{k}_over_miss"], t[f"{k}_ms"] / t["miss_ms"])
            assert f"/ miss {t[f'{k}_over_miss']:.3f}" in text
    for k in ("seal_per_block_s", "mac_only_per_block_s", "open_per_block_micro_s"):
        assert t[k] > 0
    assert f"seal (AES-256-GCM) {1e6 * t['seal_per_block_s']:.1f} us" in text
    assert f"cleartext HMAC alone {1e6 * t['mac_only_per_block_s']:.1f} us" in text
    if redis:
        assert report["redis_skipped"] is None and "skipped" not in text
        assert t["stored_per_miss"] >= t["blocks_per_prefix"] and t["seal_per_miss_s"] > 0  # stored on full
        assert math.isclose(t["seal_over_redis_hit"], 1000 * t["open_per_redis_hit_s"] / t["redis_hit_ms"])
        for key, label in (("redis_hit_over_miss", "redis hit / miss"), ("seal_over_redis_hit", "open / redis hit")):
            verdict = "PASS" if t[key] <= TARGETS[key] else "FAIL"
            line = next(x for x in text.splitlines() if label in x)
            assert f"{label} {t[key]:.3f}" in line and f"target <= {TARGETS[key]:g}   {verdict}" in line
            # The printed absolutes must be the ratio's own: their quotient, widened by exactly the
            # rounding of each printed figure (half a unit in its last digit), contains the ratio.
            num_s, den_s = re.search(r"\(([\d.]+) / ([\d.]+) ms\)", line).groups()
            (num, hn), (den, hd) = _with_half_ulp(num_s), _with_half_ulp(den_s)
            assert den > hd, f"{label}: the printed denominator {den_s} ms rounds to nothing"
            assert (num - hn) / (den + hd) <= t[key] <= (num + hn) / (den - hd), (label, t[key], num_s, den_s)
    else:
        assert "make redis" in report["redis_skipped"] and "make redis" in text
        assert "redis_hit_ms" not in t and re.search(r"redis hit\s+skipped \(no Redis: `make redis`\)", text)
        assert "redis hit / miss" not in text and "open / redis hit" not in text
        assert t["stored_per_miss"] == 0  # only the Redis tier is written on store


def test_tiers_section_without_redis_skips_only_the_redis_rows(llm):
    report = bench_tiers(llm, redis_url="redis://127.0.0.1:1/0", **SMALL)  # port 1: nothing listens
    text = "\n".join(format_tiers(report))
    _check(report, text, redis=False)


@pytest.mark.redis
def test_tiers_section_with_redis(llm, redis_base):
    report = bench_tiers(llm, redis_url=f"{redis_base}/4", **SMALL)
    text = "\n".join(format_tiers(report))
    _check(report, text, redis=True)
    assert report["workload"]["tier_hit_rate_by_tier"]["redis"] > 0  # the other instance hit Redis


def test_tiers_is_a_bench_section():
    assert "tiers" in SECTIONS
    report = {"model": "m", "device": "cpu", "dtype": "float32", "threads": 1,
              "tiers": {"model": "m", "dtype": "float32", "block_size": 16, "tiers": ["host"], "redis_skipped": "x",
                        "workload": dict(requests=1, tenants=1, prompt_tokens=1, pool_blocks=1, distinct_prefix_blocks=2,
                                         pool_hit_rate=0.0, tier_hit_rate=0.0, tier_hit_rate_by_tier={"host": 0.0},
                                         recompute=1.0, first_request_hit_tokens=0),
                        "ttft": dict(prefix_tokens=1000, repeats=1, blocks_per_prefix=62, miss_ms=2.0, pool_hit_ms=1.0,
                                     host_hit_ms=1.0, pool_hit_over_miss=0.5, host_hit_over_miss=0.5, host_blocks_per_hit=60,
                                     block_bytes=8, seal_per_block_s=1e-6, mac_only_per_block_s=1e-6,
                                     open_per_block_micro_s=1e-6, seal_per_miss_s=0.0, stored_per_miss=0)}}
    assert "KV tiers (m, float32, block 16" in format_report(report)
