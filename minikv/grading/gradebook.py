"""Grade a folder of submissions into a gradebook: ``make grade DIR=submissions/``.

Layout: ``DIR/<student>/`` holds that student's exercise files, named as in ``exercises/``
(``ex1_chained_hash.py`` ...); a missing file counts as the untouched stub.  Each submission is
graded in **its own subprocess** (``python -m minikv.grading.runner ... --strict``) with a timeout,
in a fresh temporary package built from the generated stubs with the student's files on top, so:

* a crash, a hang or an infinite loop costs that submission only (``timeout``, ``error``);
* a submission cannot touch another's grade, or the gradebook (the parent process writes it);
* the strict gate (:mod:`.guard`) reads every file before anything runs and refuses, without
  running it, code that imports the graders or the reference implementations, imports
  process/introspection modules, uses ``open``/``exec``/``setattr``/dunder attributes, or assigns
  to an imported module's attributes (a monkeypatch of the graders or the engine); and the runner
  checks after grading that no function of ``minikv.grading`` or ``minikv.engine`` was replaced.

Limits, stated plainly: code that passes the gate still runs in the grading process; the gate
is a syntax check, not a sandbox.  For hostile submissions, run this inside a container.

Output: ``gradebook.csv`` (one row per student: a pass/fail column per exercise, the total, the
status and the seconds it took) and ``gradebook.json`` (the same plus every grader's verdict, so
an instructor can answer "why did I fail 2b?" without re-running).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .make_exercises import generate
from .runner import EXERCISES

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "submission"


@dataclass
class Row:
    student: str
    status: str  # "graded" | "timeout" | "error"
    seconds: float
    results: dict[str, bool] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)  # files that are not exercise modules
    error: str = ""

    @property
    def passed(self) -> int:
        return sum(self.results.values())


def _stage(submission: Path, work: Path) -> list[str]:
    """Build ``work/submission/``: the stubs, overlaid with the student's exercise files."""
    pkg = work / PACKAGE
    pkg.mkdir()
    stubs = generate()
    for name, text in stubs.items():
        (pkg / name).write_text(text, encoding="utf-8")
    ignored = []
    for path in sorted(submission.rglob("*")):
        if path.is_file() and path.name in stubs and path.name not in ("__init__.py", "grade.py"):
            shutil.copyfile(path, pkg / path.name)
        elif path.is_file() and not path.name.startswith("."):
            ignored.append(str(path.relative_to(submission)))
    return ignored


def grade_submission(submission: Path, timeout: float = 300.0, ids: list[str] | None = None) -> Row:
    """Grade one student's folder in a subprocess; never raises for the student's code."""
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minikv-grade-") as tmp:
        work = Path(tmp)
        ignored = _stage(submission, work)
        out = work / "result.json"
        env = {k: v for k, v in os.environ.items() if k.startswith(("MINIKV_", "HOME", "PATH", "LANG", "LC_"))}
        env.update(PYTHONPATH=f"{work}{os.pathsep}{ROOT}", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "minikv.grading.runner", PACKAGE, *(ids or []), "--json", str(out), "--strict"]
        try:
            done = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return Row(submission.name, "timeout", time.perf_counter() - t0, ignored=ignored,
                       error=f"grading took longer than {timeout:.0f} s (an endless loop?)")
        seconds = time.perf_counter() - t0
        if not out.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            return Row(submission.name, "error", seconds, ignored=ignored,
                       error=f"the grader exited with status {done.returncode}: {' / '.join(tail)}")
        data = json.loads(out.read_text(encoding="utf-8"))
        return Row(submission.name, "graded", seconds, data["results"], data["messages"], ignored,
                   data.get("error", ""))


def grade_folder(folder: Path, out_dir: Path | None = None, timeout: float = 300.0,
                 ids: list[str] | None = None, progress=print) -> list[Row]:
    """Grade every subfolder of ``folder``; write ``gradebook.csv`` and ``gradebook.json``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder of submissions: {folder}")
    students = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not students:
        raise ValueError(f"{folder} holds no submission folders (expected {folder}/<student>/ex1_chained_hash.py ...)")
    rows = []
    for i, student in enumerate(students, 1):
        row = grade_submission(student, timeout, ids)
        rows.append(row)
        progress(f"[{i}/{len(students)}] {row.student}: {row.status}, {row.passed}/{len(row.results)} pass, "
                 f"{row.seconds:.1f} s" + (f" -- {row.error}" if row.error else ""))
    out_dir = Path(out_dir or folder)
    write_gradebook(rows, out_dir, ids)
    mean = sum(r.seconds for r in rows) / len(rows)
    progress(f"gradebook: {out_dir / 'gradebook.csv'} and {out_dir / 'gradebook.json'} "
             f"({len(rows)} submissions, {mean:.1f} s per submission on average)")
    return rows


def write_gradebook(rows: list[Row], out_dir: Path, ids: list[str] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ex_ids = [e.id for e in EXERCISES if not ids or any(e.id.startswith(i) for i in ids)]
    with open(out_dir / "gradebook.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", *ex_ids, "passed", "total", "status", "seconds"])
        for r in rows:
            w.writerow([r.student, *(int(r.results.get(e, False)) for e in ex_ids), r.passed, len(ex_ids),
                        r.status, f"{r.seconds:.1f}"])
    payload = {"exercises": ex_ids, "submissions": [{**asdict(r), "passed": r.passed} for r in rows]}
    (out_dir / "gradebook.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make grade DIR=<folder>", description=__doc__.split("\n")[0])
    ap.add_argument("folder", help="folder with one subfolder of exercise files per student")
    ap.add_argument("ids", nargs="*", help="only these exercises (default: all)")
    ap.add_argument("--out", help="where to write gradebook.csv/.json (default: the folder itself)")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per submission (default 300)")
    a = ap.parse_args(argv)
    try:
        grade_folder(Path(a.folder), Path(a.out) if a.out else None, a.timeout, a.ids or None)
    except (FileNotFoundError, ValueError) as exc:
        print(exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
