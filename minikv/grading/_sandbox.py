"""Where a sealed child runs: which Unix user, which powers, which limits (see :mod:`.sealed`).

As root, learner children run as a second user (:func:`sandbox_user`) when the interpreter and
``minikv/`` are readable by others; otherwise (or without root) they keep the grader's user, with
every capability dropped when that user is root (:func:`drop_root_powers`), and the graders, the
lab servers and the fleet make themselves non-dumpable (:func:`make_undumpable`).

Either way a Landlock ruleset (:func:`confine_writes`, Linux 5.13+) then closes the whole file
system to the child's writes except its own temporary folder, and (Linux 6.12+) keeps its
signals inside its own process tree.  A uid-0 child without capabilities still *owns* every
root-owned file, so without Landlock it could rewrite the graders' sources for the next
submission, or kill its grader; with it, it can do neither.
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
    abi = landlock_abi()
    walls = (f"; Landlock (ABI {abi}) closes every file outside its own temporary folder to its writes"
             + (" and its signals stay inside its own processes" if abi >= 6 else "")) if abi else \
        "; no Landlock in this kernel, so files its user owns stay writable to it"
    user = sandbox_user()
    if user is not None:
        return (f"sealed: learner code runs as user {user.pw_name} (uid {user.pw_uid}), apart from the graders "
                f"and the lab servers (root){walls}")
    root = " without any capability (uid 0, no CAP_SYS_PTRACE/CAP_DAC_OVERRIDE)" if os.geteuid() == 0 else ""
    return (f"sealed: no second Unix user ({why_no_second_user()}), so learner code runs as this user{root}{walls}; "
            "the graders and lab servers are non-dumpable (their memory and /proc entries are closed to it) and the "
            "lab secrets are drawn inside the servers, never written anywhere")


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


#: Landlock's file-system rights that change something (the kernel's ``LANDLOCK_ACCESS_FS_*`` bits,
#: by the ABI version that introduced them): reading and executing stay open everywhere
_WRITE_RIGHTS = {1: (1 << 1) | sum(1 << b for b in range(4, 13)),  # write, remove, make dir/file/node/link
                 2: 1 << 13,  # REFER: link or rename a file into another folder
                 3: 1 << 14}  # TRUNCATE
_SCOPE_SIGNAL = 1 << 1  # ABI 6: signals only to processes of the same Landlock domain


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (not Linux x86-64/arm64, too old,
    or disabled at boot)."""
    import ctypes
    import platform

    if sys.platform != "linux" or platform.machine() not in ("x86_64", "aarch64"):
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    abi = libc.syscall(444, None, 0, 1)  # landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)
    return max(abi, 0)


def confine_writes(writable: str) -> int:
    """Restrict this process and its future children (Landlock, unprivileged, irreversible): no
    write, create, remove, rename or truncate anywhere but beneath ``writable``, and from ABI 6
    no signal to a process outside this domain (the grader, a lab server).  Returns the ABI used,
    0 when the kernel has no Landlock (nothing restricted).  Needs ``no_new_privs`` or
    ``CAP_SYS_ADMIN``, so it sets ``no_new_privs`` first."""
    import ctypes

    abi = landlock_abi()
    if abi == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    rights = sum(bits for version, bits in _WRITE_RIGHTS.items() if version <= abi)
    scoped = _SCOPE_SIGNAL if abi >= 6 else 0
    # struct landlock_ruleset_attr {u64 handled_access_fs; u64 handled_access_net; u64 scoped}: pass
    # only the fields this ABI knows (the kernel rejects a size it does not)
    attr = (ctypes.c_uint64 * 3)(rights, 0, scoped)
    ruleset = libc.syscall(444, ctypes.byref(attr), 24 if abi >= 6 else 8, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset failed (ABI {abi})")
    try:
        folder = os.open(writable, os.O_PATH | os.O_DIRECTORY)
        try:
            # struct landlock_path_beneath_attr {u64 allowed_access; s32 parent_fd} (packed, 12 bytes)
            rule = ctypes.create_string_buffer(rights.to_bytes(8, "little") + folder.to_bytes(4, "little", signed=True))
            if libc.syscall(445, ruleset, 1, rule, 0) != 0:  # LANDLOCK_RULE_PATH_BENEATH
                raise OSError(ctypes.get_errno(), f"landlock_add_rule({writable!r}) failed")
        finally:
            os.close(folder)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        if libc.syscall(446, ruleset, 0) != 0:  # landlock_restrict_self
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi


def _limits(writable: str | None = None) -> None:
    """The sealed child's last steps before ``exec`` (``preexec_fn``): die with the grader, drop
    root's powers, confine writes to ``writable``, cap CPU time, memory, open files, file size."""
    import ctypes

    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL: it dies with its grader
    if os.geteuid() == 0:  # still root here: a second user was not possible (see isolation())
        drop_root_powers()
    if writable is not None:
        confine_writes(writable)
    for what, value in ((resource.RLIMIT_CPU, LIMITS["cpu_s"]), (resource.RLIMIT_AS, LIMITS["memory_bytes"]),
                        (resource.RLIMIT_NOFILE, LIMITS["files"]), (resource.RLIMIT_FSIZE, LIMITS["file_bytes"])):
        resource.setrlimit(what, (value, value))


def reap(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Wait for a process that was just killed, without raising.  Called on the way out of an
    error, it must not replace that error with one about the clean-up: on a loaded machine a
    killed process took more than 10 s to be reaped, and the ``TimeoutExpired`` of that wait was
    what a grade reported.  A process still unreaped after ``timeout`` is left to the kernel."""
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
