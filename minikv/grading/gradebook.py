"""Grade a folder of submissions into a gradebook: ``make grade DIR=submissions/ [JOBS=N]``.

Layout: ``DIR/<student>/`` holds that student's exercise files, named as in ``exercises/``
(``ex1_chained_hash.py`` ...); a missing file counts as the untouched stub.  ``JOBS``
submissions are graded at once (default: the cores this process may use), each by **its own
grader process** (``python -m minikv.grading.runner ... --strict``) with a timeout, in a fresh
temporary package built from the generated stubs with the student's files on top.  That grader
never imports the student's code: every check runs it sealed in a child of its own
(:mod:`.sealed`: fresh interpreter, empty environment, temporary folder, resource limits, a
second Unix user or no capabilities), which only answers calls with data.  So:

* a crash, a hang or an endless loop costs that check only (status ``timeout`` / ``failed``);
* code that tries to reach the graders, the lab servers or this gradebook finds another process;
  what it tried is reported (status ``tampering``) and the check scores 0;
* the grader's result reaches this process on the grader's stdout (no file), signed with a key
  only the two of them hold (sent on the grader's stdin, never written down; both processes are
  non-dumpable): a forged result is ``tampering`` too;
* the strict gate (:mod:`.guard`) still reads every file first, for a friendly early message
  (status ``refused``);
* a check whose own machinery failed (a lab server that would not start or stop in time on a
  loaded machine) gives no verdict on the code: status ``error``, and that student wants a regrade.

Output, in ``DIR`` (or ``--out``):

* ``gradebook.csv``: one row per student -- the points of every check (weights: :data:`WEIGHTS`,
  the one table), the total, the lab scores (``L1_score`` ...: the graders' "score N.NNx"), a
  status (passed / failed / refused / timeout / tampering / error: the worst check's), which
  checks had which non-passing status, the stub version (a hash of the generated stubs and the
  repository's commit), the SHA-256 prefix of every file the student submitted, and the time
  it was graded.  A re-grade of an unchanged submission gives the same row apart from
  ``graded_at`` (and lab scores move only within the band their graders state).
* ``gradebook.json``: the same plus every grader's verdict, so an instructor can answer "why did
  I fail 2b?" without re-running, the seconds each took, and files that are not exercises.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import csv
import datetime
import hashlib
import hmac
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engine.device import usable_cores
from .make_exercises import generate
from .runner import EXERCISES, RESULT_MARK, sign

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "submission"
#: points of each check: the one weights table (a check passed scores its weight, else 0)
WEIGHTS = {"1a": 1, "1b": 2, "2a": 2, "2b": 2, "2c": 2, "2d": 3, "3a": 1, "3b": 3, "3c": 2, "3d": 3, "4a": 1, "4b": 3,
           "5a": 2, "5b": 1, "L1": 4, "L2": 4, "L3": 4, "L4": 3, "C": 8}
#: a student's status is the worst of its checks', in this order
SEVERITY = ("tampering", "error", "timeout", "refused", "failed", "passed")
#: files of the stub package that are not exercises (never listed per student)
NOT_EXERCISES = ("__init__.py", "grade.py")
_SCORE = re.compile(r"score (\d+(?:\.\d+)?)x")


@dataclass
class Row:
    student: str
    status: str  # one of SEVERITY
    seconds: float
    results: dict[str, bool] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)  # exercise id -> one of SEVERITY
    files: dict[str, str] = field(default_factory=dict)  # submitted exercise file -> sha256 (16 hex)
    ignored: list[str] = field(default_factory=list)  # other files in the folder (JSON only)
    error: str = ""
    graded_at: str = ""

    @property
    def passed(self) -> int:
        return sum(self.results.values())

    def points(self, ex_id: str) -> int:
        return WEIGHTS.get(ex_id, 1) if self.results.get(ex_id) else 0

    def lab_score(self, ex_id: str) -> str:
        m = _SCORE.search(self.messages.get(ex_id, "")) if self.results.get(ex_id) else None
        return m.group(1) if m else ""


def stub_version() -> str:
    """``<hash of the generated stubs>@<commit>``: which exercises a gradebook was graded against."""
    digest = hashlib.sha256()
    for name, text in sorted(generate().items()):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        commit = "unknown"
    return f"{digest.hexdigest()[:12]}@{commit}"


def _stage(submission: Path, work: Path) -> tuple[dict[str, str], list[str]]:
    """Build ``work/submission/``: the stubs, overlaid with the student's exercise files.
    Returns (exercise file -> its hash, other files found)."""
    pkg = work / PACKAGE
    pkg.mkdir()
    stubs = generate()
    for name, text in stubs.items():
        (pkg / name).write_text(text, encoding="utf-8")
    files, ignored = {}, []
    for path in sorted(submission.rglob("*")):
        if not path.is_file() or path.name.startswith(".") or "__pycache__" in path.parts:
            continue
        if path.name in stubs and path.name not in NOT_EXERCISES:
            shutil.copyfile(path, pkg / path.name)
            files[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
        elif path.name not in NOT_EXERCISES:
            ignored.append(str(path.relative_to(submission)))
    return files, ignored


def grade_submission(submission: Path, timeout: float = 300.0, ids: list[str] | None = None) -> Row:
    """Grade one student's folder in a grader subprocess; never raises for the student's code."""
    t0 = time.perf_counter()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    with tempfile.TemporaryDirectory(prefix="minikv-grade-") as tmp:
        work = Path(tmp)
        files, ignored = _stage(submission, work)
        key = os.urandom(32)
        env = {k: v for k, v in os.environ.items() if k.startswith(("MINIKV_", "HOME", "PATH", "LANG", "LC_"))}
        env.update(PYTHONPATH=f"{work}{os.pathsep}{ROOT}", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1")
        cmd = [sys.executable, "-m", "minikv.grading.runner", PACKAGE, *(ids or []), "--json", "-", "--strict",
               "--sign-stdin"]
        row = Row(submission.name, "error", 0.0, files=files, ignored=ignored, graded_at=when)
        try:
            done = subprocess.run(cmd, cwd=work, env=env, input=key.hex() + "\n", capture_output=True, text=True,
                                  timeout=timeout, start_new_session=True)
        except subprocess.TimeoutExpired:
            row.status, row.error = "timeout", f"grading took longer than {timeout:.0f} s (an endless loop?)"
            row.seconds = time.perf_counter() - t0
            return row
        row.seconds = time.perf_counter() - t0
        if RESULT_MARK not in done.stdout:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            row.error = f"the grader exited with status {done.returncode}: {' / '.join(tail)}"
            return row
        try:
            data = json.loads(done.stdout.rsplit(RESULT_MARK, 1)[1].strip().splitlines()[0])
            genuine = hmac.compare_digest(str(data.get("sig", "")), sign(data, key))
        except (ValueError, TypeError, AttributeError):
            data, genuine = {}, False
        if not genuine:
            row.status = "tampering"
            row.error = "tampering: the result was not written by the grader (its signature does not match)"
            return row
        row.results, row.messages, row.statuses = data["results"], data["messages"], data.get("statuses", {})
        row.error = data.get("error", "")
        row.status = min((row.statuses.get(e, "passed" if ok else "failed") for e, ok in row.results.items()),
                         key=SEVERITY.index, default="passed")
        return row


def default_jobs() -> int:
    return usable_cores()


def grade_folder(folder: Path, out_dir: Path | None = None, timeout: float = 300.0,
                 ids: list[str] | None = None, progress=print, jobs: int | None = None) -> list[Row]:
    """Grade every subfolder of ``folder``, ``jobs`` at a time; write ``gradebook.csv`` and ``.json``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no such folder of submissions: {folder}")
    jobs = default_jobs() if jobs is None else jobs
    if not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"JOBS must be a whole number >= 1, got {jobs!r}")
    students = sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not students:
        raise ValueError(f"{folder} holds no submission folders (expected {folder}/<student>/ex1_chained_hash.py ...)")
    from .sealed import isolation, make_undumpable

    make_undumpable()  # this process holds every grader's signing key
    progress(f"grading {len(students)} submissions, {jobs} at a time; {isolation()}")
    t0 = time.perf_counter()
    rows: dict[str, Row] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = {pool.submit(grade_submission, s, timeout, ids): s for s in students}
        for i, fut in enumerate(concurrent.futures.as_completed(futures), 1):
            row = fut.result()
            rows[row.student] = row
            progress(f"[{i}/{len(students)}] {row.student}: {row.status}, {row.passed}/{len(row.results)} pass, "
                     f"{row.seconds:.1f} s" + (f" -- {row.error}" if row.error else ""))
    ordered = [rows[s.name] for s in students]
    out_dir = Path(out_dir or folder)
    write_gradebook(ordered, out_dir, ids)
    wall = time.perf_counter() - t0
    progress(f"gradebook: {out_dir / 'gradebook.csv'} and {out_dir / 'gradebook.json'} "
             f"({len(rows)} submissions in {wall:.0f} s with {jobs} jobs, {wall / len(rows):.1f} s per submission)")
    return ordered


def write_gradebook(rows: list[Row], out_dir: Path, ids: list[str] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    ex_ids = [e.id for e in EXERCISES if not ids or any(e.id.startswith(i) for i in ids)]
    labs = [e for e in ex_ids if e.startswith("L")]
    version = stub_version()
    with open(out_dir / "gradebook.csv", "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["student", *ex_ids, "points", "max_points", *(f"{e}_score" for e in labs), "status",
                    "not_passed", "stub_version", "files", "graded_at"])
        for r in rows:
            not_passed = " ".join(f"{e}:{r.statuses.get(e, 'failed')}" for e in ex_ids
                                  if e in r.results and not r.results[e])
            w.writerow([r.student, *(r.points(e) for e in ex_ids), sum(r.points(e) for e in ex_ids),
                        sum(WEIGHTS.get(e, 1) for e in ex_ids), *(r.lab_score(e) for e in labs), r.status,
                        not_passed or r.error, version, " ".join(f"{n}:{h}" for n, h in sorted(r.files.items())),
                        r.graded_at])
    payload = {"exercises": ex_ids, "weights": {e: WEIGHTS.get(e, 1) for e in ex_ids}, "stub_version": version,
               "submissions": [{**asdict(r), "passed": r.passed} for r in rows]}
    (out_dir / "gradebook.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make grade DIR=<folder>", description=__doc__.split("\n")[0])
    ap.add_argument("folder", help="folder with one subfolder of exercise files per student")
    ap.add_argument("ids", nargs="*", help="only these exercises (default: all)")
    ap.add_argument("--out", help="where to write gradebook.csv/.json (default: the folder itself)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per submission (default 600)")
    ap.add_argument("--jobs", type=int, default=None, help=f"submissions at once (default: {default_jobs()}, the cores)")
    a = ap.parse_args(argv)
    try:
        grade_folder(Path(a.folder), Path(a.out) if a.out else None, a.timeout, a.ids or None, jobs=a.jobs)
    except (FileNotFoundError, ValueError) as exc:
        print(exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
