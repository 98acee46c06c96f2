"""Grader for exercise 3c, "write the mutant": the learner writes the bugs, a named grader must catch them.

Every other exercise asks for a correct implementation and grades it against mutants the course
wrote.  3c turns that around.  A test suite is only as good as the wrong code it rejects, and the
wrong code that matters is the kind that *looks* right: it survives the quick test its author
ran.  So the learner writes two wrong ``zero_blocks`` (exercise 3a's function) that

1. pass :func:`smoke_test`, the kind of test a colleague writes in a hurry (zero one block, look
   at one slice of it), so each is a bug that would reach production;
2. are rejected by 3a's grader, :func:`~minikv.grading.scrubbing.check_zero_blocks`: each is wrong
   in a way the contract forbids, and the grader can say which;
3. are rejected for *different* reasons (bug classes): two spellings of one mistake teach nothing new.

A mutant that crashes is refused too: any test catches a crash, and the point is a bug that runs.
The grader runs 3a's check on the learner's functions (in a sealed child under ``make grade DIR=``,
like every check) and reports the bug class 3a's grader named for each, which is what the learner
should be able to predict before running it.
"""
from __future__ import annotations

import re

from ._report import CheckFailed, call_safely, expect, grader
from .scrubbing import FakePool, check_zero_blocks

def smoke_test(zero_blocks) -> bool:
    """A colleague's quick test of 3a, as they wrote it: True when ``zero_blocks`` passes it."""
    pool = FakePool(seed=99)
    zero_blocks(pool, [2])
    return bool((pool.k_cache[0, 2] == 0).all())


def bug_class(what: str) -> str:
    """The bug class in a 3a verdict: its ``(bug class: ...)`` tag, else the verdict with its
    numbers and lists blanked, up to its first colon (``block 3 was not zeroed`` and ``block 7 was not
    zeroed`` are one class)."""
    tagged = re.search(r"\(bug class: ([^)]*)\)", what)
    if tagged:
        return tagged.group(1)
    return re.sub(r"\[[^\]]*\]|\d+", "#", what).split(": ")[0]


@grader("write two wrong zero_blocks, each passing smoke_test and each rejected by check_zero_blocks "
        "for its own reason: think of what the smoke test never looks at.")
def check_written_mutants(sneaky_zero_blocks_a, *, sneaky_zero_blocks_b) -> str:
    """Exercise 3c: two mutants of 3a that the smoke test misses and 3a's grader catches, each for
    a different bug class."""
    classes = {}
    for name, fn in (("sneaky_zero_blocks_a", sneaky_zero_blocks_a), ("sneaky_zero_blocks_b", sneaky_zero_blocks_b)):
        passed, err = call_safely(smoke_test, fn)
        expect(err is None, f"{name} raised {type(err).__name__}: {err} in the colleague's smoke test (bug class: "
               "a crash, not a subtle bug): any test catches an exception",
               "a mutant must run and return like a real zero_blocks, and be wrong only in what it leaves behind.")
        expect(passed, f"{name} fails the colleague's smoke test (what it reads after zeroing block 2 is not all "
               "zero) (bug class: caught by the smoke test): a bug that the quickest test catches never "
               "reaches production",
               "read smoke_test: which block, which layer and which tensor does it look at, and what does it "
               "never look at?")
        try:
            check_zero_blocks.__wrapped_check__(fn)
        except CheckFailed as fail:
            classes[name] = bug_class(fail.what)
            continue
        except NotImplementedError:
            raise
        except Exception as exc:  # noqa: BLE001 -- a crash inside 3a's cases is the learner's, and named
            raise CheckFailed(f"{name} raised {type(exc).__name__}: {exc} on one of 3a's cases (bug class: a crash, "
                              "not a subtle bug)", "make it run on every list of block ids, empty and repeated "
                              "ones too: only its result may be wrong.") from None
        raise CheckFailed(f"3a's grader accepts {name} (bug class: not a mutant): it meets 3a's whole contract, so "
                          "it is a correct zero_blocks, not a bug",
                          "if you are sure it is wrong, tell your instructor: you found a gap in 3a's grader.")
    a, b = classes["sneaky_zero_blocks_a"], classes["sneaky_zero_blocks_b"]
    expect(a != b, f"both mutants are caught for the same reason ({a!r}) (bug class: one mistake written twice)",
           "a second mutant should be wrong in another way: list what 3a's contract promises, and break another "
           "promise.")
    return f"both pass the smoke test; 3a's grader catches sneaky_zero_blocks_a as {a!r} and sneaky_zero_blocks_b as {b!r}"


__all__ = ["check_written_mutants", "smoke_test", "bug_class"]
