"""Grade a folder of submissions into a gradebook: ``make grade DIR=submissions/ [JOBS=N]``.

Layout: ``DIR/<student>/`` holds that student's exercise files, named as in ``exercises/``
(``ex1_chained_hash.py`` ...); a missing file counts as the untouched stub.  ``JOBS``
submissions are graded at once (default: the cores this process may use), each by **its own
grader process** (``python -m minikv.grading.runner ... --strict``) with a timeout, in a fresh
temporary package built from the generated stubs with the student's files on top.  That grader
never imports the student's code: every check runs it sealed in a child of its own
(:mod:`.sealed`: fresh interpreter, empty environment, temporary folder, resource limits, a
second Unix user or no capabilities), which only answers calls with data.  So:

* the folder is read before anything runs (:mod:`.intake`): a symbolic link, a FIFO, a device
  or a file over 1 MiB is refused (status ``refused``, its checks never run), and a file that
  matches the reference solution is flagged (``matches_reference``; its points stand);
* a crash, a hang or an endless loop costs that check only: every check has a budget of seconds
  in the learner's code (:func:`.sealed_run.budget`, status ``timeout``, named in ``not_passed``),
  and the submission's own timeout (their sum, plus two minutes) is only a backstop, which kills
  every process below the grader and still removes its temporary folder;
* code that tries to reach the graders, the lab servers, the reference answers or another
  submission finds another process and a file system closed to it (:mod:`._reads`); what it
  tried is reported (status ``tampering``) and the check scores 0;
* nothing a check starts outlives it: the grader is the subreaper of all the learner's
  processes and kills every one when the check ends;
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
  checks had which non-passing status, which files match the reference, the stub version (a
  hash of the generated stubs and the repository's commit), the SHA-256 prefix of every file the
  student submitted, and the time it was graded.  A cell that starts like a formula (``=``,
  ``+``, ``-``, ``@``, tab, CR) gets a leading apostrophe (:func:`csv_cell`).  A re-grade of an unchanged submission gives the same row apart from
  ``graded_at`` (and lab scores move only within the band their graders state).
* ``gradebook.json``: the same plus every grader's verdict, so an instructor can answer "why did
  I fail 2b?" without re-running, the seconds each submission and each check took, the files
  refused and why, and files that are not exercises.
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
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..engine.device import usable_cores
from ._sandbox import end_descendants
from .intake import stage
from .make_exercises import generate
from .runner import EXERCISES, RESULT_MARK, select, sign
from .sealed_run import budget

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "submission"
#: points of each check: the one weights table (a check passed scores its weight, else 0)
WEIGHTS = {"1a": 1, "1b": 2, "2a": 2, "2b": 2, "2c": 2, "2d": 3, "3a": 1, "3b": 3, "3c": 2, "3d": 3, "4a": 1, "4b": 3,
           "5a": 2, "5b": 1, "L1": 4, "L2": 4, "L3": 4, "L4": 3, "C": 8}
#: a student's status is the worst of its checks', in this order
SEVERITY = ("tampering", "error", "timeout", "refused", "failed", "passed")
#: characters that make a spreadsheet read a cell as a formula (OWASP, "CSV Injection")
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
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
    refused: dict[str, str] = field(default_factory=dict)  # file -> why it was refused before anything ran
    matches: dict[str, str] = field(default_factory=dict)  # exercise file -> "identical" / "same syntax tree"
    check_seconds: dict[str, float] = field(default_factory=dict)  # exercise id -> seconds its check took
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


def submission_timeout(ids: list[str] | None = None) -> float:
    """The backstop on one submission: every selected check's budget (:func:`.runner.budget`) and
    two minutes for the grader's own start.  A hanging check already stops at its own budget, so
    this only fires if the grader itself hangs."""
    return sum(budget(e.id) for e in select(ids)) + 120.0


def _refused_row(row: Row, chosen, why_by_file: dict[str, str]) -> list[str]:
    """Mark the checks of refused files as refused (never run); return the ids still to run."""
    run = []
    for e in chosen:
        why = why_by_file.get(f"{e.module}.py")
        if why is None:
            run.append(e.id)
            continue
        row.results[e.id], row.statuses[e.id] = False, "refused"
        row.messages[e.id] = f"❌ {e.check.__name__}: not graded -- {e.module}.py {why}"
    return run


def grade_submission(submission: Path, timeout: float | None = None, ids: list[str] | None = None) -> Row:
    """Grade one student's folder in a grader subprocess; never raises for the student's code.

    Files that are links, FIFOs, devices or too large are refused before anything runs
    (:mod:`.intake`).  The grader's temporary files (every sealed child's folder) live inside this
    submission's own temporary folder, removed whatever happens, a timeout included; on a
    timeout every process below the grader is killed with it."""
    t0 = time.perf_counter()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    timeout = submission_timeout(ids) if timeout is None else timeout
    chosen = select(ids)
    with tempfile.TemporaryDirectory(prefix="minikv-grade-") as tmp:
        work = Path(tmp)
        if os.path.islink(submission):
            why = {f"{e.module}.py": f"is in a folder that is a symbolic link (to {os.readlink(submission)})"
                   for e in chosen}
            found = {"files": {}, "ignored": [], "refused": {submission.name: why[next(iter(why))]}, "matches": {}}
        else:
            found = stage(submission, work / PACKAGE, generate())
            why = found["refused"]
        row = Row(submission.name, "error", 0.0, files=found["files"], ignored=found["ignored"],
                  refused=found["refused"], matches=found["matches"], graded_at=when)
        run = _refused_row(row, chosen, why)
        if not run or _run_grader(row, submission, work, run, timeout):
            row.status = min((row.statuses.get(e, "passed" if ok else "failed") for e, ok in row.results.items()),
                             key=SEVERITY.index, default="passed")
        row.seconds = time.perf_counter() - t0
    return row


def _run_grader(row: Row, submission: Path, work: Path, ids: list[str], timeout: float) -> bool:
    """Run the grader on ``work/submission`` for ``ids``; fill ``row`` from its signed result.
    False (and ``row.status`` set) when there is none: a timeout, a crash, a forged result."""
    key = os.urandom(32)
    (work / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k.startswith(("MINIKV_", "HOME", "PATH", "LANG", "LC_"))}
    env.update(PYTHONPATH=f"{work}{os.pathsep}{ROOT}", PYTHONDONTWRITEBYTECODE="1", OMP_NUM_THREADS="1",
               TMPDIR=str(work / "tmp"), MINIKV_SUBMISSIONS=os.path.realpath(submission.parent))
    cmd = [sys.executable, "-m", "minikv.grading.runner", PACKAGE, *ids, "--json", "-", "--strict", "--sign-stdin"]
    proc = subprocess.Popen(cmd, cwd=work, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(key.hex() + "\n", timeout=timeout)
    except subprocess.TimeoutExpired:
        os.kill(proc.pid, signal.SIGSTOP)  # it starts nothing more while what it started is ended
        end_descendants(proc.pid)
        proc.kill()
        proc.communicate()
        row.status, row.error = "timeout", f"grading took longer than {timeout:.0f} s (the grader itself hung)"
        return False
    if RESULT_MARK not in out:
        tail = (err or out).strip().splitlines()[-3:]
        row.error = f"the grader exited with status {proc.returncode}: {' / '.join(tail)}"
        return False
    try:
        data = json.loads(out.rsplit(RESULT_MARK, 1)[1].strip().splitlines()[0])
        genuine = hmac.compare_digest(str(data.get("sig", "")), sign(data, key))
    except (ValueError, TypeError, AttributeError):
        data, genuine = {}, False
    if not genuine:
        row.status = "tampering"
        row.error = "tampering: the result was not written by the grader (its signature does not match)"
        return False
    row.results.update(data["results"])
    row.messages.update(data["messages"])
    row.statuses.update(data.get("statuses", {}))
    row.check_seconds.update(data.get("seconds", {}))
    row.error = data.get("error", "")
    return True


def default_jobs() -> int:
    return usable_cores()


def grade_folder(folder: Path, out_dir: Path | None = None, timeout: float | None = None,
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
                    "not_passed", "matches_reference", "stub_version", "files", "graded_at"])
        for r in rows:
            not_passed = " ".join(f"{e}:{r.statuses.get(e, 'failed')}" for e in ex_ids
                                  if e in r.results and not r.results[e])
            w.writerow([csv_cell(c) for c in (
                r.student, *(r.points(e) for e in ex_ids), sum(r.points(e) for e in ex_ids),
                sum(WEIGHTS.get(e, 1) for e in ex_ids), *(r.lab_score(e) for e in labs), r.status,
                not_passed or r.error, " ".join(f"{n}:{how}" for n, how in sorted(r.matches.items())), version,
                " ".join(f"{n}:{h}" for n, h in sorted(r.files.items())), r.graded_at)])
    payload = {"exercises": ex_ids, "weights": {e: WEIGHTS.get(e, 1) for e in ex_ids}, "stub_version": version,
               "submissions": [{**asdict(r), "passed": r.passed} for r in rows]}
    (out_dir / "gradebook.json").write_text(json.dumps(payload, indent=1, ensure_ascii=False), encoding="utf-8")


def csv_cell(value):
    """A cell a spreadsheet shows as text: one that starts like a formula (:data:`FORMULA_START`)
    gets a leading apostrophe, as OWASP's CSV-injection guidance says (a student folder named
    ``=2+3`` stays the text ``=2+3``).  Numbers pass as they are."""
    if isinstance(value, str) and value.startswith(FORMULA_START):
        return "'" + value
    return value


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make grade DIR=<folder>", description=__doc__.split("\n")[0])
    ap.add_argument("folder", help="folder with one subfolder of exercise files per student")
    ap.add_argument("ids", nargs="*", help="only these exercises (default: all)")
    ap.add_argument("--out", help="where to write gradebook.csv/.json (default: the folder itself)")
    ap.add_argument("--timeout", type=float, default=None,
                    help="seconds per submission, a backstop (default: the checks' budgets summed, plus 120)")
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
