#!/usr/bin/env python3
"""How many pytest processes ``make test`` runs at once: one per core, at most one per 8 GB of RAM.

    python scripts/test_workers.py      # prints the number (make test's TEST_WORKERS default)

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


def main() -> None:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    print(workers(cores, mem))


if __name__ == "__main__":
    main()
