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
    p = _run("--dry-run-cpu", "--requests", "2", "--max-tokens", "4", "--report", str(tmp_path / "report"))
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
    # the bench's own report lines, every dtype and section the GPU run is asked for
    for dtype in ("bfloat16", "float32"):
        assert re.search(rf"^  throughput {dtype} .* tok/s .* ratio \d+\.\d\d", summary, flags=re.M), summary
        assert re.search(rf"^  prefill {dtype} .* GFLOP/s .* prefill/peak \d+\.\d\d", summary, flags=re.M), summary
    assert re.search(r"^  ttft prefix hit .* ms .* hit/miss \d+\.\d{3}", summary, flags=re.M), summary
    for backend in ("reference", "fused"):
        assert re.search(rf"^  ops .* per decode step \(batch 16\) {backend} +\d+", summary, flags=re.M), summary


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
