"""The availability bench's figures, and ``minikv serve``'s step budget.

The bench runs on tiny-random for a few seconds: what is checked is its arithmetic and its
report (ratios against the same-path baseline of the same run, the verdict against the targets,
the attacker's answers counted), never a speed.
"""
from __future__ import annotations

import json

from minikv import LLM
from minikv.bench.availability import TARGET, bench_availability, format_availability
from minikv.cli import build_parser
from minikv.serve.cli import SERVE_STEP_BUDGET, app_from_args, serve_step_budget


def test_the_bench_reports_each_mode_against_its_own_paths_baseline():
    llm = LLM("tiny-random", device="cpu", max_num_batched_tokens=64)
    res = bench_availability(llm, modes=("hangups", "gateway"), seconds=1.0, min_requests=3, scale=0.125)
    rows = {(r["mode"], r["path"]): r for r in res["rows"]}
    assert set(rows) == {("none", "direct"), ("none", "gateway"), ("hangups", "direct"), ("gateway", "gateway")}
    for (mode, path), r in rows.items():
        base = rows["none", path]
        assert r["requests"] >= 3
        assert abs(r["p50_ratio"] - r["p50_ms"] / base["p50_ms"]) < 1e-9
        assert abs(r["p99_ratio"] - r["p99_ms"] / base["p99_ms"]) < 1e-9
        assert r["met"] == (r["p50_ratio"] <= TARGET["p50"] and r["p99_ratio"] <= TARGET["p99"])
        if mode != "none":
            assert sum(r["attacker_statuses"].values()) > 0 and r["conns"] >= 1
    assert rows["hangups", "direct"]["conns"] == 4  # 32 connections at scale 1/8
    assert res["budget"] == 64 and not llm.engine.has_unfinished_requests()
    text = "\n".join(format_availability(res))
    assert "hangups" in text and "gateway" in text and f"p99 <= {TARGET['p99']}x" in text


def test_serve_runs_with_its_own_step_budget_unless_given_one(tmp_path, tiny_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-a": "a"}))
    base = ["serve", "--model", str(tiny_path), "--api-keys", str(keys), "--num-blocks", "64", "--device", "cpu"]
    app, _ = app_from_args(build_parser().parse_args(base))
    alone, contended = serve_step_budget(None)
    assert (app.state.engine.config.max_num_batched_tokens, app.state.engine.scheduler.contended_budget) == \
        (alone, contended)
    assert serve_step_budget("cpu") == SERVE_STEP_BUDGET["cpu"] and contended < alone < 4096  # below the engine's
    app, _ = app_from_args(build_parser().parse_args(base + ["--contended-num-batched-tokens", "48"]))
    assert app.state.engine.scheduler.contended_budget == 48
    app, _ = app_from_args(build_parser().parse_args(base + ["--max-num-batched-tokens", "1000"]))
    assert app.state.engine.config.max_num_batched_tokens == 1000
    assert app.state.engine.scheduler.max_num_batched_tokens == 1000
