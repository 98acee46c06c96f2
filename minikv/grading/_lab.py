"""Plumbing shared by the attack labs and the capstone: hidden servers and sealed learner runs.

An attack lab is only honest if the learner's code has *exactly* what a real attacker has: a
URL and an API key.  So nothing secret ever lives in the process that runs the learner's code:

* :class:`HiddenServer` starts a server in a **subprocess** (``python -m <module> ...``).  The
  subprocess draws its own secret (``os.urandom`` unless a seed is given for a lesson), prints
  one JSON line with what the public may know (URLs, keys, the template of the lab), serves
  HTTP on loopback, and prints its **answer key** only when its stdin closes
  (:meth:`HiddenServer.reveal`) -- after the attack has finished, and it serves nothing after.
* :func:`run_sealed` runs the learner's function in **another subprocess** that receives only
  that public JSON, so even code that walks the grader's memory (``gc``, frames) finds no
  pipe to the server and no answer: there is none in its process.

``forbidden_imports`` is the AST check every lab grader runs first (the runner's reference gate,
:mod:`minikv.grading.guard`, with stricter rules): the engine ships reference attacks and
detectors, and a lab solved by importing them teaches nothing.
"""
from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import guard
from ._report import CheckFailed, GraderFault
from ._sandbox import reap

ROOT = Path(__file__).resolve().parents[2]
#: what a lab solution may not import: the runner's reference gate (:mod:`.guard`), plus every
#: reference attack and the solutions themselves
LAB_RULES = {**guard.FORBIDDEN, "minikv.attacks": "minikv.attacks holds the reference attacks",
             "solutions": "solutions/ holds the reference answers"}
FORBIDDEN = tuple(LAB_RULES)


def forbidden_imports(fn, rules: dict[str, str] = LAB_RULES) -> list[str]:
    """Forbidden modules imported in the source file that defines ``fn`` (AST, never run)."""
    try:
        sealed = getattr(fn, "sealed_file", None)  # a sealed child's function: read its file, never import it
        source = Path(sealed).read_text(encoding="utf-8") if sealed else inspect.getsource(inspect.getmodule(fn))
    except (OSError, TypeError):
        return []  # no source file (built-in): nothing to check
    return sorted({module for _, module, _ in guard.forbidden_imports(source, rules=rules)})


def refuse(fn, rules: dict[str, str] = LAB_RULES) -> str | None:
    """Why ``fn`` cannot be graded (defined in a notebook, or its file imports a forbidden
    module), or None.  The graders turn a reason into a failed check."""
    try:
        target_name(fn)
    except ValueError as exc:
        return str(exc)
    bad = forbidden_imports(fn, rules)
    if bad:
        return (f"your file imports {', '.join(bad)}, which the grader forbids: "
                + "; ".join(sorted({rules[next(r for r in rules if b == r or b.startswith(r + '.'))] for b in bad})))
    return None


def target_name(fn) -> str:
    """``module:qualname`` of a learner function, which a fresh interpreter can import."""
    mod, qual = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not mod or mod == "__main__" or "<locals>" in qual:
        raise ValueError(f"{getattr(fn, '__name__', fn)!r} is defined in a notebook or a function; "
                         "graders run your code in a fresh process: put it in its exercises/ file")
    return f"{mod}:{qual}"


def _import_root(fn) -> str | None:
    """The folder a fresh interpreter needs on its path to import ``fn``'s module the way this
    one did: a learner's package may live outside the project (a submissions folder)."""
    name = getattr(fn, "__module__", "") or ""
    file = getattr(sys.modules.get(name), "__file__", None)
    if not file:
        return None
    root = Path(file).resolve().parent
    for _ in range(name.count(".")):
        root = root.parent
    return str(root)


def _env(*first: str | None) -> dict:
    env = dict(os.environ)
    paths = [p for p in (str(ROOT), *first, env.get("PYTHONPATH", "")) if p]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


class HiddenServer:
    """A lab server in a subprocess; ``info`` is the public JSON it printed on start."""

    def __init__(self, module: str, *args: str, timeout: float = 120.0):
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     cwd=ROOT, env=_env())
        line = self.proc.stdout.readline()  # blocks until the server is listening (or died)
        if not line:
            err = self.proc.stderr.read()[-2000:]
            self.proc.wait(timeout)
            raise GraderFault(f"{module} did not start (exit {self.proc.returncode}): {err}")
        self.info = json.loads(line)

    def next_round(self) -> dict:
        """End this round of a ``--rounds`` server: return its answer key and load the next
        round's card into ``info``."""
        self.proc.stdin.write("next\n")
        self.proc.stdin.flush()
        answer, card = self.proc.stdout.readline(), self.proc.stdout.readline()
        if not card:
            self.close()
            raise GraderFault(f"the lab server stopped between rounds (exit {self.proc.returncode}): "
                               f"{self.proc.stderr.read()[-2000:]}")
        self.info = json.loads(card)
        return json.loads(answer)

    def reveal(self, timeout: float = 180.0) -> dict:
        """Close the server's stdin: it stops serving and prints its answer key, which we return.

        The timeout is generous on purpose: a fleet stops in about 1 s on a quiet machine, but a
        grade shares the machine with whatever else runs.  In a CI run beside a busy vLLM, fleets
        sat 40-180 s in ``import torch``: MKL counts cores by pinning the importing thread to each
        core in turn, and vLLM's CPU build pins its worker to core 0; that vLLM ran in a session
        of its own, which the scheduler gave that core first (``scripts/vllm_server.py`` no longer
        does).  Any busy neighbour can still slow a fleet: a timeout here would read as a failed
        audit to the learner, so it is a :class:`GraderFault` instead."""
        try:
            out, err = self.proc.communicate(input="", timeout=timeout)
        except subprocess.TimeoutExpired:
            self.close()
            raise GraderFault(f"the lab server did not stop within {timeout:g} s after the run "
                              "(is the machine overloaded?)") from None
        lines = [l for l in out.splitlines() if l.strip()]
        if self.proc.returncode != 0 or not lines:
            raise GraderFault(f"the lab server failed (exit {self.proc.returncode}): {err[-2000:]}")
        return json.loads(lines[-1])

    def close(self) -> None:
        """Kill the server if it still runs.  Never raises (:func:`._sandbox.reap`)."""
        if self.proc.poll() is None:
            self.proc.kill()
            reap(self.proc)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_sealed(fn, args: list, timeout: float) -> tuple[object, float]:
    """Run ``fn(*args)`` in a fresh interpreter that sees only ``args`` (JSON); return
    (its JSON-able result, seconds).

    Raises ``TimeoutError``, or ``RuntimeError`` with the learner's traceback tail.  A function of
    a sealed child (:mod:`.sealed`, ``make grade DIR=``) is called in that child instead."""
    if getattr(fn, "sealed_file", None):
        return _run_in_child(fn, args, timeout)
    code = ("import json,sys,importlib;m,q=sys.argv[1].split(':');f=importlib.import_module(m)\n"
            "for p in q.split('.'): f=getattr(f,p)\n"
            "r=f(*json.loads(sys.stdin.read()))\n"
            "if isinstance(r,(set,frozenset,tuple)): r=sorted(r,key=str)\n"
            "print('\\n@@RESULT@@'+json.dumps(r))")
    t0 = time.monotonic()
    try:
        p = subprocess.run([sys.executable, "-c", code, target_name(fn)], input=json.dumps(args),
                           capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                           env=_env(_import_root(fn)))
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"your code ran longer than {timeout:.0f} s") from None
    took = time.monotonic() - t0
    if p.returncode != 0 or "@@RESULT@@" not in p.stdout:
        raise RuntimeError((p.stderr.strip().splitlines() or ["(no output)"])[-1])
    try:
        return json.loads(p.stdout.rsplit("@@RESULT@@", 1)[1]), took
    except ValueError:
        raise RuntimeError("your function printed '@@RESULT@@' itself") from None


def _run_in_child(fn, args: list, timeout: float) -> tuple[object, float]:
    from .sealed import SealedTimeout

    child = fn._child
    child.call_timeout, t0 = timeout, time.monotonic()
    try:
        r = fn(*args)
    except SealedTimeout:
        raise TimeoutError(f"your code ran longer than {timeout:.0f} s") from None
    except NotImplementedError as exc:
        raise RuntimeError(f"NotImplementedError: {exc}") from None
    except Exception as exc:  # noqa: BLE001 -- the learner's exception, as data
        raise RuntimeError(f"{type(exc).__name__}: {exc}{getattr(exc, 'sealed_where', '')}") from None
    if isinstance(r, (set, frozenset, tuple)):
        r = sorted(r, key=str)
    return r, time.monotonic() - t0


def run_graded(fn, args: list, timeout: float, *, error_hint: str, timeout_hint: str) -> tuple[object, float]:
    """:func:`run_sealed` for a grader: the stub's ``NotImplementedError`` stays one (the grader then
    says "not implemented yet"); any other error, or a timeout, becomes a failed check with a hint."""
    try:
        return run_sealed(fn, args, timeout)
    except RuntimeError as exc:
        if str(exc).startswith("NotImplementedError"):
            raise NotImplementedError(str(exc).split(":", 1)[-1].strip()) from None
        raise CheckFailed(f"your code raised {exc}", error_hint) from None
    except TimeoutError as exc:
        raise CheckFailed(str(exc), timeout_hint) from None
