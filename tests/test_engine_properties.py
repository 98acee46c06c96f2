"""Property-based tests: random multi-tenant workloads of add / step / abort on a small pool.

Hypothesis drives the engine through interleavings no one would write by hand (aborts in the
middle of prefill, preemption while blocks are shared, the same prefix across tenants in one
step) and checks after every step that the bookkeeping holds, that isolation holds in both
directions, and that every finished request got exactly the tokens it gets alone with caching
off.

The runs are *derandomized* (the same examples every time, so a red CI is reproducible) and
their coverage is *proved*, not hoped for: each example records what it exercised
(``hypothesis.event`` shows it in ``--hypothesis-show-statistics``, and a set collects it), and
the test fails if any of preemption, eviction, quota eviction, abort, deduplication, each
isolation mode, each hash algorithm or each scrub policy never happened.

``make test`` runs ``EXAMPLES`` examples; ``make test-thorough`` (``MINIKV_THOROUGH=1``) runs
``THOROUGH_EXAMPLES`` and prints how many it ran.
"""
from __future__ import annotations

import functools
import os
from collections import Counter
import random
import warnings

import torch
from hypothesis import HealthCheck, event, given, settings, target
from hypothesis import strategies as st

from minikv import LLM, SamplingParams, UnsafeSettingWarning
from minikv.engine.config import CACHE_ISOLATION, HASH_ALGOS, SCRUB_POLICIES
from minikv.engine.lifecycle import REUSES, crosses_tenants
from tests.engine_helpers import compare_with_ties

BS = 4
SYSTEM = [30 + i % 50 for i in range(13)]  # an operator-declared public prefix (3 full blocks + 1)
PREFIXES = [SYSTEM, [100 + i for i in range(9)], [200 + i % 7 for i in range(18)]]
SUFFIXES = [[1, 2, 3], [4, 5, 6, 7, 8], [9] * 6, [10, 11]]
TENANTS = ["alice", "bob", "carol", None]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
ISOLATIONS = tuple(m for m in CACHE_ISOLATION if m != "selective")  # selective: tests/test_selective*.py
THOROUGH = bool(os.environ.get("MINIKV_THOROUGH"))
EXAMPLES, THOROUGH_EXAMPLES = 500, 10_000
MUST_SEE = ({"preemption", "eviction", "quota eviction", "abort", "deduplication", "same-tenant hit"}
            | {f"isolation={m}" for m in ISOLATIONS} | {f"hash={a}" for a in HASH_ALGOS}
            | {f"scrub={s}" for s in SCRUB_POLICIES})


@functools.lru_cache(maxsize=1)
def _base() -> LLM:
    """One copy of the weights; every example forks an engine with its own pool from it."""
    return LLM("tiny-random", device="cpu", dtype="float32", block_size=BS)


@functools.lru_cache(maxsize=None)
def _reference(ids: tuple) -> tuple:
    """Greedy tokens and per-step logits of ``ids`` alone, caching off."""
    eng = _base().engine
    eng.logit_trace = []
    out = _run_alone(eng, f"ref-{eng.new_request_id()}", list(ids), None)
    trace, eng.logit_trace = eng.logit_trace, None
    return out.outputs[0].token_ids, [t[out.request_id] for t in trace]


def _run_alone(eng, rid, ids, tenant):
    eng.add_request(rid, ids, PARAMS, tenant=tenant)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out


request = st.tuples(st.sampled_from(range(len(PREFIXES))), st.sampled_from(range(len(SUFFIXES))),
                    st.sampled_from(TENANTS), st.integers(0, 3), st.booleans())
workloads = dict(workload=st.lists(request, min_size=3, max_size=10),
                 isolation=st.sampled_from(ISOLATIONS),
                 hash_algo=st.sampled_from(HASH_ALGOS),
                 scrub=st.sampled_from(SCRUB_POLICIES),
                 num_blocks=st.integers(12, 40),
                 quota=st.sampled_from([None, "unlimited", 3]))


def _one_workload(seen: Counter, workload, isolation, hash_algo, scrub, num_blocks, quota) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        eng = _base().engine.fork(num_blocks=num_blocks, enable_prefix_caching=True, cache_isolation=isolation,
                                  hash_algo=hash_algo, scrub=scrub, max_num_seqs=4, shared_prefixes=[SYSTEM],
                                  max_cached_blocks_per_tenant=quota)
    bm = eng.block_manager
    hits, evictions, in_quota = [], [], []
    bm.listeners.append(lambda ev, ids, seq: hits.extend(
        (seq.tenant, bm.blocks[b].writer_tenant, bm.blocks[b].public) for b in ids) if ev in REUSES else None)
    bm.listeners.append(lambda ev, ids, seq: evictions.extend([bool(in_quota)] * len(ids)) if ev == "evict" else None)
    enforce = bm._enforce_quota

    def enforce_quota(*args):  # tells quota evictions from LRU ones (same event, another cause)
        in_quota.append(1)
        try:
            enforce(*args)
        finally:
            in_quota.pop()
    bm._enforce_quota = enforce_quota

    prompts, finished, aborted = {}, {}, set()
    pending = list(enumerate(workload))
    step = 0
    while pending or eng.has_unfinished_requests():
        while pending and pending[0][1][3] <= 0:
            i, (p, s, tenant, _, abort) = pending.pop(0)
            rid = f"r{i}"
            prompts[rid] = (tuple(PREFIXES[p] + SUFFIXES[s]), tenant, abort)
            eng.add_request(rid, list(prompts[rid][0]), PARAMS, tenant=tenant)
        if pending:  # count down the delay of the next arrival
            i, (p, s, t, delay, a) = pending[0]
            pending[0] = (i, (p, s, t, delay - 1, a))
        for out in eng.step():
            if out.finished:
                finished[out.request_id] = out
        step += 1
        for rid, (_, _, abort) in prompts.items():
            if abort and rid not in finished and rid not in aborted and rid in eng.requests and step % 2:
                eng.abort_request(rid)
                aborted.add(rid)
        eng.check_invariants()
        assert step < 500, "the engine stopped making progress"
    assert bm.num_available == num_blocks, "blocks leaked"
    # Finish with a same-tenant repeat on the now idle engine, so that "no cross-tenant hit"
    # cannot pass by caching nothing at all.
    for rid, suffix in (("repeat-1", SUFFIXES[0]), ("repeat-2", SUFFIXES[1])):
        prompts[rid] = (tuple(PREFIXES[1] + suffix), "alice", False)
        finished[rid] = _run_alone(eng, rid, list(prompts[rid][0]), "alice")
    cross = [h for h in hits if crosses_tenants(h[:2], h[2])]
    if isolation == "request":
        assert not hits
    else:
        # A quota keeps a tenant's oldest *requests* out, but the head of its latest one stays.
        kept = min(2, bm.max_cached_per_tenant or 2)
        assert finished["repeat-2"].num_cached_tokens >= kept * BS, "same-tenant repeat did not hit"
    if isolation == "tenant":
        assert not cross, f"cross-tenant hits: {cross}"
        assert any(h[0] == h[1] == "alice" for h in hits)
    ties = []
    for rid, out in finished.items():
        ref, ref_logits = _reference(prompts[rid][0])
        compare_with_ties(out.outputs[0].token_ids, ref, ref_logits, rid, ties)
    assert set(finished) | aborted == set(prompts)

    what = {f"isolation={isolation}", f"hash={hash_algo}", f"scrub={scrub}"}
    what |= {"preemption"} if eng.stats["preemptions"] else set()
    what |= {"abort"} if aborted else set()
    what |= {"eviction"} if not all(evictions) else set()
    what |= {"quota eviction"} if any(evictions) else set()
    what |= {"deduplication"} if bm.num_deduplicated else set()
    what |= {"same-tenant hit"} if any(h[0] == h[1] for h in hits) else set()
    for w in sorted(what):
        event(w)
    target(float(eng.stats["preemptions"] + len(evictions)), label="preemptions + evictions")
    seen.update(what)


def test_random_multi_tenant_workloads():
    """``EXAMPLES`` derandomized workloads (``THOROUGH_EXAMPLES`` with MINIKV_THOROUGH=1); then
    proof that each thing in ``MUST_SEE`` happened in at least one of them."""
    seen: Counter = Counter()
    count = [0]
    n = THOROUGH_EXAMPLES if THOROUGH else EXAMPLES

    @settings(max_examples=n, derandomize=True, database=None, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(**workloads)
    def run(**kw):
        count[0] += 1
        _one_workload(seen, **kw)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: threads only add overhead (12x on a loaded 2-core box)
    try:
        run()
    finally:
        torch.set_num_threads(threads)
    print(f"\nengine property test: {count[0]} examples ran ({'thorough' if THOROUGH else 'default'} profile); "
          f"examples that exercised each: {dict(sorted(seen.items()))}")
    assert count[0] >= n, f"only {count[0]} examples ran"
    assert not MUST_SEE - set(seen), f"never exercised: {sorted(MUST_SEE - set(seen))}"


def test_block_manager_alone_random_ops():
    """The torch-free block manager with tenant keys: random allocate / append / commit / free
    never breaks invariants, a hit only returns blocks with the right tokens, and no hit crosses
    tenants on a keyed (private) block -- while same-tenant hits do happen."""
    from minikv.engine.block_manager import BlockManager
    from minikv.engine.sequence import Sequence
    from minikv.security.hashing import make_hasher
    from minikv.security.keys import derive_tenant_key

    secret = b"s" * 32
    keys = {t: derive_tenant_key(secret, t) for t in ("a", "b", None)}
    seen_hits = {"same": 0, "cross": 0}
    for seed in range(12):
        rng = random.Random(seed)
        shared = seed % 3 == 0  # some runs share one domain (no keys), the rest are keyed per tenant
        bm = BlockManager(24, BS, hasher=make_hasher("sha256", secret), enable_caching=True,
                          max_cached_per_tenant=None if seed % 2 else 6)
        hits = []
        bm.listeners.append(lambda ev, ids, seq: hits.extend(
            (seq.tenant, bm.blocks[b].writer_tenant) for b in ids) if ev in REUSES else None)
        live: list[Sequence] = []
        for n in range(300):
            op = rng.random()
            if op < 0.4:
                tenant = rng.choice(["a", "b", None])
                seq = Sequence(f"s{n}", [rng.randrange(3) for _ in range(rng.randint(1, 14))], PARAMS,
                               tenant=tenant, tenant_key=None if shared else keys[tenant])
                if bm.allocate(seq):
                    for i, bid in enumerate(seq.block_table[:seq.num_computed_tokens // BS]):
                        assert bm.blocks[bid].identity.tokens == seq.block_tokens(i, BS)
                        assert bm.blocks[bid].identity.domain == seq.tenant_key
                    seq.num_computed_tokens = seq.num_tokens
                    bm.commit(seq)
                    live.append(seq)
            elif op < 0.75 and live:
                seq = rng.choice(live)
                if bm.num_available or seq.num_tokens < len(seq.block_table) * BS:
                    seq.output_token_ids.append(rng.randrange(3))
                    assert bm.append_slot(seq)
                    seq.num_computed_tokens = seq.num_tokens
                    bm.commit(seq)
            elif live:
                bm.free(live.pop(rng.randrange(len(live))))
            bm.check_invariants(live)
        for seq in live:
            bm.free(seq)
        bm.check_invariants([])
        assert bm.num_available == 24
        cross = [h for h in hits if h[0] != h[1]]
        assert shared or not cross, f"seed {seed}: cross-tenant hits on keyed blocks: {cross[:3]}"
        seen_hits["same"] += sum(h[0] == h[1] for h in hits)
        seen_hits["cross"] += len(cross)
    assert seen_hits["same"] and seen_hits["cross"], seen_hits  # both directions were exercised
