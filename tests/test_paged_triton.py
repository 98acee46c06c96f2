"""The ``triton`` backend: its kernel equals the reference attention, and the registry guards it.

The kernel (``minikv/engine/paged_triton_kernel.py``) is checked on the CPU by Triton's
interpreter (``TRITON_INTERPRET=1``), with Triton from ``.triton-site`` (``make triton``;
minikv's own environment never installs it).  Each check runs in a subprocess, so this test
process never imports Triton: a second Triton beside torch could change what ``torch.compile``
does for every other test.  Without ``.triton-site`` those tests skip, naming ``make triton``,
except in CI (``$MINIKV_REQUIRE_TRITON``, set by ``.ci/run``), where that is a failure.

* kernel level (``scripts/triton_check.py``): prefill, prefix-hit, decode and mixed calls on
  SmolLM2's attention shapes, fp32 within 1e-5 and fp16 within 2e-2 of the reference
  (``attention.gather_attention``), pools full of stale K/V and shuffled block tables;
* engine level (``tests/triton_engine_check.py``): a tiny-random engine on the backend, step
  by step against the reference backend, logits within 1e-4 of the largest, tokens identical.
  Again with the prefill graph runner (``prefill-graphs``): requests one at a time, every hit's
  kernel call made from inside a (stand-in) replay.

bf16 is not checked here: the interpreter's bf16 matrix multiply is wrong (NumPy has no bf16).
``make gpu-check`` runs the kernel check on CUDA, bf16 included.  No GPU timing is measured here.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minikv.backends.registry import BACKENDS, FUSED, resolve_backend
from triton_helpers import interpret

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / ".triton-site"


def test_triton_kernel_equals_reference_on_prefill_hit_decode_and_mixed_calls():
    p = interpret("scripts/triton_check.py", "--dtypes", "float32,float16")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    cases = {(c, d) for c in ("prefill", "hit", "decode", "mixed") for d in ("float32", "float16")}
    assert len(lines) == len(cases) and all('"ok": true' in ln for ln in lines), p.stdout


def test_engine_on_triton_backend_matches_reference_step_by_step():
    p = interpret("tests/triton_engine_check.py")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert "tokens identical" in p.stdout


def test_triton_hits_replayed_from_prefill_graphs_match_reference():
    """The Triton kernel called from inside prefill graphs (``prefill_graphs.py``; the eager stand-in
    here), reading the real row count and context length from the static buffer."""
    p = interpret("tests/triton_engine_check.py", "cpu", "prefill-graphs")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    assert "all from prefill graphs, tokens identical" in p.stdout, p.stdout


def test_triton_is_a_registry_entry_for_cuda_only():
    assert "triton" in BACKENDS and "triton" in FUSED
    assert resolve_backend("auto", "cuda", 64, "bfloat16") == "fused"  # never picked unmeasured
    for device in ("cpu", "mps"):
        with pytest.raises(ValueError, match="attention_backend='triton'.*CUDA"):
            resolve_backend("triton", device, 64, "float32")
    with pytest.raises(ValueError, match="head_dim 24"):
        resolve_backend("triton", "cuda", 24, "float32")


def test_an_engine_on_the_cpu_refuses_the_triton_backend_by_name():
    from minikv import LLM

    with pytest.raises(ValueError, match="attention_backend='triton'"):
        LLM("tiny-random", device="cpu", attention_backend="triton")


def test_triton_backend_without_triton_says_so(monkeypatch):
    from minikv.backends import registry as attention_backends

    monkeypatch.setattr(attention_backends, "_triton_importable", lambda: False)
    with pytest.raises(RuntimeError, match="needs Triton"):
        resolve_backend("triton", "cuda", 64, "bfloat16")
    monkeypatch.setattr(attention_backends, "_triton_importable", lambda: True)
    assert resolve_backend("triton", "cuda", 64, "bfloat16") == "triton"


def test_minikv_never_imports_triton_itself():
    code = ("import sys, minikv.backends.attention_fused, minikv.backends.fused, minikv.backends.paged_triton\n"
            "assert 'triton' not in sys.modules, 'imported triton'\n")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{SITE}"}
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
