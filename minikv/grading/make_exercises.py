"""Generate ``exercises/`` from ``solutions/`` (one source for both).

    python -m minikv.grading.make_exercises          # (re)write exercises/
    python -m minikv.grading.make_exercises --check  # exit 1 if exercises/ is out of date

Every ``solutions/*.py`` file is copied to ``exercises/`` with each region

    # BEGIN SOLUTION
    ...
    # END SOLUTION

replaced by ``raise NotImplementedError("...")`` at the indentation of the ``BEGIN`` line (a
region may extend past the end of its function: helper functions it contains disappear with
it).  A region whose ``BEGIN`` line is not indented is dropped without replacement.  Files
without markers (``grade.py``) are copied unchanged, apart from the generated-file header.
``exercises/__init__.py`` is written from :data:`EXERCISES_INIT`.  Output is deterministic, so
``tests/test_grading.py`` can check that the committed ``exercises/`` is exactly what this
script generates.

Learners' work is safe: every generated file ends its header with a *version stamp*,
``# minikv-stub: <sha256 of the generated body>``.  Regenerating never overwrites a file whose
body no longer matches its stamp (the learner edited it, or it has no stamp at all): the new
version is written beside it as ``<name>.new`` and the command says which files it left alone.
"""
from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"

BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
_DEF = re.compile(r"^(\s*)(?:async\s+)?(def|class)\s+([A-Za-z_]\w*)")

COPY_HEADER = (
    "# GENERATED from solutions/{name} by `python -m minikv.grading.make_exercises` (copied unchanged).\n"
    "# Course maintainers: edit solutions/{name} and regenerate; never edit this file by hand.\n"
)
HEADER = (
    "# GENERATED from solutions/{name} by `python -m minikv.grading.make_exercises`.\n"
    "# This file is yours: replace every `raise NotImplementedError` with your implementation,\n"
    "# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the\n"
    "# reference solution uses.  Course maintainers: edit solutions/{name} and regenerate; never\n"
    "# edit this file by hand.\n"
)

EXERCISES_INIT = '''"""Your exercises for the minikv course (lessons 07 and 08).

Each module holds stubs that raise ``NotImplementedError``; their docstrings state the contract
and give hints.  Implement them, then grade:

    make grade                      # every exercise, with a summary table
    python -m exercises.grade 2b    # only exercise 2b

Lessons 07 and 08 run the same graders cell by cell.  The reference implementations are in
``solutions/`` (same names): peek only after trying.  This package is generated from
``solutions/`` by ``python -m minikv.grading.make_exercises``.
"""
'''


STAMP = "# minikv-stub: "


def _stamped(header: str, body: str) -> str:
    """``header`` + the version stamp of ``body`` + ``body``."""
    return f"{header}{STAMP}{hashlib.sha256(body.encode('utf-8')).hexdigest()[:16]}\n{body}"


def is_pristine(text: str) -> bool:
    """Is ``text`` a generated file nobody has edited since (its body still matches its stamp)?"""
    head, sep, rest = text.partition(STAMP)
    if not sep or "\n" not in rest:
        return False
    stamp, body = rest.split("\n", 1)
    return hashlib.sha256(body.encode("utf-8")).hexdigest()[:16] == stamp.strip()


class MarkerError(ValueError):
    """Unbalanced or misplaced solution markers."""


def _enclosing(lines: list[str], index: int, indent: int) -> str:
    """Qualified name of the def/class that contains line ``index`` (indented ``indent``)."""
    names, limit = [], indent
    for line in reversed(lines[:index]):
        m = _DEF.match(line)
        if m and len(m.group(1)) < limit:
            names.append(m.group(3))
            limit = len(m.group(1))
            if limit == 0:
                break
    return ".".join(reversed(names)) or "this exercise"


def strip_solutions(source: str, filename: str = "<source>") -> str:
    """Return ``source`` with every solution region replaced by a stub."""
    lines = source.splitlines(keepends=True)
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped == END:
            raise MarkerError(f"{filename}:{i + 1}: {END} without {BEGIN}")
        if stripped != BEGIN:
            if BEGIN in line or END in line:
                raise MarkerError(f"{filename}:{i + 1}: a marker must be alone on its line")
            out.append(line)
            i += 1
            continue
        indent = line[:len(line) - len(line.lstrip())]
        j = i + 1
        while j < len(lines) and lines[j].strip() != END:
            if lines[j].strip() == BEGIN:
                raise MarkerError(f"{filename}:{j + 1}: nested {BEGIN}")
            j += 1
        if j == len(lines):
            raise MarkerError(f"{filename}:{i + 1}: {BEGIN} without {END}")
        if lines[j][:len(lines[j]) - len(lines[j].lstrip())] != indent:
            raise MarkerError(f"{filename}:{j + 1}: {END} must be indented like its {BEGIN} (line {i + 1})")
        if indent:
            name = _enclosing(lines, i, len(indent))
            out.append(f'{indent}raise NotImplementedError("{name}: not implemented yet '
                       f'(read the docstring, then write your code here)")\n')
        i = j + 1
    return "".join(out)


def generate(solutions: Path = SOLUTIONS) -> dict[str, str]:
    """``{file name: text}`` of every file of ``exercises/`` (deterministic)."""
    files = {"__init__.py": _stamped("", EXERCISES_INIT)}
    for path in sorted(solutions.glob("*.py")):
        if path.name == "__init__.py":
            continue
        source = path.read_text(encoding="utf-8")
        text = strip_solutions(source, str(path))
        header = HEADER if text != source else COPY_HEADER
        files[path.name] = _stamped(header.format(name=path.name), text)
    return files


def stale_files(exercises: Path = EXERCISES, solutions: Path = SOLUTIONS) -> list[str]:
    """Names of files in ``exercises`` that differ from (or are missing in) the generated set."""
    wanted = generate(solutions)
    stale = [name for name, text in wanted.items()
             if not (exercises / name).is_file() or (exercises / name).read_text(encoding="utf-8") != text]
    extra = [p.name for p in sorted(exercises.glob("*.py")) if p.name not in wanted]
    return stale + extra


def write(exercises: Path = EXERCISES, solutions: Path = SOLUTIONS) -> tuple[list[str], list[str]]:
    """(Re)write ``exercises``; return (names written, names kept because the learner edited them).

    A file whose body no longer matches its version stamp is never overwritten: the new version
    goes to ``<name>.new`` beside it."""
    exercises.mkdir(exist_ok=True)
    written, kept = [], []
    for name, text in generate(solutions).items():
        path = exercises / name
        old = path.read_text(encoding="utf-8") if path.is_file() else None
        if old is None or old == text or is_pristine(old):
            if old != text:
                path.write_text(text, encoding="utf-8")
                written.append(name)
            continue
        (exercises / f"{name}.new").write_text(text, encoding="utf-8")
        kept.append(name)
    return written, kept


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minikv.grading.make_exercises", description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="only check that exercises/ is up to date")
    args = ap.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"exercises/ is out of date: {', '.join(stale)}; run python -m minikv.grading.make_exercises")
            return 1
        print("exercises/ is up to date")
        return 0
    written, kept = write()
    for name in written:
        print(f"wrote exercises/{name}")
    for name in kept:
        print(f"kept exercises/{name}: it holds your edits (its version stamp no longer matches), so it was "
              f"NOT overwritten; the new version is exercises/{name}.new -- merge by hand, then delete the .new")
    if not written and not kept:
        print("exercises/ is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
