"""Sealed grading: the learner's code runs in a child process, the grader only ever sees data.

``make grade DIR=...`` grades strangers' code, so a verdict must not be computable by that code.
:class:`SealedChild` starts one child per check:

* a fresh interpreter (``python -I -B``: no ``PYTHON*`` variables, no user site, no bytecode),
  its environment empty but for ``PATH``, ``HOME``, ``TMPDIR`` and ``PYTHONPATH`` (for the
  tools a lab runs, such as ``python -m minikv audit``), its working folder a new temporary one
  holding a copy of the submission and a link to the ``minikv`` package;
* reads limited to the interpreter, its libraries, the given modules and that folder, and writes
  to that folder (:mod:`._reads`, :func:`._sandbox.confine`): ``solutions/``, the reference
  modules of the check, the graders and other submissions are closed, and its import system
  refuses a closed module by its file, whichever name reaches it;
* limits on CPU seconds, address space, open files and file size (``resource``), a wall-clock
  timeout on every call and a budget for the whole check (``budget``), and its own session;
* as a second Unix user (:func:`sandbox_user`) when the grader runs as root: then it cannot read
  the grader's or a lab server's memory, files or ``/proc`` entries.  Without root there is no
  second user; the grader, the lab servers and the fleet then make themselves non-dumpable
  (:func:`make_undumpable`), which closes ``/proc/<pid>/mem``, ``/fd`` and ``/environ`` to
  every other process of the same user, and :data:`ISOLATION` says which of the two holds.

The child imports the learner's module (never the parent); the parent holds a
:class:`ChildProxy` per learner function that sends arguments as data (:mod:`._wire`) and gets
back data or an exception.  Objects the grader owns (an engine, a request, a reference hasher)
cross as handles: the child may read their public attributes and call them, nothing else.  A
pool-like argument (``k_cache``/``v_cache`` tensors) crosses as a copy whose tensors are copied
back after the call, in place or rebound as the learner's code left them.

:class:`SealedChild` also collects the child's tampering notes (see :mod:`._sealed_child`), so
the runner can report "tampering detected" for a check whose child tried to reach outside.
"""
from __future__ import annotations

import builtins
import functools
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from . import _reads, _wire
from ._sandbox import LIMITS, _limits, isolation, make_undumpable, reap, sandbox_user  # noqa: F401 -- re-exported

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
MAX_LINE = 256 << 20


class SealedTimeout(TimeoutError):
    """A learner call ran past its wall-clock limit (the child has been killed)."""


class LearnerError(Exception):
    """An exception the learner's code raised that is not a built-in one (named after it)."""


class ChildProxy:
    """A learner function (or object) living in a sealed child: call it like the original."""

    def __init__(self, child: "SealedChild", ref: dict, name: str, file: Path | None = None):
        self._child, self._ref, self.__name__, self.sealed_file = child, ref, name, file
        self.__qualname__ = name

    def __call__(self, *args, **kwargs):
        return self._child.call({**self._ref, "op": "call"}, list(args), kwargs)

    def __getattr__(self, name: str):
        if name.startswith("_") or "h" not in self._ref:
            raise AttributeError(name)
        return self._child.call({**self._ref, "op": "getattr", "name": name}, None, None)

    def __repr__(self) -> str:
        return f"<sealed {self.__name__}>"


class SealedChild:
    """One sealed child holding ``package`` (the folder ``package_dir``) for one check.

    ``closed``: module names the check may neither import nor read (:func:`._reads.closed_paths`
    adds the graders and ``solutions/``); None leaves reads open (writes are always confined).
    ``budget``: seconds the whole check may spend in the learner's code, every call together;
    past it a call raises :class:`SealedTimeout` at once, so a check that hangs costs itself only."""

    def __init__(self, package_dir: Path, package: str, call_timeout: float = 120.0,
                 closed: list[str] | None = None, budget: float | None = None):
        self.package, self.call_timeout, self.budget = package, call_timeout, budget
        self.deadline = time.monotonic() + budget if budget is not None else float("inf")
        self.notes: list[str] = []
        self.timed_out = False
        self._objects: dict[int, object] = {}
        self._buf = b""
        self.tmp = Path(tempfile.mkdtemp(prefix="minikv-sealed-"))
        pkg, lib, home = self.tmp / "pkg", self.tmp / "lib", self.tmp / "home"
        shutil.copytree(package_dir, pkg / package, ignore=shutil.ignore_patterns("__pycache__"))
        lib.mkdir()
        (lib / "minikv").symlink_to(ROOT / "minikv")
        home.mkdir()
        user = sandbox_user()
        if user is not None:
            for p in [self.tmp, *self.tmp.rglob("*")]:
                os.lchown(p, user.pw_uid, user.pw_gid)
        to_child, self._w = os.pipe()
        self._r, from_child = os.pipe()
        shut = _reads.closed_paths(closed) if closed is not None else []
        cfg = {"path": [str(pkg), str(lib)], "home": str(home), "pkg": str(pkg), "package": package,
               "minikv": str(lib / "minikv"), "rfd": to_child, "wfd": from_child, "closed": shut,
               "private": _private_roots() if closed is not None else [],
               "own": [os.path.realpath(self.tmp), os.path.realpath(ROOT / "minikv"),
                       *_reads.interpreter_roots()]}
        reads = _reads.read_rules(shut) if closed is not None else None
        boot = "import types\n" + "".join(
            f"{var} = types.ModuleType({var!r}); {var}.__file__ = {str(HERE / file)!r}; "
            f"exec(compile({(HERE / file).read_text()!r}, {file!r}, 'exec'), {var}.__dict__)\n"
            for var, file in (("wire", "_wire.py"), ("reads", "_reads.py"), ("child", "_sealed_child.py"))
        ) + f"child.main(wire, reads, {cfg!r})\n"
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(home), "TMPDIR": str(home), "LANG": "C.UTF-8",
               "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{lib}{os.pathsep}{pkg}", "PYTHONDONTWRITEBYTECODE": "1"}
        self._log = open(self.tmp / "output.log", "wb")
        extra = {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []} if user is not None else {}
        self.proc = subprocess.Popen([sys.executable, "-I", "-B", "-c", boot], cwd=home, env=env,
                                     stdin=subprocess.DEVNULL, stdout=self._log, stderr=self._log,
                                     pass_fds=(to_child, from_child), preexec_fn=functools.partial(_limits, str(self.tmp), reads),
                                     start_new_session=True,
                                     **extra)
        os.close(to_child)
        os.close(from_child)
        try:
            self._read(min(time.monotonic() + 120.0, self.deadline))  # "ready"
        except BaseException:
            self.close()  # its folder goes with it: nothing of a failed start stays behind
            raise

    # ------------------------------------------------------------------ the pipe
    def _read(self, deadline: float) -> dict:
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._r], [], [], left)[0]:
                self.timed_out = True
                self.kill()
                if deadline >= self.deadline:
                    raise SealedTimeout(f"this check ran past its limit of {self.budget:.0f} s in your code")
                raise SealedTimeout(f"your code ran longer than {self.call_timeout:.0f} s")
            chunk = os.read(self._r, 1 << 20)
            if not chunk:
                self.kill()
                tail = (self.tmp / "output.log").read_bytes()[-600:].decode(errors="replace").strip()
                raise LearnerError(f"your code's process ended unexpectedly: {tail.splitlines()[-1] if tail else ''}")
            self._buf += chunk
            if len(self._buf) > MAX_LINE:
                self.kill()
                raise LearnerError("your code sent more than 256 MiB in one answer")
        line, self._buf = self._buf.split(b"\n", 1)
        msg = _wire.loads(line)
        self.notes.extend(str(n) for n in (msg.get("notes") or []))
        return msg

    def _send(self, msg: dict) -> None:
        try:
            os.write(self._w, _wire.dumps(msg))
        except (BrokenPipeError, OSError):
            raise LearnerError("your code's process closed its end of the grading pipe") from None

    # ------------------------------------------------------------------ data
    def _handle(self, obj) -> int:
        self._objects[id(obj)] = obj
        return id(obj)

    def _enc(self, obj):
        if getattr(obj, "_child", None) is self and "h" in obj._ref:  # one of the child's own objects
            return {"__h": obj._ref["h"]}
        return _wire.encode(obj, self._handle)

    def _dec(self, data):
        return _wire.decode(data, lambda h: ChildProxy(self, {"h": h}, f"object {h}"), _known())

    def _arg(self, obj):
        tensors = {k: v for k, v in vars(obj).items() if k in ("k_cache", "v_cache")} if hasattr(obj, "__dict__") else {}
        if len(tensors) == 2:
            fields = {k: self._enc(v) for k, v in vars(obj).items() if not k.startswith("_")
                      and (k in tensors or isinstance(v, (int, float, str, bool)))}
            return {"__ns": [self._handle(obj), fields]}
        return self._enc(obj)

    # ------------------------------------------------------------------ calls
    def function(self, module: str, name: str) -> ChildProxy:
        """A proxy for ``package.module.name`` in the child (imported there on first call)."""
        file = self.tmp / "pkg" / self.package / f"{module}.py"
        proxy = ChildProxy(self, {"module": module, "name": name}, name, file)
        proxy.__module__ = f"{self.package}.{module}"
        return proxy

    def call(self, ref: dict, args, kwargs):
        """Send one request; answer the child's questions about grader objects until it replies."""
        msg = dict(ref)
        if args is not None:
            msg["args"] = [self._arg(a) for a in args]
            msg["kwargs"] = self._enc(kwargs or {})
        if self.timed_out:  # killed already: a grader that retries after a timeout gets one at once
            raise SealedTimeout(f"this check ran past its limit of {self.budget:.0f} s in your code"
                                if self.budget is not None and time.monotonic() >= self.deadline
                                else f"your code ran longer than {self.call_timeout:.0f} s")
        self._send(msg)
        deadline = min(time.monotonic() + self.call_timeout, self.deadline)
        while True:
            reply = self._read(deadline)
            op = reply["op"]
            if op == "value":
                for h, name, same, data in reply.get("sync") or []:
                    self._sync(h, name, same, data)
                return self._dec(reply["value"])
            if op == "raise":
                raise _rebuild(reply)
            if op in ("getattr", "call"):
                self._answer(reply)
            else:
                raise LearnerError(f"your code's process sent {op!r} out of turn")

    def _sync(self, h: int, name: str, same: bool, data) -> None:
        obj = self._objects.get(h)
        if obj is None or name not in ("k_cache", "v_cache"):
            return
        value = self._dec(data)
        current = getattr(obj, name)
        if same and getattr(value, "shape", None) == current.shape:
            current.copy_(value.to(current.dtype))
        else:
            setattr(obj, name, value)

    def _answer(self, msg: dict) -> None:
        try:
            obj = self._objects[int(msg["h"])]
            name = msg.get("name")
            if name is not None and (not isinstance(name, str) or name.startswith("_")):
                raise AttributeError(f"sealed grading: {name!r} is not a public attribute")
            if name is not None:
                obj = getattr(obj, name)
            if msg["op"] == "call":
                args = self._dec(msg.get("args") or [])
                kwargs = self._dec(msg.get("kwargs") or {"__d": []})
                obj = obj(*args, **{str(k): v for k, v in kwargs.items()})
            self._send({"op": "value", "value": self._enc(obj)})
        except (SealedTimeout, LearnerError):
            raise
        except Exception as exc:  # noqa: BLE001 -- the grader's objects refuse bad questions
            self._send({"op": "error", "type": type(exc).__name__, "msg": str(exc)})

    def close(self) -> list[str]:
        """Stop the child (its exit hooks run and may still leave notes); return every note."""
        if self.proc.poll() is None:
            try:
                self._send({"op": "exit"})
                while self._read(time.monotonic() + 10.0)["op"] != "bye":
                    pass
            except (SealedTimeout, LearnerError, _wire.WireError):
                pass
        self.kill()
        shutil.rmtree(self.tmp, ignore_errors=True)
        return self.notes

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except ProcessLookupError:
                pass
            reap(self.proc)
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _private_roots() -> list[str]:
    """Folders whose files a check's child may not open (its own folder and the libraries aside,
    :mod:`._sealed_child` says so as tampering): the repository, the temporary folders where
    every grader stages its submission, and the folder of submissions being graded."""
    roots = [ROOT, "/tmp", "/var/tmp", tempfile.gettempdir(), os.environ.get("MINIKV_SUBMISSIONS", "")]
    return sorted({os.path.realpath(r) for r in roots if r})


def _known() -> dict:
    """The classes a child's data may be rebuilt as (by their constructor's own fields only)."""
    import dataclasses

    from ..engine.sampling import SamplingParams

    def build(**fields):
        return SamplingParams(**{f.name: fields[f.name] for f in dataclasses.fields(SamplingParams)
                                 if f.init and f.name in fields})

    return {"minikv.engine.sampling:SamplingParams": build}


def _rebuild(reply: dict) -> BaseException:
    """The learner's exception as one the grader can test with ``isinstance``: a built-in type
    by name, any other as a :class:`LearnerError` subclass of the same name."""
    name = str(reply.get("type", "Exception"))
    cls = getattr(builtins, name, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        cls = type(name if name.isidentifier() else "LearnerError", (LearnerError,), {})
    exc = cls(str(reply.get("msg", "")))
    exc.sealed_where = str(reply.get("where", ""))
    return exc
