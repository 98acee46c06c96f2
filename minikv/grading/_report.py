"""How a grader reports: one line on success, what failed and a hint on failure.

Every ``check_*`` function is wrapped by :func:`grader`.  Inside, a check calls
``expect(condition, what, hint)``; the first failed expectation stops the check.  The wrapper
turns the outcome into one printed message and a bool:

* ``✅ check_x passed: <summary>``
* ``❌ check_x failed: <what went wrong>`` plus ``Hint: <how to fix it>``
* ``❌ check_x: <name> is not implemented yet`` when the learner's code raised
  ``NotImplementedError`` (the stub)
* ``❌ check_x could not grade: <what>`` when the grader's own machinery failed
  (:class:`GraderFault`); no verdict on the learner's code, and the check counts as not passed
* ``❌ check_x failed: your code raised <Exception>: <message>`` for any other exception
  raised by the learner's code, with the check's hint.

Checks return ``True``/``False`` and never raise (pytest asserts the bool), so a lesson cell
can call them without stopping the notebook.
"""
from __future__ import annotations

import contextlib
import functools
import traceback
from typing import Callable


class CheckFailed(Exception):
    """A failed expectation: what went wrong, and a hint."""

    def __init__(self, what: str, hint: str = ""):
        super().__init__(what)
        self.what, self.hint = what, hint


class GraderFault(Exception):
    """The grader's own machinery failed (a lab server that would not start or stop): the check
    cannot give a verdict, and must not blame the learner's code for it."""


def expect(condition, what: str, hint: str = "") -> None:
    """Fail the running check with ``what`` (and ``hint``) unless ``condition`` holds."""
    if not condition:
        raise CheckFailed(what, hint)


def call_safely(fn, *args):
    """Call ``fn`` and return (result, None) or (None, exception) -- NotImplementedError propagates,
    so an unfinished stub still reads "not implemented yet" rather than "raised the wrong error"."""
    try:
        return fn(*args), None
    except NotImplementedError:
        raise
    except Exception as exc:  # noqa: BLE001
        return None, exc


def _indent(text: str) -> str:
    return "\n".join("   " + line if line else line for line in text.splitlines())


def _where(exc: BaseException) -> str:
    """'file:line in func' of the deepest frame of the learner's code, if any (a sealed child's
    exception carries it as data: its frames were in another process)."""
    if getattr(exc, "sealed_where", ""):
        return exc.sealed_where
    frames = traceback.extract_tb(exc.__traceback__)
    for fr in reversed(frames):
        if "/exercises/" in fr.filename or "/solutions/" in fr.filename or "mutants" in fr.filename:
            name = fr.filename.split("/")[-2] + "/" + fr.filename.split("/")[-1]
            return f" (at {name}:{fr.lineno} in {fr.name})"
    return ""


@contextlib.contextmanager
def single_thread():
    """Run torch on one thread: the grading engines' matrices are tiny, and on a busy 2-core
    machine a thread pool costs more than it gains (and makes run times erratic)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def grader(default_hint: str) -> Callable:
    """Decorator: run a check, print one verdict, return True/False.

    The check function returns a one-line summary for the pass message.  ``quiet=True`` (a
    keyword every check accepts) suppresses printing, for tests.
    """

    def wrap(check: Callable) -> Callable:
        name = check.__name__

        @functools.wraps(check)
        def run(*args, quiet: bool = False, **kwargs) -> bool:
            def say(msg: str) -> None:
                if not quiet:
                    print(msg)

            run.last_fault = None  # the gradebook reads it: a fault is status "error", not "failed"

            try:
                with single_thread():
                    summary = check(*args, **kwargs)
            except CheckFailed as fail:
                say(f"❌ {name} failed: {fail.what}")
                if fail.hint or default_hint:
                    say(_indent(f"Hint: {fail.hint or default_hint}"))
                return False
            except GraderFault as fault:
                run.last_fault = str(fault)
                say(f"❌ {name} could not grade: {fault}")
                say(_indent("Hint: this is not a verdict on your code; run the check again, "
                            "on a machine with less else running"))
                return False
            except NotImplementedError as exc:
                what = str(exc).split(":")[0] if str(exc) else "your code"
                say(f"❌ {name}: {what} is not implemented yet (it raised NotImplementedError).")
                say(_indent("Hint: open the exercise file, read the docstring, and replace the "
                            "`raise NotImplementedError` line with your code."))
                return False
            except Exception as exc:  # noqa: BLE001 -- any error in learner code is a failed check
                say(f"❌ {name} failed: your code raised {type(exc).__name__}: {exc}{_where(exc)}")
                say(_indent(f"Hint: {default_hint}"))
                return False
            say(f"✅ {name} passed: {summary}")
            return True

        run.__wrapped_check__ = check
        run.last_fault = None
        return run

    return wrap
