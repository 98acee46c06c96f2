"""Where a sealed child runs: which Unix user, which powers, which limits (see :mod:`.sealed`).

As root, learner children run as a second user (:func:`sandbox_user`) when the interpreter and
``minikv/`` are readable by others; otherwise (or without root) they keep the grader's user, with
every capability dropped when that user is root (:func:`drop_root_powers`), and the graders, the
lab servers and the fleet make themselves non-dumpable (:func:`make_undumpable`).
:func:`isolation` says, in one line for the grading output, which of these holds.
"""
from __future__ import annotations

import os
import pwd
import resource
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SANDBOX_USER = "minikv-sandbox"
#: per child: CPU seconds, address space, open files, bytes a file may grow to
LIMITS = {"cpu_s": 600, "memory_bytes": 8 << 30, "files": 256, "file_bytes": 256 << 20}


def make_undumpable() -> bool:
    """``prctl(PR_SET_DUMPABLE, 0)``: no other process of this user may read this one's memory or
    ``/proc`` files.  True when it took effect (Linux)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _open_to_others(path: Path) -> bool:
    """Whether a user with no group in common could execute ``path`` (every folder above it too)."""
    import stat

    real = Path(os.path.realpath(path))
    try:
        if not real.stat().st_mode & stat.S_IROTH or not real.stat().st_mode & stat.S_IXOTH:
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in real.parents)
    except OSError:
        return False


def why_no_second_user() -> str | None:
    """Why learner children cannot run as a second user here, or None when they can."""
    if os.geteuid() != 0:
        return "the grader is not root"
    for need in (Path(sys.executable), ROOT / "minikv" / "__init__.py"):
        if not _open_to_others(need):
            return f"{os.path.realpath(need)} is not readable by another user"
    return None


def sandbox_user() -> pwd.struct_passwd | None:
    """The user learner children run as: ``minikv-sandbox`` (created if absent), else ``nobody``;
    None when :func:`why_no_second_user` has a reason."""
    if why_no_second_user() is not None:
        return None
    for attempt in range(2):
        try:
            return pwd.getpwnam(SANDBOX_USER)
        except KeyError:
            if attempt == 0 and shutil.which("useradd"):
                subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin",
                                SANDBOX_USER], capture_output=True)
    try:
        return pwd.getpwnam("nobody")
    except KeyError:
        return None


def isolation() -> str:
    """One line for the grading output: which separation protects the grader from the learner."""
    user = sandbox_user()
    if user is not None:
        return (f"sealed: learner code runs as user {user.pw_name} (uid {user.pw_uid}), apart from the graders "
                "and the lab servers (root)")
    root = " without any capability (uid 0, no CAP_SYS_PTRACE/CAP_DAC_OVERRIDE)" if os.geteuid() == 0 else ""
    return (f"sealed: no second Unix user ({why_no_second_user()}), so learner code runs as this user{root}; the graders "
            "and lab servers are non-dumpable (their memory and /proc entries are closed to it) and the lab "
            "secrets are drawn inside the servers, never written anywhere")


def drop_root_powers() -> None:
    """For a child that must stay uid 0 (no second user can run this interpreter): drop every
    capability from the bounding and ambient sets and forbid regaining any (``no_new_privs``), so
    after ``exec`` it holds none -- no ``CAP_SYS_PTRACE`` (a non-dumpable grader or lab server is
    closed to it) and no ``CAP_DAC_OVERRIDE`` (other users' 0700 folders are closed)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        libc.prctl(24, cap, 0, 0, 0)  # PR_CAPBSET_DROP (fails harmlessly past the last capability)
    libc.prctl(47, 4, 0, 0, 0)  # PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL
    libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS


def _limits() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL: it dies with its grader
    if os.geteuid() == 0:  # still root here: a second user was not possible (see isolation())
        drop_root_powers()
    for what, value in ((resource.RLIMIT_CPU, LIMITS["cpu_s"]), (resource.RLIMIT_AS, LIMITS["memory_bytes"]),
                        (resource.RLIMIT_NOFILE, LIMITS["files"]), (resource.RLIMIT_FSIZE, LIMITS["file_bytes"])):
        resource.setrlimit(what, (value, value))
