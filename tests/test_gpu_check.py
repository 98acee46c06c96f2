"""``make gpu-check`` (scripts/gpu_check.py) runs only where a GPU is lent, a few minutes at a time,
so its own code must be known to work before then: these tests run it here, on the CPU.

Without CUDA it must refuse (exit status 2: a GPU check that checked nothing has not passed).
With ``--dry-run-cpu`` it runs every step on the CPU -- the random SmolLM2-shaped model, both
backends against transformers in fp32 and bf16, greedy tokens, the ``-k cuda`` tests, the bench on
a small workload -- and its summary must say it was a dry run and hold every bench figure (the
summary's code runs for the first time on a GPU otherwise, inside a lease of minutes).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present: the script checks it for real")
def test_without_cuda_it_refuses_with_status_2():
    p = _run("--skip-bench")
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    assert "no CUDA device" in p.stdout


def test_dry_run_on_the_cpu_runs_every_step_and_summarizes_the_bench(tmp_path):
    # two of SmolLM2's 30 layers, and the -k cuda tests only collected (make test runs them itself): the
    # same code paths as a GPU run, in about a tenth of the time
    # --skip-triton: tests/test_paged_triton.py runs the triton checks themselves, in the interpreter;
    # here they would run a second time where .triton-site exists (about 20 s on a quiet 2-core machine)
    p = _run("--dry-run-cpu", "--layers", "2", "--cuda-tests", "collect", "--requests", "2", "--max-tokens", "4",
             "--skip-triton", "--report", str(tmp_path / "report"))
    out = p.stdout
    assert p.returncode == 0, (out[-3000:], p.stderr[-3000:])
    # --report: the bench's JSON and the summary's checks, as printed, come back from a GPU box as files
    import json

    saved = json.loads((tmp_path / "report" / "summary.json").read_text())
    bench = json.loads((tmp_path / "report" / "bench.json").read_text())
    assert set(bench["throughput_by_dtype"]) == {"bfloat16", "float32"} and bench["device"] == "cpu"
    for c in saved["checks"]:
        assert f"  {'PASS' if c['ok'] else 'FAIL'}  {c['name']}: {c['detail']}" in out
    summary = out[out.index("== gpu-check summary =="):]
    assert "DRY RUN on the CPU" in summary
    checks = re.findall(r"^  (PASS|FAIL)  (.+?):", summary, flags=re.M)
    names = [name for _, name in checks]
    for want in ("score float32 reference vs transformers", "score float32 fused vs transformers",
                 "score bfloat16 reference vs transformers", "score bfloat16 fused vs transformers",
                 "greedy tokens fp32 (fused, batch of 4) == transformers"):
        assert want in names, (want, names)
    assert all(status == "PASS" for status, _ in checks), summary
    assert not any("CUDA graphs" in name for name in names), "the CPU captures no graphs: nothing to claim"
    assert "python -m minikv.bench --device cpu (bf16, fp32)" in names
    assert re.search(r"^  PASS  pytest -k cuda .*: collected, not run: \d+(/\d+)? tests? collected", summary, flags=re.M), summary
    # the bench's own report lines, every dtype and section the GPU run is asked for
    for dtype in ("bfloat16", "float32"):
        assert re.search(rf"^  throughput {dtype} .* tok/s .* ratio \d+\.\d\d", summary, flags=re.M), summary
        assert re.search(rf"^  prefill {dtype} .* GFLOP/s .* prefill/peak \d+\.\d\d", summary, flags=re.M), summary
    assert re.search(r"^  ttft prefix hit .* ms .* hit/miss \d+\.\d{3}", summary, flags=re.M), summary
    for backend in ("reference", "fused"):
        assert re.search(rf"^  ops .* per decode step \(batch 16\) {backend} +\d+", summary, flags=re.M), summary
    # issue 38's TTFT scan: its table, one row per length with both dtypes' cells, and the floor lines
    assert "ttft scan ran (DRY RUN on tiny-random, targets not held)" in names
    table = out[out.index("== TTFT scan"):out.index("== gpu-check summary ==")]
    assert re.search(r"^\| L \| bf16 hit / miss \(ms\) \| bf16 hit/miss \| bf16 p \| bf16 target \| fp32 hit", table, flags=re.M)
    cell = r"\d+\.\d\d / \d+\.\d\d \| \d+\.\d\d \| [\d.e+-]+ \| (PASS|FAIL) \(p < 0\.001\)"
    for length in (32, 64):
        assert re.search(rf"^\| {length} \| {cell} \| {cell} \|$", table, flags=re.M), table
    for dtype in ("bf16", "fp32"):
        assert re.search(rf"^{dtype} 64-token miss .* ms vs FLOP floor .* ms: \d+\.\dx \((PASS|FAIL)", table, flags=re.M), table
        assert f"{dtype} prefill steps: eager (no prefill graph runner: not CUDA's fused or triton backend)" in table, table


def test_the_scan_checks_that_every_request_replayed_a_prefill_graph():
    """On CUDA (fused, triton) every hit and miss of the scan is a prefill graph replay; one that ran
    eagerly (a bucket that did not fit, a runner that was not there) fails the check, by count."""
    from minikv.bench.ttft_scan import format_scan, verdicts

    row = {"length": 256, "hit_ms": 1.0, "miss_ms": 2.0, "ratio": 0.5, "p": 1e-5, "auc": 1.0, "n": (12, 12)}
    for replays, ok in ((27, True), (26, False)):
        scan = {"bfloat16": {"rows": [row], "floor": None,
                             "prefill_graphs": {"captures": 2, "replays": replays, "requests": 27}}}
        check = [v for v in verdicts(scan) if "prefill steps replayed" in v[0]]
        assert check == [("ttft scan bf16: prefill steps replayed CUDA graphs", ok,
                          f"{replays} replays of 27 requests, 2 captures")]
        assert f"bf16 prefill steps: {replays} CUDA graph replays of 27 requests, 2 captures" in format_scan(scan)
    scan["bfloat16"]["prefill_graphs"] = None  # a CPU, or enforce_eager: no such check
    assert not [v for v in verdicts(scan) if "prefill" in v[0]]


def test_scan_statistics_come_from_the_samples():
    """The scan's p is the one-sided Mann-Whitney p of "hits faster", its ratio the medians':
    hits clearly faster give a tiny p; the same distribution on both sides, or slower hits, do not."""
    import random

    from minikv.bench.ttft_scan import hit_miss_stats, verdict

    rng = random.Random(0)
    fast = [0.008 + rng.random() * 0.002 for _ in range(12)]
    slow = [0.020 + rng.random() * 0.002 for _ in range(12)]
    s = hit_miss_stats(fast, slow)
    assert s["p"] < 1e-4 and s["auc"] == 1.0 and s["n"] == (12, 12)
    median = lambda xs: (sorted(xs)[5] + sorted(xs)[6]) / 2  # noqa: E731 -- 12 samples
    assert abs(s["hit_ms"] - 1000 * median(fast)) < 1e-9 and abs(s["miss_ms"] - 1000 * median(slow)) < 1e-9
    assert abs(s["ratio"] - median(fast) / median(slow)) < 1e-12
    assert verdict(1024, s) == (True, "p < 0.001, hit/miss <= 0.5") and verdict(256, s)[0]
    same = hit_miss_stats([0.01 + rng.random() * 0.01 for _ in range(12)], [0.01 + rng.random() * 0.01 for _ in range(12)])
    assert same["p"] > 1e-3 and not verdict(4096, same)[0]
    backwards = hit_miss_stats(slow, fast)
    assert backwards["p"] > 0.99 and backwards["ratio"] > 1.5 and not verdict(256, backwards)[0]
    assert verdict(256, {"p": 1e-4, "ratio": 0.81}) == (False, "p < 0.001, hit/miss <= 0.8")
    assert verdict(7000, {"p": 1e-4, "ratio": 0.99})[0]
    with pytest.raises(ValueError, match="non-finite"):
        hit_miss_stats([float("nan")], [1.0])


def test_bad_workload_sizes_are_refused_by_name():
    p = _run("--dry-run-cpu", "--requests", "0", timeout=60)
    assert p.returncode == 2 and "--requests must be at least 1, got 0" in p.stderr, p.stderr[-2000:]


def test_a_check_that_raises_is_a_fail_and_the_next_checks_still_run(capsys):
    """A GPU session may get one run: a check that raises (as the fp32 CUDA path once did) must be
    recorded as FAIL with its exception named, not end the script before the others report."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)

    def broken():
        raise RuntimeError("view size is not compatible\nsecond line")
    results = []
    gpu_check.attempt(results, "broken check", broken)
    gpu_check.attempt(results, "next check", lambda: (True, "ran"))
    assert results == [("broken check", False, "raised RuntimeError: view size is not compatible"),
                       ("next check", True, "ran")]
    captured = capsys.readouterr()
    assert "Traceback" in captured.err and "FAIL  broken check" in captured.out
