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
