# GENERATED from solutions/ex4_isolation_audit.py by `python -m minikv.grading.make_exercises`.
# This file is yours: replace every `raise NotImplementedError` with your implementation,
# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the
# reference solution uses.  Course maintainers: edit solutions/ex4_isolation_audit.py and regenerate; never
# edit this file by hand.
# minikv-stub: 8c28afb4de90cb5a
"""Exercise 4 (lesson 08): an isolation audit that checks BOTH directions.

Run a multi-tenant workload against an engine -- requests of different tenants in the same
batches -- and report whether any tenant's request was served from another tenant's cache.

The trap (vLLM docs PR #53347 spells it out): a test that only checks "the other tenant got no
cache hit" also passes when *nothing* is ever cached (the key never reaches the cache, the
cache is off, or the test cannot see hits).  So an audit needs both directions:

* cross-tenant cached tokens must be 0, else the verdict is ``"fail"``;
* same-tenant cached tokens must be > 0 -- proof that this very audit *could* see a hit --
  else the verdict is ``"inconclusive"``, never ``"pass"``.

* 4a ``audit_verdict`` -- that rule;
* 4b ``isolation_audit`` -- the workload, black-box: it reads only what a client sees
  (``RequestOutput.num_cached_tokens``) and knows, by construction, whose cache each hit can
  have come from.

Grade with ``check_audit_verdict`` and ``check_isolation_audit``.  The engine's own, fuller
version is ``minikv.audit.isolation.audit_engine`` (the grader compares your verdicts with it).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from minikv import SamplingParams

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"


@dataclass
class IsolationReport:
    """What :func:`isolation_audit` saw."""

    n_requests: int
    cross_tenant_cached_tokens: int  # cached prompt tokens that can only have come from another tenant
    same_tenant_cached_tokens: int   # cached prompt tokens that can only have come from the same tenant
    verdict: str                     # "pass" | "fail" | "inconclusive"

    def summary(self) -> str:
        return (f"{self.n_requests} requests: cross-tenant cached tokens {self.cross_tenant_cached_tokens}, "
                f"same-tenant cached tokens {self.same_tenant_cached_tokens} -> {self.verdict.upper()}")


def audit_verdict(cross_tenant_cached_tokens: int, same_tenant_cached_tokens: int) -> str:
    """``"fail"`` if any cross-tenant tokens were cached; else ``"inconclusive"`` if no
    same-tenant tokens were cached either (the audit never saw a hit); else ``"pass"``.

    Hint: the order of the two tests matters -- a leak is a leak even if nothing else hit.
    """
    raise NotImplementedError("audit_verdict: not implemented yet (read the docstring, then write your code here)")


def isolation_audit(llm, tenants=("alice", "bob", "carol"), doc_blocks: int = 3, seed: int = 0) -> IsolationReport:
    """Audit ``llm`` (a fresh ``minikv.LLM`` with an empty cache) for cross-tenant cache hits.

    Contract:

    * every tenant ``t`` gets a private document ``D_t`` of ``doc_blocks`` full blocks of random
      token ids (``random.Random(seed)``; ids in ``[3, vocab_size)``), so no two documents share a
      block and nothing else in the cache can match them;
    * wave 1 (**concurrent**: all requests of a wave are queued together, tenants mixed, and run in
      the same engine steps): every tenant sends ``D_t + q`` (``q``: one fresh random block, so
      the whole document can be hit later; the engine always recomputes the last prompt token);
    * wave 2 (concurrent): every tenant re-sends its own ``D_t + q'`` (any hit is *same-tenant*)
      AND sends another tenant's ``D_v + q''`` (what a prompt-stealing attacker does: any hit is
      *cross-tenant*);
    * cached tokens of a first-time request in wave 1 would also be cross-tenant (nobody else
      sent that document);
    * returns an :class:`IsolationReport` whose verdict comes from :func:`audit_verdict`.

    Stuck?  ``make hint EX=4b`` (three levels, one per call).
    """
    raise NotImplementedError("isolation_audit: not implemented yet (read the docstring, then write your code here)")
