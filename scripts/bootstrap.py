#!/usr/bin/env python3
"""Create or refresh the project's virtual environment (``.venv``); stdlib only.

``make course`` and ``make test`` call this first, so it must be *idempotent* and
*fast when nothing changed*: a stamp file inside the venv records a hash of
``pyproject.toml``, ``constraints.txt`` (and of this script); when it matches, we exit in
milliseconds.

Installs are reproducible: minikv and all its extras (``EXTRAS``) are installed with
``-c constraints.txt``, which pins every package CI uses. ``make upgrade-deps``
(``bootstrap.py --upgrade-deps``) regenerates that file: it builds a throw-away venv the
same way but *without* constraints, so pip picks the newest releases, and freezes it.

The one delicate dependency is torch. ``pip install torch`` on Linux x86-64 fetches
the CUDA build from PyPI (several GB of nvidia-* wheels), which a CPU-only machine
can never use. So torch is installed *first*, deliberately, and only then the
package (whose ``torch>=2.5`` is then already satisfied):

1. If ``python3`` already imports torch (typical on GPU boxes with a CUDA build), the
   venv is created with ``--system-site-packages`` and keeps using it. Force this
   with ``MINIKV_TORCH=system``; ``MINIKV_TORCH=pip`` never reuses it.  A system torch
   older than pyproject's floor (``torch>=2.5``: ``scaled_dot_product_attention``'s
   ``enable_gqa``) is refused, with the fix, before anything is created: otherwise the
   install succeeds and the first forward pass fails.
2. Otherwise we ask pip -- without downloading -- which torch it *would* pick. If that
   is a CUDA build but the machine has no NVIDIA driver, we install from the CPU
   index instead (``MINIKV_TORCH_INDEX``, default the PyTorch CPU wheel index).
   Machines whose pip already offers a ``+cpu`` wheel (via find-links) use it as is.

torch's version is the ``torch==`` pin in ``constraints.txt``, unless
``MINIKV_TORCH_SPEC`` says otherwise (it too must meet the floor); the other packages are constrained without that line,
so a system torch or another torch spec never makes pip swap torch.
``--upgrade-deps`` keeps torch at its pin too: ``MINIKV_TORCH_SPEC=torch make upgrade-deps``
moves it to the newest release.

Environment knobs: ``PYTHON`` (interpreter for the venv), ``MINIKV_TORCH``
(``auto`` | ``system`` | ``pip``), ``MINIKV_TORCH_SPEC`` (default: the pin in ``constraints.txt``),
``MINIKV_TORCH_INDEX``.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ROOT / ".venv"
PY = VENV / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
STAMP = VENV / ".minikv-setup"
CONSTRAINTS = ROOT / "constraints.txt"
EXTRAS = "serve,audit,convert,course,test,tiers"   # all of pyproject's extras: make course/test need them
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
    """What the venv depends on: pyproject, the pins, this script. The editable install maps
    each *top-level* package (minikv, exercises, solutions) found at install time, so a newly
    added one must trigger a re-install too, or notebooks running in course/ could not
    import it."""
    h = hashlib.sha256()
    for f in (ROOT / "pyproject.toml", CONSTRAINTS, Path(__file__)):
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


def is_torch(line: str) -> bool:
    return line.split("==")[0].strip().lower() == "torch"


def torch_pin() -> str:
    """``torch==X`` from constraints.txt: the torch CI uses."""
    lines = CONSTRAINTS.read_text().splitlines() if CONSTRAINTS.exists() else []
    pins = [ln.strip() for ln in lines if is_torch(ln)]
    return pins[0] if pins else "torch"


def version_tuple(version: str) -> tuple[int, ...]:
    """``"2.4.1+cu121"`` -> ``(2, 4, 1)``."""
    return tuple(int(x) for x in re.match(r"\d+(?:\.\d+)*", version.strip()).group().split("."))


def torch_floor() -> str:
    """The lowest torch pyproject.toml accepts (its ``torch>=X`` dependency): one source of truth."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(re.split(r"\s*>=\s*", d)[1] for d in deps if re.match(r"torch\s*>=", d))


def torch_version(python: str | Path) -> str | None:
    probe = subprocess.run([str(python), "-c", "import torch; print(torch.__version__)"],
                           capture_output=True, text=True)
    return probe.stdout.strip() if probe.returncode == 0 else None


def check_torch(python: str | Path, where: str) -> None:
    """Exit with the fix if ``python`` imports a torch older than the floor."""
    found, floor = torch_version(python), torch_floor()
    if found is None or version_tuple(found) >= version_tuple(floor):
        return
    sys.exit(f"[setup] {where} has torch {found}, but minikv needs torch>={floor} "
             "(scaled_dot_product_attention's enable_gqa).\n"
             f"[setup] fix: upgrade it -- {python} -m pip install --upgrade 'torch>={floor}' "
             "(for a CUDA build, use the command from https://pytorch.org/get-started/locally/) -- "
             "or give .venv its own torch: rm -rf .venv && MINIKV_TORCH=pip make setup")


def create_venv(base: str, venv: Path, system_torch: bool = True) -> Path:
    mode = os.environ.get("MINIKV_TORCH", "auto")
    if mode not in ("auto", "system", "pip"):
        sys.exit(f"[setup] MINIKV_TORCH={mode!r}: expected auto, system or pip")
    system = system_torch and (mode == "system" or (mode == "auto" and imports_torch(base)))
    flags = ["--system-site-packages"] if system else []
    if system:
        check_torch(base, f"the base python ({base})")
        say("the base python already has torch: the venv will see it "
            "(--system-site-packages)")
    try:
        run(base, "-m", "venv", *flags, str(venv))
    except subprocess.CalledProcessError:
        sys.exit("[setup] could not create .venv; on Debian/Ubuntu: "
                 "apt-get install python3-venv")
    py = venv / PY.relative_to(VENV)
    run(str(py), "-m", "pip", "install", "--quiet", "--upgrade", "pip")
    return py


def torch_install_args(py: Path, gpu: bool = True) -> list[str]:
    """pip arguments for torch on this machine (see the module docstring, step 2).
    ``gpu=False``: a CPU build even on a GPU box (what ``--upgrade-deps`` freezes)."""
    spec = os.environ.get("MINIKV_TORCH_SPEC") or torch_pin()
    if os.environ.get("MINIKV_TORCH_INDEX"):
        return [spec, "--index-url", os.environ["MINIKV_TORCH_INDEX"]]
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64") \
            or (gpu and has_nvidia()):
        return [spec]   # macOS/Windows/ARM wheels on PyPI are CPU builds; GPU box: CUDA
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        subprocess.run([str(py), "-m", "pip", "install", "--dry-run", "--no-deps",
                        "--quiet", "--report", str(report), spec],
                       check=True, stdout=subprocess.DEVNULL)
        picked = json.loads(report.read_text())["install"][0]["metadata"]["version"]
    if "+cpu" in picked:
        say(f"pip offers a CPU build of torch here ({picked})")
        return [spec]
    say(f"pip would pick torch {picked} (CUDA) but this machine has no NVIDIA driver: "
        f"using the CPU index {CPU_INDEX}")
    return [spec, "--index-url", CPU_INDEX]


def check_python(base: str) -> None:
    version = subprocess.run([base, "-c", "import sys; print(sys.version_info >= (3, 11))"],
                             capture_output=True, text=True).stdout.strip()
    if version != "True":
        sys.exit(f"[setup] {base} is not Python >= 3.11; set PYTHON=/path/to/python3.x")


def main() -> None:
    base = os.environ.get("PYTHON") or sys.executable
    if not CONSTRAINTS.exists():
        sys.exit("[setup] constraints.txt is missing; `make upgrade-deps` writes it")
    key = setup_key()
    if PY.exists() and STAMP.exists() and STAMP.read_text().strip() == key:
        return                                           # the fast path: nothing to do
    started = time.time()
    check_python(base)
    if not PY.exists():
        create_venv(base, VENV)
    if imports_torch(PY):
        say("torch already importable in .venv")
    else:   # --no-deps: torch's own dependencies come with the pins below
        run(str(PY), "-m", "pip", "install", "--no-deps", *torch_install_args(PY))
    check_torch(PY, ".venv")  # an older .venv, or a MINIKV_TORCH_SPEC below the floor
    # The pins without torch's: torch is whatever the step above left (pin, spec or system).
    pins = [ln for ln in CONSTRAINTS.read_text().splitlines() if not is_torch(ln)]
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(pins) + "\n")
        run(str(PY), "-m", "pip", "install", "-c", str(constraints), "-e", f"{ROOT}[{EXTRAS}]")
    STAMP.write_text(key + "\n")
    say(f".venv ready in {time.time() - started:.0f} s")


def upgrade_deps() -> None:
    """Rewrite constraints.txt from a fresh venv installed without it (newest releases)."""
    base = os.environ.get("PYTHON") or sys.executable
    check_python(base)
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="minikv-upgrade-") as tmp:
        py = create_venv(base, Path(tmp) / "venv", system_torch=False)
        run(str(py), "-m", "pip", "install", *torch_install_args(py, gpu=False))
        run(str(py), "-m", "pip", "install", "-e", f"{ROOT}[{EXTRAS}]")
        frozen = subprocess.run([str(py), "-m", "pip", "freeze", "--exclude-editable"],
                                check=True, capture_output=True, text=True).stdout
        pyver = subprocess.run([str(py), "-c", "import platform; print(platform.python_version())"],
                               check=True, capture_output=True, text=True).stdout.strip()
    # "torch==2.13.0+cpu" -> "torch==2.13.0": the pin must match the CUDA build too.
    pins = sorted({ln.split("+")[0].strip() for ln in frozen.splitlines()
                   if "==" in ln and not ln.lower().startswith("minikv==")}, key=str.lower)
    for ln in frozen.splitlines():
        if ln.strip() and "==" not in ln:
            say(f"not pinned (not a plain release): {ln}")
    CONSTRAINTS.write_text(
        "# Every package version CI uses; scripts/bootstrap.py installs with -c constraints.txt.\n"
        "# Generated by `make upgrade-deps` (pip freeze of a fresh venv, Python "
        f"{pyver}); do not edit by hand.\n" + "\n".join(pins) + "\n")
    say(f"wrote {CONSTRAINTS.name}: {len(pins)} pins in {time.time() - started:.0f} s; "
        "review `git diff constraints.txt`, then `make test`")


if __name__ == "__main__":
    upgrade_deps() if sys.argv[1:] == ["--upgrade-deps"] else main()
