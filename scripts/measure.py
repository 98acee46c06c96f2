#!/usr/bin/env python3
"""Run a command and print its wall clock and peak memory when it ends (``make test`` uses it).

    python scripts/measure.py --label "make test" --max-rss-gb 6 -- make test-py test-nb

Two memory figures, because they answer different questions:

* **largest process** -- the peak resident set of the biggest single process in the command's
  tree, from ``getrusage(RUSAGE_CHILDREN)`` after it exits: the same number as GNU time's
  "Maximum resident set size", and the one that decides whether a laptop can run the suite;
* **whole tree** -- the largest sum of resident sets over the command and all its descendants,
  sampled twice a second from ``/proc`` (Linux; skipped elsewhere).  It catches a suite that
  keeps several medium processes alive at once, which the first figure cannot see.  A page two
  processes share (a library, a forked parent's memory) is resident in both, so that sum counts it
  twice; beside it goes the largest sum of *proportional* sets (``Pss`` in ``smaps_rollup``: a
  page shared by n processes counts 1/n in each), which is what the tree really occupies.

Servers that detach from the tree (the vLLM that ``make test`` starts first) are in neither.
``--max-rss-gb`` only warns: a budget printed at every run is what keeps it visible; the tests
themselves never time or weigh anything.  The exit status is the command's own.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time

GB = 1 << 30


def tree_rss(pid: int, per_pid: dict[int, int] | None = None, pss: list[int] | None = None) -> int:
    """Summed resident bytes of ``pid`` and all its descendants, read from ``/proc`` (Linux).
    ``per_pid``, if given, keeps each descendant's largest RSS seen so far; ``pss``, if given,
    gets the same tree's summed proportional bytes as ``pss[0]`` (a process whose ``smaps_rollup``
    cannot be read counts its RSS).

    Stdlib only, so ``make test`` can measure itself before the venv exists.  A process may end
    between listing and reading: it is simply not counted.
    """
    parent, rss = {}, {}
    page = os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()   # the name may hold spaces: split after it
            with open(f"/proc/{entry}/statm") as fh:
                rss[int(entry)] = int(fh.read().split()[1]) * page
            parent[int(entry)] = int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
    children: dict[int, list[int]] = {}
    for child, ppid in parent.items():
        children.setdefault(ppid, []).append(child)
    total, proportional, todo = 0, 0, [pid]
    while todo:
        p = todo.pop()
        total += rss.get(p, 0)
        if pss is not None and p in rss:
            proportional += proportional_bytes(p, rss[p])
        if per_pid is not None and rss.get(p, 0) > per_pid.get(p, 0):
            per_pid[p] = rss[p]
            if p not in NAMES:
                NAMES[p] = command_of(p)
        todo += children.get(p, [])
    if pss is not None:
        pss[0] = proportional
    return total


def proportional_bytes(pid: int, fallback: int) -> int:
    """``pid``'s proportional set size (``Pss`` of ``/proc/<pid>/smaps_rollup``, Linux 4.14+),
    or ``fallback`` where it cannot be read (the process ended, or an older kernel)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as fh:
            for line in fh:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return fallback


NAMES: dict[int, str] = {}  # pid -> its command line, read when first seen


def command_of(pid: int, width: int = 110) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            cmd = fh.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"
    return cmd if len(cmd) <= width else cmd[:width - 3] + "..."


def tree_sampler(pid: int, stop: threading.Event, peak: list[int], per_pid: dict[int, int]) -> None:
    """Keep ``peak[0]`` at the largest summed RSS of ``pid``'s tree, and ``per_pid`` at each
    process's own largest, sampled twice a second; ``peak[1]`` at the largest summed PSS, sampled
    every 2 s: the kernel walks a process's page tables to sum its PSS (17 ms for a 3 GB process
    here), and at half a second that would take about 9% of a core from the suite it measures.
    ``peak[2]`` is the CPU time the sampling itself has used, printed with the result: what
    measuring cost the suite."""
    if not os.path.isdir("/proc"):
        return
    pss, n = [0], 0
    while not stop.wait(0.5):
        want_pss = n % 4 == 0
        peak[0] = max(peak[0], tree_rss(pid, per_pid, pss if want_pss else None))
        if want_pss:
            peak[1] = max(peak[1], pss[0])
        peak[2] = time.thread_time()
        n += 1


def module_report(path: str, top: int = 6) -> list[str]:
    """The test files after which the pytest process was largest (tests/conftest.py writes one
    line per file to ``$MINIKV_RSS_LOG``: file, RSS at its end before and after the clean-up, and
    the process's peak so far, in MB): where to look first when the budget is missed."""
    try:
        with open(path) as fh:
            rows = [line.rstrip("\n").split("\t") for line in fh if line.count("\t") == 3]
    except OSError:
        return []
    rows = [(name, float(before), float(after), float(peak)) for name, before, after, peak in rows]
    out, last_peak = [], 0.0
    grew = []
    for name, before, after, peak in rows:
        grew.append((peak - last_peak, name, before, after, peak))
        last_peak = max(last_peak, peak)
    for rise, name, before, after, peak in sorted(grew, reverse=True)[:top]:
        if rise > 0:
            out.append(f"  {name}: raised the peak by {rise / 1024:.2f} GB to {peak / 1024:.2f} GB "
                       f"(at its end {before / 1024:.2f} GB, after clean-up {after / 1024:.2f} GB)")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--label", default="command")
    ap.add_argument("--max-rss-gb", type=float, default=None, help="print a warning above this (largest process)")
    ap.add_argument("--max-minutes", type=float, default=None, help="print a warning above this wall clock")
    ap.add_argument("--rss-log", default=None, help="tests/conftest.py's per-file RSS log: print where the peak grew")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command given (put it after --)")
    started = time.monotonic()
    proc = subprocess.Popen(cmd)
    stop, peak, per_pid = threading.Event(), [0, 0, 0.0], {}
    sampler = threading.Thread(target=tree_sampler, args=(proc.pid, stop, peak, per_pid), daemon=True)
    sampler.start()
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        rc = proc.wait()
    stop.set()
    sampler.join(timeout=5)
    wall = time.monotonic() - started
    largest = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024   # Linux reports KiB
    tree = (f", whole tree {peak[0] / GB:.1f} GB ({peak[1] / GB:.1f} GB with shared pages counted once)"
            if peak[0] else "")
    cost = f"; sampling the tree used {peak[2]:.1f} s of CPU" if peak[0] else ""
    print(f"[{args.label}] wall clock {int(wall // 60)} min {wall % 60:04.1f} s; peak RSS: largest process "
          f"{largest / GB:.1f} GB{tree}; exit {rc}{cost}", flush=True)
    if args.max_rss_gb is not None and largest > args.max_rss_gb * GB:
        print(f"[{args.label}] WARNING: largest process over the {args.max_rss_gb:g} GB budget", flush=True)
        biggest = sorted(per_pid.items(), key=lambda kv: -kv[1])[:3]
        for pid, rss in biggest:  # sampled, so a short spike may read a little low
            print(f"  {rss / GB:.1f} GB  pid {pid}: {NAMES.get(pid, '?')}", flush=True)
        for line in module_report(args.rss_log) if args.rss_log else []:
            print(line, flush=True)
    if args.max_minutes is not None and wall > args.max_minutes * 60:
        print(f"[{args.label}] WARNING: over the {args.max_minutes:g}-minute budget", flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
