"""The concurrent multi-tenant isolation audit: can one tenant's request use another's cache?

A timing audit (``minikv.audit.timing``) asks the question statistically, from outside.  This
audit asks it directly, with a workload built so that every cached token has exactly one
possible origin:

* every tenant ``t`` has a **private document** ``D_t`` (a random, per-run tag first, so no two
  tenants' documents share even their first block), and all tenants share one **system
  prompt** ``S`` (random per run too, so nothing is left over from earlier runs);
* requests run in *waves*; the requests of a wave are sent concurrently, tenants interleaved,
  so they join the same continuous batches -- isolation must hold inside a batch, not only
  between quiet requests;
* each request has a label that says where its cached tokens could come from:

  ====================  ==============================================  ==================
  label                 request                                          cached tokens are
  ====================  ==============================================  ==================
  ``private-prime``     t's first ``D_t + q``                            cross-tenant
  ``system-prime``      the first tenant's first ``S + q``               cross-tenant
  ``private-repeat``    t re-sends ``D_t + q'`` (same key or another     same-tenant
                        key of the same tenant)
  ``system-first``      u's first ``S + q`` after another tenant's       cross-tenant
  ``private-copy``      u sends another tenant's ``D_v + q''`` --        cross-tenant
                        exactly what a prompt-stealing attacker does
  ``system-repeat``     u re-sends ``S + q'''``                          same-tenant
  ====================  ==============================================  ==================

The verdict needs **both directions**.  Cross-tenant cached tokens must be 0 -- else ``fail``.
But 0 alone proves nothing: if the cache never hits at all (caching off, per-request
isolation, or an audit that cannot see hits), a cross-tenant check "passes" vacuously.  vLLM's
docs PR #53347 makes this point: a one-sided "different salt, no reuse" test also passes when
caching is off.  So same-tenant cached tokens must be > 0, proving that this very audit *could*
see a hit; otherwise the verdict is ``inconclusive``, never ``pass``.

Two modes
---------
* :func:`audit_engine` (:mod:`~minikv.audit.isolation_engine`) runs the workload in-process
  against an engine configuration.  It reads ground truth: a block-manager listener records every
  ``hit`` with the tenant that *wrote* the block (and whether it lies in an operator-declared
  public prefix, which every tenant may share), and after every step it checks that no running
  request holds a private block written by another tenant.
* :func:`audit_server` (:mod:`~minikv.audit.isolation_server`) runs it against a server URL with
  several API keys, reading ``usage.prompt_tokens_details.cached_tokens`` (``minikv serve
  --report-cached-tokens``, or vLLM's ``--enable-prompt-tokens-details``).  From outside, the
  label of a request says whose cache its hits can have come from.

``minikv audit isolation`` (:mod:`~minikv.audit.isolation_cli`) wraps both; its exit status is 2
on a violation, 3 when inconclusive.

This module holds what both modes share -- the workload and the report -- and re-exports the
rest, so ``from minikv.audit.isolation import audit_engine, audit_server`` keeps working.
"""
from __future__ import annotations

import hashlib
from .._lazy import lazy_exports
import json
import os
import random
from dataclasses import asdict, dataclass, field
from typing import Sequence

PASS, FAIL, INCONCLUSIVE = "pass", "fail", "inconclusive"

#: label -> whose cache a hit of that request must have come from
LABELS = {"private-prime": "cross", "system-prime": "cross", "private-repeat": "same",
          "system-first": "cross", "private-copy": "cross", "system-repeat": "same"}

_WORDS = (
    "apple river stone cloud market silver garden window engine copper forest planet bridge "
    "candle harbor island ladder meadow orange pencil rocket saddle tunnel valley wagon yellow "
    "anchor basket cactus dragon falcon glacier hammer jungle kettle lantern magnet needle "
    "oyster parrot quartz ribbon sandal tiger umbrella violin walnut zebra amber blossom canyon "
    "desert ember fossil granite horizon ivory jasmine kernel lemon marble nectar olive pepper "
    "quiver raven summit thistle urchin velvet willow cobalt dune echo fjord grove haze"
).split()


@dataclass(frozen=True)
class AuditRequest:
    """One request of the workload (``prompt`` never leaves the auditor's process)."""

    wave: int
    label: str
    tenant: str
    prompt: str = field(repr=False)

    @property
    def expect(self) -> str:
        return LABELS[self.label]


def build_workload(tenants: Sequence[str], rounds: int = 2, seed: int = 0, salt: str | None = None,
                   prompt_words: int = 40, question_words: int = 6) -> list[list[AuditRequest]]:
    """The waves of requests described in the module docstring (each wave: tenants interleaved).

    ``salt`` (random by default) makes every prompt new to the server, so nothing cached by an
    earlier run -- or by other traffic -- can hit.  ``seed`` fixes the order within waves.
    """
    tenants = list(dict.fromkeys(tenants))
    if len(tenants) < 2:
        raise ValueError(f"the isolation audit needs at least 2 tenants, got {len(tenants)}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    if prompt_words < 4 or question_words < 1:
        raise ValueError("prompt_words must be >= 4 and question_words >= 1")
    salt = salt if salt is not None else os.urandom(8).hex()
    rng = random.Random(f"{seed}:{salt}")

    def words(n: int) -> str:
        return " ".join(rng.choice(_WORDS) for _ in range(n))

    def tag(t: str) -> str:  # distinct first characters per tenant: no shared first block
        return hashlib.sha256(f"{salt}/{t}".encode()).hexdigest()[:12]

    system = f"{salt} system prompt: you are the assistant of the {words(2)} company. {words(prompt_words)}."
    docs = {t: f"{tag(t)} private notes, keep secret: {words(prompt_words)}." for t in tenants}

    def q() -> str:
        return f" Question: {words(question_words)}?"

    n = len(tenants)
    waves: list[list[AuditRequest]] = []
    w0 = [AuditRequest(0, "private-prime", t, docs[t] + q()) for t in tenants]
    w0.append(AuditRequest(0, "system-prime", tenants[0], system + q()))
    w1 = [AuditRequest(1, "private-repeat", t, docs[t] + q()) for t in tenants]
    w1 += [AuditRequest(1, "system-first", u, system + q()) for u in tenants[1:]]
    w1 += [AuditRequest(1, "private-copy", u, docs[tenants[(i + 1) % n]] + q()) for i, u in enumerate(tenants)]
    w2 = [AuditRequest(2, "system-repeat", t, system + q()) for t in tenants]
    waves += [w0, w1, w2]
    for r in range(1, rounds):  # repeated prefixes, and copies of documents not copied before
        w = [AuditRequest(2 + r, "private-repeat", t, docs[t] + q()) for t in tenants]
        w += [AuditRequest(2 + r, "system-repeat", t, system + q()) for t in tenants]
        if r + 1 < n:
            w += [AuditRequest(2 + r, "private-copy", u, docs[tenants[(i + r + 1) % n]] + q())
                  for i, u in enumerate(tenants)]
        waves.append(w)
    for w in waves:
        rng.shuffle(w)
    return waves


# ---------------------------------------------------------------------------------------- report
@dataclass
class IsolationReport:
    """What one isolation audit saw, and its verdict (``pass`` / ``fail`` / ``inconclusive``)."""

    mode: str                              # "engine" or "server"
    target: str                            # engine settings or base URL (no keys, no secrets)
    tenants: tuple[str, ...]
    n_requests: int
    failures: int
    cross_tenant_cached_tokens: int
    same_tenant_cached_tokens: int
    public_cached_tokens: int = 0          # hits on operator-declared shared prefixes (allowed)
    foreign_block_holds: int = 0           # engine mode: private blocks of tenant A held by B
    by_label: dict = field(default_factory=dict)   # label -> {"requests", "cached_tokens"}
    violations: list = field(default_factory=list)  # one dict per offending request
    notes: list = field(default_factory=list)
    elapsed_s: float = 0.0

    @property
    def violation(self) -> bool:
        return self.cross_tenant_cached_tokens > 0 or self.foreign_block_holds > 0

    @property
    def verdict(self) -> str:
        if self.violation:
            return FAIL
        if self.same_tenant_cached_tokens == 0 or self.failures:
            return INCONCLUSIVE
        return PASS

    @property
    def passed(self) -> bool:
        return self.verdict == PASS

    def explanation(self) -> str:
        if self.violation:
            return (f"VIOLATION: {self.cross_tenant_cached_tokens} prompt tokens were served from another "
                    f"tenant's cache ({len(self.violations)} request(s))")
        if self.failures:
            return f"{self.failures} request(s) failed: the audit is incomplete"
        if self.same_tenant_cached_tokens == 0:
            return ("no cross-tenant hits, but no same-tenant hits either: the audit never saw a cache hit, "
                    "so it cannot tell isolation from a cache that is off (or invisible to it)")
        return (f"isolated: 0 cross-tenant cached tokens, {self.same_tenant_cached_tokens} same-tenant "
                f"cached tokens (the audit can see hits)")

    def summary(self) -> str:
        """Deterministic text for a fixed configuration (no timings, no addresses)."""
        lines = [f"isolation audit ({self.mode}), {len(self.tenants)} tenants, {self.n_requests} requests, "
                 f"{self.failures} failed",
                 f"  cross-tenant cached tokens: {self.cross_tenant_cached_tokens}",
                 f"  same-tenant cached tokens:  {self.same_tenant_cached_tokens}"]
        if self.public_cached_tokens:
            lines.append(f"  public-prefix cached tokens: {self.public_cached_tokens}")
        if self.mode == "engine":
            lines.append(f"  foreign private blocks held: {self.foreign_block_holds}")
        lines.append(f"verdict: {self.verdict.upper()} -- {self.explanation()}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.summary()

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(verdict=self.verdict, violation=self.violation, explanation=self.explanation())
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _tally(report_labels: dict, label: str, cached: int) -> None:
    entry = report_labels.setdefault(label, {"requests": 0, "cached_tokens": 0})
    entry["requests"] += 1
    entry["cached_tokens"] += cached


# ---------------------------------------------------------------------------------------- re-exports
# Resolved lazily (PEP 562): the mode modules import the report types from here, so importing
# them eagerly at the bottom of this file would make a cycle.
_EXPORTS = {"audit_engine": "isolation_engine", "_as_engine": "isolation_engine",
            "audit_server": "isolation_server",
            "add_isolation_parser": "isolation_cli", "_cmd_isolation": "isolation_cli"}


__getattr__ = lazy_exports(__package__, _EXPORTS, globals())
