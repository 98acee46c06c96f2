"""What a submission folder holds, read before anything in it runs: the gradebook's intake.

A student's folder is staged into a fresh package (the generated stubs, its exercise files on
top) by :func:`stage`, which never follows a link and never opens anything but a regular file:

* a **symbolic link**, a FIFO, a device or a socket is refused by name, whatever it points
  at -- a link into ``solutions/`` would otherwise be graded as the student's own work, a FIFO
  would hang the copy, a device would stream forever;
* a file over :data:`MAX_FILE_BYTES` is refused (the largest reference file is a few KiB);
* a file that **matches the reference** -- byte for byte, or as the same syntax tree once
  comments, docstrings and layout are set aside -- is flagged (:func:`matches_reference`).  The
  solutions are published, so copying cannot be prevented; its points stand, and the gradebook
  shows the match so that the instructor decides.

A refused exercise file is not staged: every check of its module is ``refused`` without running.
"""
from __future__ import annotations

import ast
import hashlib
import os
import stat
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
#: the largest exercise file a submission may hold
MAX_FILE_BYTES = 1 << 20
#: files of the stub package that are not exercises (never listed per student)
NOT_EXERCISES = ("__init__.py", "grade.py")


def refusal(path: Path) -> str | None:
    """Why ``path`` (not followed if a link) cannot be graded, or None for a regular file in bounds."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    if stat.S_ISLNK(st.st_mode):
        return f"is a symbolic link (to {os.readlink(path)}): submit the file itself"
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or \
            stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file"
        return f"is {kind}, not a regular file"
    if st.st_size > MAX_FILE_BYTES:
        return f"is {st.st_size} bytes, over the {MAX_FILE_BYTES} a file may hold"
    return None


def _tree(source: str) -> str | None:
    """The syntax tree of ``source`` without docstrings, positions or comments (None: no parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def matches_reference(name: str, data: bytes) -> str | None:
    """``identical`` or ``same syntax tree`` when ``data`` is the reference solution's file
    ``name`` (comments, docstrings and layout aside), else None."""
    ref = SOLUTIONS / name
    if not ref.is_file():
        return None
    want = ref.read_bytes()
    if data == want:
        return "identical"
    mine, theirs = _tree(data.decode("utf-8", "replace")), _tree(want.decode("utf-8", "replace"))
    return "same syntax tree" if mine is not None and mine == theirs else None


def stage(submission: Path, pkg: Path, stubs: dict[str, str]) -> dict:
    """Fill ``pkg`` with ``stubs`` and the submission's exercise files over them.  Returns
    ``{"files": {name: sha256[:16]}, "ignored": [...], "refused": {name: why}, "matches": {name: how}}``;
    a refused exercise file is not staged (its stub stands, and its checks are refused)."""
    pkg.mkdir()
    for name, text in stubs.items():
        (pkg / name).write_text(text, encoding="utf-8")
    out: dict = {"files": {}, "ignored": [], "refused": {}, "matches": {}}
    for folder, dirs, names in os.walk(submission, followlinks=False):
        here = Path(folder)
        for d in list(dirs):
            if d.startswith(".") or d == "__pycache__":
                dirs.remove(d)
            elif os.path.islink(here / d):  # never followed: listed as refused, nothing inside counts
                out["refused"][str((here / d).relative_to(submission))] = refusal(here / d)
        for name in sorted(names):
            path = here / name
            rel = str(path.relative_to(submission))
            if name.startswith("."):
                continue
            exercise = name in stubs and name not in NOT_EXERCISES
            why = refusal(path)
            if not exercise:  # never read: a link or a FIFO among them is listed as refused, the rest ignored
                if why is not None and not stat.S_ISREG(os.lstat(path).st_mode):
                    out["refused"][rel] = why
                elif name not in NOT_EXERCISES:
                    out["ignored"].append(rel)
                continue
            if why is not None:
                out["refused"][name] = why
                continue
            data = path.read_bytes()
            (pkg / name).write_bytes(data)
            out["files"][name] = hashlib.sha256(data).hexdigest()[:16]
            how = matches_reference(name, data)
            if how:
                out["matches"][name] = how
    for name in out["refused"]:
        if name in out["files"]:  # the same name refused at another depth: refuse it, never grade half
            (pkg / name).write_text(stubs[name], encoding="utf-8")
            del out["files"][name]
            out["matches"].pop(name, None)
    return out
