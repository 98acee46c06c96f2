"""One check of a graded submission, run sealed: what it may read, how long it may run, and
that nothing it started outlives it.

:func:`sealed_check` is what ``make grade DIR=...`` runs per check (:mod:`.runner`, strict): the
learner's code in a :class:`~.sealed.SealedChild` that may neither import nor read the modules
:func:`closed_modules` names (:mod:`._reads`), with the whole check's time in that code capped at
:func:`budget` -- a check that hangs loses its own points, never the submission's -- and, when
the check ends, every process below the grader killed (:func:`._sandbox.end_descendants`; the
grader is their subreaper, so a process that left its session is still found).
"""
from __future__ import annotations

import os
from pathlib import Path

from . import guard
from ._lab import LAB_RULES
from ._sandbox import end_descendants, is_subreaper
from .sealed import LearnerError, SealedChild, SealedTimeout

#: seconds a check may spend in the learner's code, all its calls together (:class:`.sealed.SealedChild`);
#: the labs and the capstone run attacks and audits over HTTP, several rounds each
CHECK_BUDGET_S = {"L1": 600.0, "L2": 900.0, "L3": 300.0, "L4": 600.0, "C": 900.0}
DEFAULT_BUDGET_S = 300.0


def budget(ex_id: str) -> float:
    """Check ``ex_id``'s budget; ``MINIKV_CHECK_BUDGET_S`` sets one for every check instead."""
    override = os.environ.get("MINIKV_CHECK_BUDGET_S")
    return float(override) if override else CHECK_BUDGET_S.get(ex_id, DEFAULT_BUDGET_S)


def closed_modules(ex) -> list[str]:
    """What ``ex``'s sealed child may neither import nor read (besides the graders and
    ``solutions/``, always closed): the reference modules of :data:`.guard.FORBIDDEN`, and for
    a lab every reference attack.  The capstone's audit runs the public tools (``minikv audit``,
    ``minikv.audit.isolation_server``), which are the reference modules' own users, so only its
    gate (:data:`.capstone.CAPSTONE_RULES`) keeps them out of the learner's file."""
    if ex.id == "C":
        return []
    return list(LAB_RULES) if ex.id.startswith("L") else list(guard.FORBIDDEN)


def sealed_check(ex, package_dir: Path, package: str) -> tuple[bool, str]:
    """Run ``ex``'s grader with the learner's code in a sealed child; (passed, status).  In the
    grader of a submission (a subreaper: :func:`._sandbox.become_subreaper`), every process the
    check started ends with it (:func:`._sandbox.end_descendants`)."""
    try:
        child = SealedChild(package_dir, package, closed=closed_modules(ex), budget=budget(ex.id))
    except (SealedTimeout, LearnerError) as exc:
        print(f"❌ {ex.check.__name__}: your code's process did not start: {exc}")
        return False, "timeout" if isinstance(exc, SealedTimeout) else "failed"
    try:
        target = child.function(ex.module, ex.name)
        kwargs = {k: child.function(ex.module, k) for k in ex.extra}
        ok = ex.check(target, **kwargs)
    finally:
        notes = child.close()
        left = end_descendants() if is_subreaper() else 0
    if left:
        print(f"   (ended {left} process(es) your code left running: nothing outlives its check)")
    if notes:
        print(f"❌ {ex.check.__name__}: tampering detected, scored 0 -- the submission's process "
              + "; ".join(dict.fromkeys(notes)))
        return False, "tampering"
    if child.timed_out:
        print(f"❌ {ex.check.__name__}: timed out -- only this check's points are lost")
        return False, "timeout"
    return ok, "passed" if ok else "failed"
