"""Rotation for the audit trail: size and time limits, gzip, and a cap on disk use.

A trail that only grows is an outage in waiting: a soak test of ``minikv serve`` wrote 124 MB in
five minutes at one line per block event.  :class:`RotatingFile` is the trail's writer.  It
keeps one *live* file that lines are appended to, and when the live file would pass ``max_bytes``
or is older than ``rotate_interval_s`` it moves it aside and starts a new one::

    trail.jsonl          the live file (appended to, flushed after every line)
    trail.jsonl.7.gz     rotated files: the number only grows, a higher number is newer
    trail.jsonl.8.gz
    trail.jsonl.9        (briefly) rotated, being compressed in the background

Names never change once written -- unlike logrotate's ``.1`` is-always-the-newest scheme -- so a
reader (``minikv audit detect``) or a log shipper never sees a file move under it.  Rotated
files are gzip-compressed on a background thread (JSON lines compress about 10x; doing it inline
would stall the engine thread for a second every ``max_bytes``), then the oldest are deleted
until at most ``max_files`` rotated files remain and, if ``max_total_bytes`` is set, until the
rotated files and the live one fit in it.  Worst case on disk: ``max_bytes * (max_files + 1)``.

Limits: one writer *process* per path (threads and several engines in one process share one
:class:`RotatingFile` through :func:`open_shared`); time-based rotation is checked when a line
is written, so an idle server keeps its last file open past the interval; the age of a file
that existed before this process opened it counts from the opening.
"""
from __future__ import annotations

import gzip
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Callable

MAX_BYTES = 64 * 2**20          # 64 MiB per live file
ROTATE_INTERVAL_S = 86_400.0    # at least one file per day, so retention is also a time window
MAX_FILES = 8                   # rotated files kept
ROTATION_DEFAULTS = dict(max_bytes=MAX_BYTES, rotate_interval_s=ROTATE_INTERVAL_S, max_files=MAX_FILES,
                         max_total_bytes=None, compress=True)


def _rotated_pattern(live: Path) -> re.Pattern:
    return re.compile(re.escape(live.name) + r"\.(\d+)(\.gz)?$")


def rotated_files(live: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(number, path)`` of every rotated file of the trail ``live``, oldest first.

    When both ``trail.jsonl.N`` and ``trail.jsonl.N.gz`` exist (compression in progress, or
    interrupted), the ``.gz`` is complete -- it is renamed into place only when finished -- so it
    is the one returned."""
    live = Path(live)
    pat, found = _rotated_pattern(live), {}
    try:
        names = os.listdir(live.parent if str(live.parent) else ".")
    except FileNotFoundError:
        return []
    for name in names:
        m = pat.match(name)
        if m and (m.group(2) or int(m.group(1)) not in found):
            found[int(m.group(1))] = live.parent / name
    return sorted(found.items())


def trail_files(live: str | os.PathLike) -> list[Path]:
    """Every file of the trail whose live file is ``live``, in chronological order: the
    rotated files (oldest first), then the live file if it exists."""
    live = Path(live)
    files = [p for _, p in rotated_files(live)]
    return files + [live] if live.exists() else files


class RotatingFile:
    """Append-only line writer with size/time rotation, gzip and a disk cap (see module doc).

    ``clock`` returns Unix time; tests pass a fake one instead of sleeping.
    """

    def __init__(self, path: str | os.PathLike, *, max_bytes: int = MAX_BYTES,
                 rotate_interval_s: float | None = ROTATE_INTERVAL_S, max_files: int = MAX_FILES,
                 max_total_bytes: int | None = None, compress: bool = True,
                 clock: Callable[[], float] = time.time):
        _check_int("max_bytes", max_bytes, 1)
        _check_int("max_files", max_files, 0)
        if max_total_bytes is not None:
            _check_int("max_total_bytes", max_total_bytes, 1)
        if rotate_interval_s is not None:
            if isinstance(rotate_interval_s, bool) or not isinstance(rotate_interval_s, (int, float)):
                raise TypeError(f"rotate_interval_s must be a number or None, got {rotate_interval_s!r}")
            if not rotate_interval_s > 0:  # also rejects NaN
                raise ValueError(f"rotate_interval_s must be > 0 or None, got {rotate_interval_s!r}")
        self.path = Path(path).absolute()  # rotation renames it: a later chdir must not matter
        self.shared_key: Path | None = None  # set by open_shared()
        self.params = dict(max_bytes=max_bytes, rotate_interval_s=rotate_interval_s, max_files=max_files,
                           max_total_bytes=max_total_bytes, compress=compress)
        self.max_bytes, self.rotate_interval_s = max_bytes, rotate_interval_s
        self.max_files, self.max_total_bytes, self.compress = max_files, max_total_bytes, compress
        self._clock = clock
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._file = None
        self._open()
        leftovers = [p for _, p in rotated_files(self.path) if p.suffix != ".gz"]
        if leftovers and compress:  # a crash interrupted compression last time: finish it now
            self._start_worker(leftovers)

    def _open(self) -> None:
        self._file = open(self.path, "ab")
        self._size = self._file.tell()
        self._opened_at = self._clock()

    def write(self, line: str) -> None:
        """Append one line (newline included) and flush it, rotating first if it is due.
        A line is never split across files, even one longer than ``max_bytes``."""
        data = line.encode("utf-8")
        with self._lock:
            if self._file is None:
                raise ValueError(f"audit trail {self.path} is closed")
            if self._size and (self._size + len(data) > self.max_bytes or self._too_old()):
                self._rotate_locked()
            self._file.write(data)
            self._file.flush()  # a crash loses at most the line being written
            self._size += len(data)

    def _too_old(self) -> bool:
        return self.rotate_interval_s is not None and self._clock() - self._opened_at >= self.rotate_interval_s

    def rotate(self) -> Path | None:
        """Rotate now (an operator hook, e.g. on SIGHUP); returns the rotated file, or None when
        the live file is empty."""
        with self._lock:
            return self._rotate_locked() if self._size else None

    def _rotate_locked(self) -> Path:
        self._file.close()
        numbers = [n for n, _ in rotated_files(self.path)]
        target = self.path.with_name(f"{self.path.name}.{max(numbers, default=0) + 1}")
        os.replace(self.path, target)  # atomic: a reader sees the old name or the new one
        self._open()
        self._start_worker([target] if self.compress else [])
        return target

    def _start_worker(self, to_compress: list[Path]) -> None:
        # One compression at a time; a second rotation within one compression is rare (a
        # max_bytes far too small) and simply waits for the first.
        if self._worker is not None:
            self._worker.join()
        self._worker = threading.Thread(target=self._compress_and_prune, args=(to_compress,),
                                        name=f"audit-rotate-{self.path.name}", daemon=True)
        self._worker.start()

    def _compress_and_prune(self, to_compress: list[Path]) -> None:
        for src in to_compress:
            dst = src.with_name(src.name + ".gz")
            tmp = src.with_name(src.name + ".gz.tmp")  # not matched by rotated_files()
            with open(src, "rb") as fin, gzip.open(tmp, "wb", compresslevel=6) as fout:
                shutil.copyfileobj(fin, fout, 1 << 20)
            os.replace(tmp, dst)
            src.unlink()
        self._prune()

    def _prune(self) -> None:
        """Delete the oldest rotated files beyond ``max_files`` / ``max_total_bytes``."""
        rotated = [p for _, p in rotated_files(self.path)]
        sizes = {p: _size(p) for p in rotated}
        total = sum(sizes.values()) + _size(self.path)
        while rotated and (len(rotated) > self.max_files or
                           (self.max_total_bytes is not None and total > self.max_total_bytes)):
            oldest = rotated.pop(0)
            oldest.unlink(missing_ok=True)
            total -= sizes[oldest]

    def wait(self) -> None:
        """Block until background compression and pruning are done (tests, shutdown)."""
        worker = self._worker
        if worker is not None:
            worker.join()
        self._prune()  # a live file over max_total_bytes is enforced here too, not only on rotation

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None
        self.wait()


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


def _check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value!r}")


# ----------------------------------------------------------------------------- sharing one path
# Engines in one process that log to the same path (``fork()`` keeps ``audit_log``) must share a
# writer: two writers would each rotate the file from under the other.  The registry hands out one
# RotatingFile per resolved path and closes it when its last user does.
_SHARED: dict[Path, list] = {}  # resolved path -> [RotatingFile, number of users]
_SHARED_LOCK = threading.Lock()


def open_shared(path: str | os.PathLike, **params) -> RotatingFile:
    """The process-wide :class:`RotatingFile` for ``path``; pair every call with
    :func:`release_shared`.  A second opener must ask for the same rotation parameters."""
    key = Path(path).resolve()
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None:
            entry = _SHARED[key] = [RotatingFile(path, **params), 0]
            entry[0].shared_key = key
        else:
            wanted = {**ROTATION_DEFAULTS, **{k: v for k, v in params.items() if k != "clock"}}
            if wanted != entry[0].params:
                raise ValueError(f"audit trail {path} is already open with rotation settings "
                                 f"{entry[0].params}, not {wanted}")
        entry[1] += 1
        return entry[0]


def release_shared(writer: RotatingFile) -> None:
    """Give back one use of a shared writer; the last user closes it."""
    key = getattr(writer, "shared_key", None)
    with _SHARED_LOCK:
        entry = _SHARED.get(key)
        if entry is None or entry[0] is not writer:
            writer.close()
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _SHARED[key]
    writer.close()
