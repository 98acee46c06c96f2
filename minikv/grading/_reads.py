"""What a sealed check may read: the interpreter and its libraries, the given modules, its own folder.

A sealed child (:mod:`.sealed`) runs a stranger's code, and what that code can *read* decides
what it can hand in as its own: the reference answers in ``solutions/``, the engine's reference
modules (reached by whatever name, a re-export included), another student's staged files, the
graders' temporary folders.  So the child's file system is an allow-list, enforced by Landlock's
read rights (:func:`._sandbox.confine`) where the kernel has them:

* the interpreter, its standard library and site-packages, and the system's libraries and
  configuration (``/usr``, ``/lib``, ``/etc`` ...), to read and execute;
* ``/dev`` and ``/sys`` (devices, CPU topology), and of ``/proc`` only the machine-wide
  :data:`PROC_FILES` -- no process's entries at all, its own included, so no other process's
  command line, memory or sockets;
* the ``minikv`` package *except* the modules closed for this check (:func:`closed_paths`): the
  reference of what the check grades, and the graders;
* the child's own temporary folder, which holds its copy of the learner's files.

Landlock only *grants*: a folder that is open is open with everything beneath it.  So a folder
that holds a closed module is opened name by name -- listing it stays allowed (the names are
public), reading is granted file by file and subfolder by subfolder, never to a closed one.
The same closed paths feed the child's import system (:mod:`._sealed_child`), which refuses a
closed module by its file, whichever name or re-export reaches it, and says so.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MINIKV = ROOT / "minikv"

# Landlock's file-system rights (the kernel's LANDLOCK_ACCESS_FS_* bits)
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR, TRUNCATE = 1 << 0, 1 << 1, 1 << 2, 1 << 3, 1 << 14
READ = READ_FILE | READ_DIR
#: the file-only rights (a rule on a file, not a folder, may grant only these)
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | (1 << 15)

#: read and executed by the interpreter and the libraries it loads
SYSTEM = ("/usr", "/lib", "/lib32", "/lib64", "/bin", "/sbin", "/etc")
#: machine-wide /proc files numpy, torch and the C library read (CPU and memory counts)
PROC_FILES = ("/proc/cpuinfo", "/proc/meminfo", "/proc/stat")

#: the files of the graders' package a check may read: the plumbing an exercise file may import
OPEN_GRADING = ("__init__.py", "harness.py")


def module_path(name: str) -> Path | None:
    """The file or package folder of ``minikv.x.y`` inside this repository (None if outside it)."""
    parts = name.split(".")
    if parts[0] != "minikv":
        return ROOT / parts[0] if parts[0] == "solutions" else None
    base = ROOT.joinpath(*parts)
    return base if base.is_dir() else base.with_suffix(".py")


def closed_paths(modules) -> list[str]:
    """Real paths of the files and folders a check may not read: the given module names (files
    or whole packages), the graders but for :data:`OPEN_GRADING`, and ``solutions/``."""
    paths = {os.path.realpath(ROOT / "solutions")}
    for name in modules:
        p = module_path(name)
        if p is not None and p.exists():
            paths.add(os.path.realpath(p))
    grading = MINIKV / "grading"
    # not __pycache__ as a whole: a closed grader's bytecode is closed by is_closed's bytecode rule,
    # and an open grader's (harness) must stay readable, or importing it reads as tampering
    paths.update(os.path.realpath(p) for p in grading.iterdir() if p.name not in (*OPEN_GRADING, "__pycache__"))
    return sorted(paths)


def is_closed(path: str, closed: list[str]) -> bool:
    """Whether ``path`` is, or lies beneath, a closed path -- or is the compiled bytecode of one
    (``__pycache__/detector.cpython-311.pyc`` is the reference as much as ``detector.py``)."""
    real = os.path.realpath(path)
    if any(real == c or real.startswith(c + os.sep) for c in closed):
        return True
    folder, name = os.path.split(real)
    if os.path.basename(folder) == "__pycache__":
        source = os.path.join(os.path.dirname(folder), name.split(".")[0])
        return any(c in (source, source + ".py") for c in closed)
    return False


def _holds_closed(folder: Path, closed: list[str]) -> bool:
    real = os.path.realpath(folder)
    return any(c == real or c.startswith(real + os.sep) for c in closed)


def _open_tree(folder: Path, closed: list[str], rules: list) -> None:
    """Rules that open ``folder`` for reading except its closed entries."""
    bytecode = folder.name == "__pycache__" and any(is_closed(str(e), closed) for e in folder.iterdir())
    if not _holds_closed(folder, closed) and not bytecode:
        rules.append((str(folder), READ))
        return
    rules.append((str(folder), READ_DIR))  # its names stay listable; reading is granted entry by entry
    for entry in sorted(folder.iterdir()):
        if entry.is_symlink() or is_closed(str(entry), closed):
            continue
        if entry.is_dir():
            _open_tree(entry, closed, rules)
        elif entry.is_file():
            rules.append((str(entry), READ_FILE))


def interpreter_roots() -> list[str]:
    """The folders of this interpreter: its prefix, its base prefix (a venv's) and its binary's."""
    roots = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix)}
    roots.add(os.path.dirname(os.path.dirname(os.path.realpath(sys.executable))))
    return sorted(roots)


def read_rules(closed: list[str]) -> list[tuple[str, int]]:
    """``[(path, Landlock rights), ...]``: every read a sealed check is granted (its own folder
    is added by :func:`._sandbox.confine`, with every right)."""
    rules: list[tuple[str, int]] = []
    for root in (*SYSTEM, *interpreter_roots()):
        if os.path.isdir(root):
            rules.append((root, READ | EXECUTE))  # one that holds a closed path: see leaks()
    rules += [("/dev", READ), ("/sys", READ)] + [(f, READ_FILE) for f in PROC_FILES]
    _open_tree(MINIKV, closed, rules)
    return rules


def leaks(closed: list[str]) -> list[str]:
    """Closed paths an interpreter root makes readable anyway (minikv installed inside the
    interpreter's own folder, say): Landlock cannot close them, only the import system can."""
    roots = [r for r in (*SYSTEM, *interpreter_roots()) if os.path.isdir(r)]
    return [c for c in closed if any(c.startswith(os.path.realpath(r) + os.sep) for r in roots)]
