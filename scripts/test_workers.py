#!/usr/bin/env python3
"""How many pytest processes ``make test`` runs at once: one per core, at most one per 8 GB of RAM.

    python scripts/test_workers.py              # prints the number (make test's TEST_WORKERS default)
    python scripts/test_workers.py --threads N  # torch threads per process when N run at once

Threads: each process gets its share of the cores (at least one), passed down as OMP_NUM_THREADS
to the workers, their notebook kernels and the servers they start.  Left at torch's default, every
process starts one OpenMP thread per core, so two workers on two cores run four spinning threads,
and a parallel region waits on whichever thread the scheduler parked.  Measured on the 2-core
machine (2026-12-06), two copies of one test file side by side: tests/test_engine_batching.py -k
smollm2 31.6 s with torch's default, 18.8 s with one thread each; tests/test_engine_correctness.py
with tests/test_host_memory.py 148.6 s against 127.8 s.

Each process holds its own engines, transformers models and a notebook kernel at a time: up to 3.4 GB
at its peak over the suite (2026-12-05), 6.6 GB for the tree of two workers, so 8 GB per worker leaves a
laptop room for everything else (0: in the make process's own pytest, no pytest-xdist).  Stdlib only: ``make`` asks before the venv exists.
"""
from __future__ import annotations

import os

GB_PER_WORKER = 8


def workers(cores: int, mem_bytes: int) -> int:
    """Processes for ``cores`` cores and ``mem_bytes`` of RAM; 0 (no xdist) when only one fits."""
    n = min(cores, mem_bytes // (GB_PER_WORKER << 30))
    return n if n >= 2 else 0


def threads(cores: int, processes: int) -> int:
    """Torch threads for each of ``processes`` running at once on ``cores`` (0 processes: one)."""
    return max(1, cores // max(1, processes))


def main(argv: list[str]) -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if argv[:1] == ["--threads"]:
        if len(argv) != 2 or not argv[1].isdigit():
            raise SystemExit(f"usage: test_workers.py --threads N (N: processes, a whole number), got {argv[1:]!r}")
        print(threads(cores, int(argv[1])))
        return
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    print(workers(cores, mem))


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
