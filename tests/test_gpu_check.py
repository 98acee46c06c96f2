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


def test_dry_run_on_the_cpu_runs_every_step_and_summarizes_the_bench():
    p = _run("--dry-run-cpu", "--requests", "2", "--max-tokens", "4")
    out = p.stdout
    assert p.returncode == 0, (out[-3000:], p.stderr[-3000:])
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
