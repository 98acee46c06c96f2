"""Where a sealed child runs: which Unix user, which powers, which limits (see :mod:`.sealed`).

As root, learner children run as a second user (:func:`sandbox_user`) when the interpreter and
``minikv/`` are readable by others; otherwise (or without root) they keep the grader's user, with
every capability dropped when that user is root (:func:`drop_root_powers`), and the graders, the
lab servers and the fleet make themselves non-dumpable (:func:`make_undumpable`).

Either way a Landlock ruleset (:func:`confine`, Linux 5.13+) then closes the whole file system to
the child's writes except its own temporary folder and ``/dev/null``, to its reads all but the
interpreter, its libraries, the given modules and that folder (:mod:`._reads`), and (Linux
6.12+) keeps its signals inside its own process tree.  A uid-0 child without capabilities still *owns* every
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
    from . import _reads
    from .guard import FORBIDDEN

    abi = landlock_abi()
    leaks = _reads.leaks(_reads.closed_paths(FORBIDDEN))
    reads = ("; to its reads, every file but the interpreter, its libraries, the given modules and its own folder "
             "(solutions/, the graders, other submissions, every /proc/<pid> and, but for the capstone's tools, the "
             "reference modules closed"
             + (f", except {', '.join(leaks[:2])}, inside the interpreter's own folders" if leaks else "") + ")")
    walls = (f"; Landlock (ABI {abi}) closes every file outside its own temporary folder to its writes" + reads
             + ("; its signals stay inside its own processes" if abi >= 6 else "")) if abi else \
        ("; no Landlock in this kernel, so files its user owns stay writable to it, and every file it may "
         "read stays readable (solutions/ and the reference modules are refused only by its import system)")
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
#: by the ABI version that introduced them)
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


def confine(writable: str, reads: list[tuple[str, int]] | None = None) -> int:
    """Restrict this process and its future children (Landlock, unprivileged, irreversible): no
    write, create, remove, rename or truncate anywhere but beneath ``writable`` and on
    ``/dev/null``; with ``reads`` (``[(path, rights)]``, :func:`._reads.read_rules`) no read or
    execute either but what those rules grant; and from ABI 6 no signal to a process outside this
    domain (the grader, a lab server).  Returns the ABI used, 0 when the kernel has no Landlock
    (nothing restricted).  Needs ``no_new_privs`` or ``CAP_SYS_ADMIN``, so it sets ``no_new_privs``."""
    import ctypes
    import stat

    from ._reads import FILE_RIGHTS, READ, READ_FILE, EXECUTE, TRUNCATE, WRITE_FILE

    abi = landlock_abi()
    if abi == 0:
        return 0
    libc = ctypes.CDLL(None, use_errno=True)
    rights = sum(bits for version, bits in _WRITE_RIGHTS.items() if version <= abi)
    if reads is not None:
        rights |= READ | EXECUTE
    scoped = _SCOPE_SIGNAL if abi >= 6 else 0
    # struct landlock_ruleset_attr {u64 handled_access_fs; u64 handled_access_net; u64 scoped}: pass
    # only the fields this ABI knows (the kernel rejects a size it does not)
    attr = (ctypes.c_uint64 * 3)(rights, 0, scoped)
    ruleset = libc.syscall(444, ctypes.byref(attr), 24 if abi >= 6 else 8, 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset failed (ABI {abi})")
    # /dev/null: code that silences a tool (stderr=subprocess.DEVNULL) opens it for writing
    rules = [(writable, rights), ("/dev/null", READ_FILE | WRITE_FILE | TRUNCATE)] + list(reads or [])
    try:
        for path, allowed in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue  # a path this machine lacks grants nothing
            try:
                if not stat.S_ISDIR(os.fstat(fd).st_mode):
                    allowed &= FILE_RIGHTS  # a file's rule may grant only a file's rights
                # struct landlock_path_beneath_attr {u64 allowed_access; s32 parent_fd} (packed, 12 bytes)
                rule = ctypes.create_string_buffer((allowed & rights).to_bytes(8, "little")
                                                   + fd.to_bytes(4, "little", signed=True))
                if libc.syscall(445, ruleset, 1, rule, 0) != 0:  # LANDLOCK_RULE_PATH_BENEATH
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path!r}) failed")
            finally:
                os.close(fd)
        libc.prctl(38, 1, 0, 0, 0)  # PR_SET_NO_NEW_PRIVS
        if libc.syscall(446, ruleset, 0) != 0:  # landlock_restrict_self
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi


def _limits(writable: str | None = None, reads: list[tuple[str, int]] | None = None) -> None:
    """The sealed child's last steps before ``exec`` (``preexec_fn``): die with the grader, drop
    root's powers, confine writes to ``writable`` (and reads to ``reads``), cap CPU time,
    memory, open files, file size."""
    import ctypes

    ctypes.CDLL(None).prctl(1, 9, 0, 0, 0)  # PR_SET_PDEATHSIG, SIGKILL: it dies with its grader
    if os.geteuid() == 0:  # still root here: a second user was not possible (see isolation())
        drop_root_powers()
    if writable is not None:
        confine(writable, reads)
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


def become_subreaper() -> bool:
    """``prctl(PR_SET_CHILD_SUBREAPER)``: a process orphaned anywhere below this one is re-parented
    to it, not to PID 1.  A learner's process that leaves its session (``setsid``) and its parent
    (a double fork) escapes a process-group kill, but not this: it stays a descendant, which
    :func:`end_descendants` finds.  True when it took effect (Linux)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    """Whether this process is a subreaper (``PR_GET_CHILD_SUBREAPER``): the grader of a submission
    is; a test or a lesson calling a check in its own process is not, and its other children
    (a fixture's server) are none of the check's business."""
    try:
        import ctypes

        flag = ctypes.c_int(0)
        return ctypes.CDLL(None, use_errno=True).prctl(37, ctypes.byref(flag), 0, 0, 0) == 0 and flag.value == 1
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (from ``/proc/<pid>/stat``; zombies excluded)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]  # the name may hold ") "
        except (OSError, ValueError, IndexError):
            continue  # it ended while we looked
        if state != b"Z":
            children.setdefault(int(ppid), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def end_descendants(pid: int | None = None, rounds: int = 100) -> int:
    """SIGKILL every process below ``pid`` (default: this one) until none is left, and reap those
    that were re-parented to this process (:func:`become_subreaper`).  A process killed while it
    forks may leave a new child, so it sweeps again until a sweep finds nothing.  Returns how
    many it killed."""
    pid = os.getpid() if pid is None else pid
    killed: set[int] = set()
    for _ in range(rounds):
        found = descendants(pid)
        if not found:
            break
        for p in found:
            try:
                os.kill(p, 9)
                killed.add(p)
            except ProcessLookupError:
                pass
    _reap_orphans(killed)
    return len(killed)


def _reap_orphans(pids: set[int], timeout: float = 5.0) -> None:
    """Reap the killed processes that are this process's children (a subreaper's orphans),
    waiting at most ``timeout`` for them to die; the others are their own parents' to reap."""
    import time

    left, deadline = set(pids), time.monotonic() + timeout
    while left and time.monotonic() < deadline:
        for p in list(left):
            try:
                if os.waitpid(p, os.WNOHANG)[0] == 0:
                    continue  # still dying
            except ChildProcessError:
                pass
            left.discard(p)
        if left:
            time.sleep(0.01)
