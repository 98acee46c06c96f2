"""Wrong answers to exercise 4: isolation audits that cannot see the leak they look for.

An audit is a test of a test: it must be able to *fail*.  That takes both directions (a tenant
must hit its own cache, or "no cross-tenant hit" proves nothing), requests batched together
(isolation bugs hide in the scheduler), and a workload that actually sends one tenant's
document as another.  Each mutant drops one of these and reports "pass" on a leaking engine.
"""
from __future__ import annotations

import random

from ...engine.sampling import SamplingParams
from ._table import entries


def verdict_one_direction(cross, same) -> str:
    """Checks only that nobody else hit: 'pass' when nothing was ever cached."""
    return "fail" if cross > 0 else "pass"


def verdict_wrong_order(cross, same) -> str:
    """Tests 'no hit at all' first: a leak with no same-tenant hit is reported 'inconclusive'."""
    if same == 0:
        return "inconclusive"
    return "fail" if cross > 0 else "pass"


def verdict_strict_pass(cross, same) -> str:
    """Treats 'no hit at all' as a failure: an engine with caching off 'fails' its isolation audit."""
    if cross > 0 or same == 0:
        return "fail"
    return "pass"


def _docs(llm, tenants, seed):
    eng = llm.engine
    rng = random.Random(seed)
    bs, vocab = eng.block_size, eng.model.shape.vocab_size
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    return {t: fresh(3 * bs) for t in tenants}, fresh, bs


_AUDIT_PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def _report(n, cross, same, verdict):
    from types import SimpleNamespace
    return SimpleNamespace(n_requests=n, cross_tenant_cached_tokens=cross, same_tenant_cached_tokens=same,
                           verdict=verdict)


def _good_verdict(cross, same):
    return "fail" if cross > 0 else ("inconclusive" if same == 0 else "pass")


def audit_one_direction(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """The right workload with a one-directional verdict (the one-sided test vLLM docs PR #53347 warns about)."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    cross = same = 0
    outs = llm.generate([docs[t] + fresh(bs) for t in tenants], _AUDIT_PARAMS, tenant=tenants)
    cross += sum(o.num_cached_tokens for o in outs)
    wave = [("same", t, docs[t]) for t in tenants] + [("cross", u, docs[tenants[(i + 1) % len(tenants)]])
                                                      for i, u in enumerate(tenants)]
    outs = llm.generate([d + fresh(bs) for _, _, d in wave], _AUDIT_PARAMS, tenant=[t for _, t, _ in wave])
    for (kind, _, _), o in zip(wave, outs):
        same += o.num_cached_tokens if kind == "same" else 0
        cross += o.num_cached_tokens if kind == "cross" else 0
    return _report(len(tenants) * 3, cross, same, verdict_one_direction(cross, same))


def audit_sequential(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """Right workload and verdict, but one request at a time: isolation is never tested inside a batch."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    cross = same = 0
    for t in tenants:
        cross += llm.generate([docs[t] + fresh(bs)], _AUDIT_PARAMS, tenant=t)[0].num_cached_tokens
    for i, u in enumerate(tenants):
        same += llm.generate([docs[u] + fresh(bs)], _AUDIT_PARAMS, tenant=u)[0].num_cached_tokens
        other = docs[tenants[(i + 1) % len(tenants)]]
        cross += llm.generate([other + fresh(bs)], _AUDIT_PARAMS, tenant=u)[0].num_cached_tokens
    return _report(len(tenants) * 3, cross, same, _good_verdict(cross, same))


def audit_grouped_by_tenant(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """'Concurrent' in name only: each wave is sent one tenant at a time (a list per tenant), so the
    victim's and the prober's requests never share a scheduler step."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    cross = same = 0
    for t in tenants:
        cross += sum(o.num_cached_tokens for o in llm.generate([docs[t] + fresh(bs)], _AUDIT_PARAMS, tenant=[t]))
    for i, u in enumerate(tenants):
        other = docs[tenants[(i + 1) % len(tenants)]]
        outs = llm.generate([docs[u] + fresh(bs), other + fresh(bs)], _AUDIT_PARAMS, tenant=[u, u])
        same += outs[0].num_cached_tokens
        cross += outs[1].num_cached_tokens
    return _report(len(tenants) * 3, cross, same, _good_verdict(cross, same))


def audit_second_wave_serial(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """Wave 1 concurrent, but wave 2 -- the cross-tenant probes -- sent one request at a time: a probe
    never runs beside the victim's re-send, so the leak a batch can cause is never tested."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    cross = sum(o.num_cached_tokens for o in llm.generate([docs[t] + fresh(bs) for t in tenants], _AUDIT_PARAMS,
                                                          tenant=tenants))
    same = 0
    for i, u in enumerate(tenants):
        same += llm.generate([docs[u] + fresh(bs)], _AUDIT_PARAMS, tenant=u)[0].num_cached_tokens
        other = docs[tenants[(i + 1) % len(tenants)]]
        cross += llm.generate([other + fresh(bs)], _AUDIT_PARAMS, tenant=u)[0].num_cached_tokens
    return _report(len(tenants) * 3, cross, same, _good_verdict(cross, same))


def audit_no_control(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """Both waves concurrent, the verdict rule right, but wave 2 sends only the cross-tenant probes: with
    no tenant re-sending its own document the audit can never see a hit, so a working isolated cache
    reads 'inconclusive'."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    outs = llm.generate([docs[t] + fresh(bs) for t in tenants], _AUDIT_PARAMS, tenant=tenants)
    cross = sum(o.num_cached_tokens for o in outs)
    outs = llm.generate([docs[tenants[(i + 1) % len(tenants)]] + fresh(bs) for i in range(len(tenants))],
                        _AUDIT_PARAMS, tenant=tenants)
    cross += sum(o.num_cached_tokens for o in outs)
    return _report(len(tenants) * 2, cross, 0, _good_verdict(cross, 0))


def audit_everything_cross(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """Counts every cached token as cross-tenant: even a tenant's own re-send 'leaks'."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    prompts = [docs[t] + fresh(bs) for t in tenants]
    llm.generate(prompts, _AUDIT_PARAMS, tenant=tenants)
    wave = [(t, docs[t]) for t in tenants] + [(u, docs[tenants[(i + 1) % len(tenants)]]) for i, u in enumerate(tenants)]
    outs = llm.generate([d + fresh(bs) for _, d in wave], _AUDIT_PARAMS, tenant=[t for t, _ in wave])
    cross = sum(o.num_cached_tokens for o in outs)
    return _report(len(tenants) * 3, cross, 0, _good_verdict(cross, 0))


def audit_no_copy(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """Never sends another tenant's document: every tenant only repeats its own, so a shared
    cache can never show a cross-tenant hit (the audit is blind to the leak it looks for)."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    cross = same = 0
    outs = llm.generate([docs[t] + fresh(bs) for t in tenants], _AUDIT_PARAMS, tenant=tenants)
    cross += sum(o.num_cached_tokens for o in outs)
    outs = llm.generate([docs[t] + fresh(bs) for t in tenants], _AUDIT_PARAMS, tenant=tenants)
    same += sum(o.num_cached_tokens for o in outs)
    return _report(len(tenants) * 2, cross, same, _good_verdict(cross, same))


MUTANTS = {
    "4a": entries(("one-direction", verdict_one_direction), ("wrong-order", verdict_wrong_order),
                  ("strict-pass", verdict_strict_pass)),
    "4b": entries(("one-direction", audit_one_direction), ("sequential", audit_sequential),
                  ("grouped-by-tenant", audit_grouped_by_tenant),
                  ("everything-cross", audit_everything_cross), ("no-copy", audit_no_copy),
                  ("second-wave-serial", audit_second_wave_serial), ("no-control", audit_no_control)),
}


DIAGNOSES = {
    ("4a", "one-direction"): "one-directional audit", ("4a", "wrong-order"): "wrong order",
    ("4a", "strict-pass"): "reported as a leak",
    ("4b", "one-direction"): "one-directional audit", ("4b", "sequential"): "never share a scheduler step",
    ("4b", "grouped-by-tenant"): "never share a scheduler step", ("4b", "everything-cross"): "wrong direction",
    ("4b", "no-copy"): "blind to the leak", ("4b", "second-wave-serial"): "never share a scheduler step",
    ("4b", "no-control"): "no same-tenant control",
}
