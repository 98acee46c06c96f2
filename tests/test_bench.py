"""The benchmark runs end to end (its figures are reported, never asserted as speeds here)."""
from __future__ import annotations

import json

from minikv import LLM
from minikv.bench import format_report, hit_rate_vs_tenants, main


def test_bench_runs_and_reports_every_ratio(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert main(["--model", "tiny-random", "--device", "cpu", "--only", "throughput,ttft", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["throughput"]["throughput_ratio"] > 0 and report["ttft"]["ttft_hit_over_miss"] > 0
    assert "throughput_ratio" in capsys.readouterr().out


def test_hit_rate_table_orders_the_policies():
    """Bookkeeping, not timing: tenant isolation can only lose hits, shared prefixes win some back."""
    rates = hit_rate_vs_tenants(LLM("tiny-random", device="cpu"), tenants=(1, 4))
    shared, tenant, both = (rates[k] for k in ("shared (unsafe)", "tenant", "tenant + shared_prefixes"))
    assert shared[1] == tenant[1] == both[1] > 0
    assert shared[4] > tenant[4] and both[4] > tenant[4]
    text = format_report({"model": "m", "device": "cpu", "dtype": "float32", "threads": 1,
                          "isolation": {"hash_over_prefill": 0.001, "hit_rate": rates}})
    assert "N=4" in text and "hash_over_prefill" in text


def test_fairness_runs_and_counts_the_attackers_rejections():
    """One attacker connection against a short victim stream, on tiny-random: every row has finite,
    positive gaps, and every attacker request was refused (4xx).  Speed is reported, not asserted."""
    import math

    from minikv.bench_fairness import bench_fairness, format_fairness

    res = bench_fairness(LLM("tiny-random", device="cpu"), attackers=(1,), victim_tokens=12)
    rows = res["rows"]
    assert {(r["limits"], r["attack"], r["conns"]) for r in rows} == {
        (limits, attack, conns) for limits in ("default limits", "rate limit off")
        for attack, conns in (("none", 0), ("oversize", 1), ("overlong", 1))}
    for r in rows:
        for key in ("median_ms", "p99_ms", "median_ratio", "p99_ratio"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        if r["conns"]:
            statuses = r["attacker_statuses"]
            assert r["attacker_requests"] == sum(statuses.values()) > 0
            assert all(s.isdigit() and 400 <= int(s) < 500 for s in statuses), statuses
    text = "\n".join(format_fairness(res))
    assert "overlong" in text and "CPU cores" in text


def test_trail_section_reports_bytes_per_request_at_each_level(capsys):
    from minikv.engine.config import AUDIT_LEVELS

    assert main(["--model", "tiny-random", "--device", "cpu", "--only", "trail"]) == 0
    out = capsys.readouterr().out
    assert all(f"audit_level={level}" in out for level in AUDIT_LEVELS)
