"""Run a script under Triton's CPU interpreter, in a subprocess.

minikv's own environment never installs Triton: ``make triton`` puts it in ``.triton-site``, and
only these subprocesses see it (``PYTHONPATH``), with ``TRITON_INTERPRET=1`` so its kernels run on
the CPU.  A subprocess also keeps Triton's import-time patches out of the test process."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SITE = ROOT / ".triton-site"


def interpret(script: str | Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    """``python script *args`` under the interpreter; skips without Triton (fails under
    ``$MINIKV_REQUIRE_TRITON``, as CI sets it)."""
    if not (SITE / "triton").is_dir():
        msg = "no Triton for the interpreter: install it with `make triton` (into .triton-site, ~300 MB)"
        if os.environ.get("MINIKV_REQUIRE_TRITON"):
            pytest.fail(msg)
        pytest.skip(msg)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{SITE}", "TRITON_INTERPRET": "1"}
    return subprocess.run([sys.executable, str(ROOT / script), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
