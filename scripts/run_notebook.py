"""Execute course notebooks in place, the way they are committed.

    python scripts/run_notebook.py course/02_paged_kv_cache.ipynb [more.ipynb ...]

Each notebook is run top to bottom in a fresh kernel (fixed PYTHONHASHSEED, Agg backend), its
outputs are saved, and ipywidgets state is stripped from the metadata: widget state is large,
machine-specific and useless on GitHub, and nbval only needs the static outputs.  The run time
of each notebook is printed, since no lesson may take more than 2 minutes on a 2-core CPU.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def strip_widget_state(nb) -> None:
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)


def run(path: Path, timeout: int = 600) -> float:
    nb = nbformat.read(path, as_version=4)
    nb.metadata["kernelspec"] = {"display_name": "Python 3 (ipykernel)", "language": "python", "name": "python3"}
    os.environ.setdefault("PYTHONHASHSEED", "0")
    os.environ.setdefault("MPLBACKEND", "module://matplotlib_inline.backend_inline")
    start = time.perf_counter()
    NotebookClient(nb, timeout=timeout, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    elapsed = time.perf_counter() - start
    strip_widget_state(nb)
    nbformat.write(nb, path)
    return elapsed


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Lessons that import exercises/ need MINIKV_EXERCISES=solutions.")
    ap.add_argument("notebooks", nargs="+", type=Path, help="the .ipynb files to execute in place")
    ap.add_argument("--timeout", type=int, default=600, help="seconds a cell may run (default 600)")
    args = ap.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        ap.error(f"no such notebook: {', '.join(missing)}")
    for path in args.notebooks:
        print(f"{path}: {run(path, args.timeout):.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
