"""Graders for exercise 4: the two-directional, concurrent isolation audit.

The learner's audit is run against five real engines whose correct verdict is known (and is
also what the engine's reference audit, ``minikv.audit.isolation.audit_engine``, concludes):

=====================================================  ================
engine                                                 correct verdict
=====================================================  ================
tenant-isolated cache (minikv's default)               pass
cache shared across tenants (UNSAFE)                   fail
tenant-isolated, but the hasher drops the tenant key   fail
prefix caching off                                     inconclusive
per-request isolation (nothing is ever reused)         inconclusive
=====================================================  ================

Besides the verdict, the audit's counts must equal the engine's ground truth (a block-manager
listener records who wrote every block that was hit), and requests of at least two tenants
must have run in the same engine step (the audit is concurrent).
"""
from __future__ import annotations

import functools

from ..audit.isolation import audit_engine
from ..security.hashing import make_hasher
from ._report import expect, grader
from .engines import BS, ENGINE_SECRET, HitLog, tiny_llm


def _untenanted_sha256():
    """A hasher that silently drops the tenant key (the salt never reaches the cache key)."""
    inner = make_hasher("sha256", ENGINE_SECRET)

    def hasher(parent, tokens, extra, tenant_key):
        return inner(parent, tokens, extra, None)

    return hasher


#: name -> (engine settings, correct verdict, what the engine does)
ENGINES = {
    "isolated": (dict(enable_prefix_caching=True), "pass", "a tenant-isolated cache"),
    "shared": (dict(enable_prefix_caching=True, cache_isolation="shared"), "fail", "a cache shared across tenants"),
    "dropped-key": (dict(enable_prefix_caching=True, verify_hits=False, block_hasher="untenanted"), "fail",
                    "tenant isolation whose hasher drops the tenant key"),
    "cache-off": (dict(enable_prefix_caching=False), "inconclusive", "prefix caching off"),
    "per-request": (dict(enable_prefix_caching=True, cache_isolation="request"), "inconclusive",
                    "per-request isolation (no reuse at all)"),
}


def _engine(name: str):
    settings = dict(ENGINES[name][0])
    if settings.get("block_hasher") == "untenanted":
        settings["block_hasher"] = _untenanted_sha256()
    # 1024 blocks: the default per-tenant quota (num_blocks // 8 = 128 blocks of 4 tokens) then holds
    # both of a tenant's ~40-block documents, so its repeats can hit (a smaller pool makes every
    # tenant recycle its own cache and the correct verdict on the isolated engine 'inconclusive').
    return tiny_llm(num_blocks=1024, engine_secret=ENGINE_SECRET, **settings)


@functools.lru_cache(maxsize=None)
def reference_verdict(name: str) -> str:
    """What minikv's own audit concludes on engine ``name`` (cached per process)."""
    return audit_engine(_engine(name), tenants=("alice", "bob", "carol"), rounds=1, seed=0, salt="grading",
                        prompt_words=8).verdict


def verdict_bug_class(got: str, want: str) -> str:
    """The name of the mistake behind verdict ``got`` where ``want`` was right."""
    return {("pass", "inconclusive"): "one-directional audit -- 0 cross-tenant hits without any hit proves nothing",
            ("fail", "inconclusive"): "'saw no hit' reported as a leak -- inconclusive is not fail",
            ("inconclusive", "fail"): "checks in the wrong order -- a leak is a leak even without a same-tenant hit",
            ("pass", "fail"): "a leak reported as a pass",
            ("fail", "pass"): "a working isolated cache reported as leaking",
            ("inconclusive", "pass"): "same-tenant hits not counted"}.get((got, want), "wrong verdict")


CASES = [((0, 0), "inconclusive"), ((0, 12), "pass"), ((4, 0), "fail"), ((4, 12), "fail"), ((0, 1), "pass"),
         ((1, 0), "fail")]


@grader("an audit must be able to fail, and must prove it could see a hit: both directions, in the right order.")
def check_audit_verdict(audit_verdict) -> str:
    """Exercise 4a: the two-directional verdict rule."""
    for (cross, same), want in CASES:
        got = audit_verdict(cross, same)
        why = {"inconclusive": "the audit never saw a cache hit, so 0 cross-tenant hits proves nothing "
                               "(vLLM docs PR #53347: a one-sided test also passes when caching is off)",
               "fail": "any cross-tenant cached token is a leak", "pass": "no leak, and the audit could see hits"}[want]
        expect(got == want, f"audit_verdict(cross={cross}, same={same}) returned {got!r}, expected {want!r}: {why} "
               f"(bug class: {verdict_bug_class(got, want)})")
    return "fail on any leak, inconclusive without a same-tenant hit, pass otherwise"


class _Concurrency:
    """Wraps one engine's scheduler: records, per step, which tenants ran together, and which requests
    ever ran in a step beside another tenant's request (a probe that runs alone tests nothing a batch does)."""

    def __init__(self, engine):
        self.max_tenants = 0
        self.steps = 0
        self.requests: set = set()
        self.beside_another: set = set()
        original = engine.scheduler.schedule

        def schedule():
            batch = original()
            seqs = batch.prefills + batch.chunks + batch.decodes  # a prefill chunk runs beside the others too
            tenants = {s.tenant for s in seqs}
            self.max_tenants = max(self.max_tenants, len(tenants))
            self.steps += 1
            self.requests.update(s.request_id for s in seqs)
            if len(tenants) >= 2:
                self.beside_another.update(s.request_id for s in seqs)
            return batch

        engine.scheduler.schedule = schedule

    def alone(self) -> int:
        """How many requests never shared an engine step with another tenant's request."""
        return len(self.requests - self.beside_another)


@grader("both directions, concurrently: tenants re-send their own documents AND send each other's, in shared "
        "engine steps.")
def check_isolation_audit(isolation_audit) -> str:
    """Exercise 4b: correct verdict on five engines, counts equal ground truth, concurrency."""
    seen = []
    for name, (_, want, what) in ENGINES.items():
        llm = _engine(name)
        log = HitLog(llm.engine)
        conc = _Concurrency(llm.engine)
        report = isolation_audit(llm, tenants=("alice", "bob", "carol"))
        for attr in ("verdict", "cross_tenant_cached_tokens", "same_tenant_cached_tokens"):
            expect(hasattr(report, attr), f"the report has no attribute {attr!r}", "return an IsolationReport.")
        expect(conc.steps > 0, "the audit never ran the engine it was given", "send the requests to `llm`.")
        expect(conc.max_tenants >= 2,
               f"requests of different tenants never ran in the same engine step (engine with {what}) (bug class: "
               "'concurrent' probes that never share a scheduler step with the victim)",
               "queue a whole wave at once, e.g. llm.generate(prompts, params, tenant=tenants): isolation must hold "
               "inside a batch, not only between quiet requests.")
        expect(not conc.alone(),
               f"{conc.alone()} of the audit's {len(conc.requests)} requests never ran in an engine step beside another "
               f"tenant's request (engine with {what}) (bug class: 'concurrent' probes that never share a scheduler "
               "step with the victim -- some wave was sent one request at a time)",
               "the contract makes BOTH waves concurrent: queue each whole wave, tenants mixed, in one call.")
        true_cross = BS * len(log.cross)
        true_same = BS * len(log.same)
        expect(report.cross_tenant_cached_tokens == true_cross,
               f"on an engine with {what}, your audit counted {report.cross_tenant_cached_tokens} cross-tenant "
               f"cached tokens; the engine served {true_cross} tokens from another tenant's blocks (bug class: hits "
               "attributed to the wrong direction)",
               "a request's cached tokens are cross-tenant only if nobody but another tenant can have sent that "
               "prefix before (a copy of another tenant's document, or a first-time request); re-sends of your "
               "own document are same-tenant.")
        expect(report.same_tenant_cached_tokens == true_same,
               f"on an engine with {what}, your audit counted {report.same_tenant_cached_tokens} same-tenant "
               f"cached tokens; the engine served {true_same} tokens from the tenant's own blocks (bug class: hits "
               "attributed to the wrong direction)",
               "count the cached tokens of each tenant's re-sends of its own document as same-tenant.")
        if want == "fail":
            expect(true_cross > 0, f"on an engine with {what}, your workload never made one tenant send another "
                   "tenant's prompt, so the leak could not show (bug class: an audit blind to the leak it looks for)",
                   "in wave 2, every tenant must also send ANOTHER tenant's document (what an attacker does).")
        if want == "pass":
            expect(true_same > 0, f"on an engine with {what}, your workload never re-sent a tenant's own document, so "
                   "no same-tenant hit could happen and the audit cannot tell a working isolated cache from a cache "
                   "that never hits (bug class: no same-tenant control)",
                   "in wave 2, every tenant must also re-send its OWN document: the hit it gets proves the audit can "
                   "see hits at all.")
        ref = reference_verdict(name)
        expect(report.verdict == want,
               f"on an engine with {what}, your verdict is {report.verdict!r}; the correct verdict is {want!r} "
               f"(minikv's reference audit says {ref!r}) (bug class: {verdict_bug_class(report.verdict, want)})",
               {"fail": "any cross-tenant cached token means 'fail'.",
                "pass": "0 cross-tenant AND > 0 same-tenant cached tokens means 'pass'.",
                "inconclusive": "with 0 cross-tenant and 0 same-tenant cached tokens the audit saw no hit at all: "
                                "'inconclusive', never 'pass' (check both directions)."}[want])
        if ref != want:  # the reference audit disagrees with the table: a grader bug, not the learner's
            raise RuntimeError(f"reference audit verdict {ref!r} on {name!r}, expected {want!r}")
        seen.append(f"{name}={report.verdict}")
    return "right verdict on all five engines (" + ", ".join(seen) + "), counts match the engine, tenants concurrent"
