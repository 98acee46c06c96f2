#!/usr/bin/env python3
"""Create or refresh the project's virtual environment (``.venv``); stdlib only.

``make course`` and ``make test`` call this first, so it must be *idempotent* and
*fast when nothing changed*: a stamp file inside the venv records a hash of
``pyproject.toml`` (and of this script); when it matches, we exit in milliseconds.

The one delicate dependency is torch. ``pip install torch`` on Linux x86-64 fetches
the CUDA build from PyPI (several GB of nvidia-* wheels), which a CPU-only machine
can never use. So torch is installed *first*, deliberately, and only then the
package (whose ``torch>=2.2`` is then already satisfied):

1. If ``python3`` already imports torch (typical on GPU boxes with a CUDA build), the
   venv is created with ``--system-site-packages`` and keeps using it. Force this
   with ``MINIKV_TORCH=system``.
2. Otherwise we ask pip -- without downloading -- which torch it *would* pick. If that
   is a CUDA build but the machine has no NVIDIA driver, we install from the CPU
   index instead (``MINIKV_TORCH_INDEX``, default the PyTorch CPU wheel index).
   Machines whose pip already offers a ``+cpu`` wheel (via find-links) use it as is.

Environment knobs: ``PYTHON`` (interpreter for the venv), ``MINIKV_TORCH``
(``auto`` | ``system``), ``MINIKV_TORCH_SPEC`` (default ``torch==2.13.0``),
``MINIKV_TORCH_INDEX``.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
PY = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
STAMP = VENV / ".minikv-setup"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def say(msg: str) -> None:
    print(f"[setup] {msg}", flush=True)


def run(*cmd: str, **kw) -> subprocess.CompletedProcess:
    say("$ " + " ".join(cmd))
    started = time.time()
    done = subprocess.run(cmd, check=True, **kw)
    say(f"  ({time.time() - started:.0f} s)")
    return done


def setup_key() -> str:
    """What the venv depends on. The editable install maps each *top-level* package
    (minikv, exercises, solutions) found at install time, so a newly added one must
    trigger a re-install too, or notebooks running in course/ could not import it."""
    h = hashlib.sha256()
    for f in (ROOT / "pyproject.toml", Path(__file__)):
        h.update(f.read_bytes())
    h.update(os.environ.get("MINIKV_TORCH", "auto").encode())
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    h.update(" ".join(packages).encode())
    return h.hexdigest()[:16]


def imports_torch(python: str | Path) -> bool:
    probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
    return probe.returncode == 0


def has_nvidia() -> bool:
    return Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi") is not None


def create_venv(base: str) -> None:
    mode = os.environ.get("MINIKV_TORCH", "auto")
    system = mode == "system" or (mode == "auto" and imports_torch(base))
    flags = ["--system-site-packages"] if system else []
    if system:
        say("the base python already has torch: the venv will see it "
            "(--system-site-packages)")
    try:
        run(base, "-m", "venv", *flags, str(VENV))
    except subprocess.CalledProcessError:
        sys.exit("[setup] could not create .venv; on Debian/Ubuntu: "
                 "apt-get install python3-venv")
    run(str(PY), "-m", "pip", "install", "--quiet", "--upgrade", "pip")


def torch_install_args() -> list[str]:
    """pip arguments for torch on this machine (see the module docstring, step 2)."""
    spec = os.environ.get("MINIKV_TORCH_SPEC", "torch==2.13.0")
    if os.environ.get("MINIKV_TORCH_INDEX"):
        return [spec, "--index-url", os.environ["MINIKV_TORCH_INDEX"]]
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") \
            or has_nvidia():
        return [spec]   # macOS/Windows/ARM wheels on PyPI are CPU builds; GPU box: CUDA
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([str(PY), "-m", "pip", "install", "--dry-run", "--no-deps",
                        "--quiet", "--report", str(report), spec],
                       check=True, stdout=subprocess.DEVNULL)
        picked = json.loads(report.read_text())["install"][0]["metadata"]["version"]
    if "+cpu" in picked:
        say(f"pip offers a CPU build of torch here ({picked})")
        return [spec]
    say(f"pip would pick torch {picked} (CUDA) but this machine has no NVIDIA driver: "
        f"using the CPU index {CPU_INDEX}")
    return [spec, "--index-url", CPU_INDEX]


def main() -> None:
    base = os.environ.get("PYTHON") or sys.executable
    key = setup_key()
    if PY.exists() and STAMP.exists() and STAMP.read_text().strip() == key:
        return                                           # the fast path: nothing to do
    started = time.time()
    version = subprocess.run([base, "-c", "import sys; print(sys.version_info >= (3, 10))"],
                             capture_output=True, text=True).stdout.strip()
    if version != "True":
        sys.exit(f"[setup] {base} is not Python >= 3.10; set PYTHON=/path/to/python3.x")
    if not PY.exists():
        create_venv(base)
    if imports_torch(PY):
        say("torch already importable in .venv")
    else:
        run(str(PY), "-m", "pip", "install", *torch_install_args())
    run(str(PY), "-m", "pip", "install", "-e", f"{ROOT}[course,test]")
    STAMP.write_text(key + "\n")
    say(f".venv ready in {time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
