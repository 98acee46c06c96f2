"""Building minikv's C++ CPU kernels: once, at set-up, into a cache keyed by everything they depend on.

``cpu_kernels.py`` loads and calls the kernels; this module only makes the library it loads.

* **Where.** ``$MINIKV_HOME/kernels/minikv_cpu-<key>.so``.  The key hashes every source and
  header, the torch version, the compiler, the CPU's feature flags and the flags below, so an
  edited kernel, another torch or another machine never loads a stale build
  (:func:`library_path`).
* **When.** ``make model`` (so ``make course`` and ``make test``) runs ``python -m
  minikv.backends.cpu_kernels``, which calls :func:`build`.  Nothing else compiles: a lesson or a
  request that finds no build runs the pure-PyTorch ``fused`` backend instead of waiting.
* **How.** Each ``kernels/*.cpp`` is compiled to an object file on its own, several at once, and
  the objects are linked into one shared library.  Every source includes ATen's headers, which
  cost most of the time, so one compiler per usable core beats one ``g++`` call that compiles
  them one after another (docs/BENCHMARKS.md, "CPU kernels", has the times).  The library is written beside
  its final name and renamed into place, so a build that fails or is interrupted never leaves
  half a file where :func:`cpu_kernels.available` would load it.
* **Clean-up.** Every minikv or torch upgrade makes a new build (~0.6 MB).  Builds that nothing
  has built or loaded for ``STALE_AFTER_DAYS`` are deleted by the next build (:func:`prune`);
  loading a build marks it used, so another environment's build is kept while it is in use.
"""
from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..home import minikv_home
from ..engine.device import usable_cores

KERNELS = Path(__file__).parent / "kernels"
SOURCES = sorted(KERNELS.glob("*.cpp"))
HEADERS = sorted(KERNELS.glob("*.h"))  # what the sources share (cpu_vec.h, attention_tiles.h)

# -ffp-contract=off: a multiply and an add written apart stay apart (GCC otherwise fuses them into
# one FMA, which rounds once instead of twice), so the kernels that promise ATen's bits (RoPE's
# x * cos + rot * sin) keep them; the matmul and attention kernels ask for FMAs explicitly.
CXX_FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fopenmp", "-shared", "-fPIC", "-std=c++20")
STALE_AFTER_DAYS = 30
PREFIX = "minikv_cpu-"


def compiler() -> str | None:
    """The C++ compiler's path (``$CXX``, default ``g++``), or None if it is not on PATH."""
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return sys.platform


def library_path() -> Path | None:
    """Where the build of these sources, torch, compiler and CPU lives (``None``: no compiler)."""
    import torch

    cxx = compiler()
    if cxx is None:
        return None
    parts = [p.read_bytes() for p in SOURCES + HEADERS] + [torch.__version__.encode(), cxx.encode(),
                                                        _cpu_flags().encode(), " ".join(CXX_FLAGS).encode()]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    return minikv_home() / "kernels" / f"{PREFIX}{key}.so"


def commands(cxx: str, objects: Path, out: Path) -> tuple[list[list[str]], list[str]]:
    """The compiler calls of a build: one per source (``-c``, into the folder ``objects``), then
    the link of their objects into ``out``."""
    import torch
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)  # must match how torch itself was built
    compile_flags = [f for f in CXX_FLAGS if f != "-shared"]
    includes = [f"-I{p}" for p in cpp_extension.include_paths()]
    compiles = [[cxx, *compile_flags, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w", *includes, "-c", str(src),
                 "-o", str(objects / f"{src.stem}.o")] for src in SOURCES]
    link = [cxx, *CXX_FLAGS, *(str(objects / f"{src.stem}.o") for src in SOURCES),
            *(f"-L{p}" for p in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu", "-ltorch", "-o", str(out)]
    return compiles, link


def jobs() -> int:
    """How many sources to compile at once: one per core this process may use."""
    return max(1, min(len(SOURCES), usable_cores()))


def build(force: bool = False) -> Path:
    """Compile the kernels into the cache (a no-op if this build exists); returns its path.
    Raises ``RuntimeError`` naming the problem: no compiler, or the failing source and the
    compiler's own errors."""
    path = library_path()
    if path is None:
        raise RuntimeError(f"no C++ compiler: {os.environ.get('CXX', 'g++')!r} is not on PATH "
                           "(install g++, or set CXX); minikv then runs the pure-PyTorch 'fused' backend")
    if path.exists() and not force:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")  # built aside, renamed into place: never half a file
    with tempfile.TemporaryDirectory(prefix="minikv-kernels-") as objects:
        compiles, link = commands(compiler(), Path(objects), tmp)
        with ThreadPoolExecutor(jobs()) as pool:  # threads only wait: the compilers do the work
            runs = list(pool.map(lambda cmd: subprocess.run(cmd, capture_output=True, text=True), compiles))
        failed = [(f"compiling {src.name}", r) for src, r in zip(SOURCES, runs) if r.returncode != 0]
        if not failed:
            linked = subprocess.run(link, capture_output=True, text=True)
            failed = [("linking the kernels", linked)] if linked.returncode != 0 else []
    if failed:
        tmp.unlink(missing_ok=True)
        step, r = failed[0]
        raise RuntimeError(f"{step} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    os.replace(tmp, path)
    prune(path.parent, keep=path)
    return path


def prune(folder: Path, keep: Path, now: float | None = None) -> list[Path]:
    """Delete the builds in ``folder`` (and half-written ``.tmp`` files of dead builds) that have
    not been built or loaded for ``STALE_AFTER_DAYS``, never ``keep``; returns what was deleted.
    A deletion that fails (another process got there first) is skipped, never raised."""
    cutoff = (time.time() if now is None else now) - STALE_AFTER_DAYS * 86400
    gone = []
    for f in folder.glob(f"{PREFIX}*"):
        try:
            if f != keep and f.stat().st_mtime < cutoff:
                f.unlink()
                gone.append(f)
        except OSError:
            continue
    return gone
