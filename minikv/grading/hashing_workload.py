"""The engine run behind the exercise-1 and exercise-2 graders: one workload, compared both ways.

Direct calls can prove a hasher is injective, but only an engine shows whether the cache it
drives isolates tenants.  So every hashing grader ends by installing the learner's code in a
real engine, running :data:`WORKLOAD` (a public system prompt, private documents, the anonymous
tenant, the tenant named ``''``, blocks moved to the front of a prompt) and comparing what was
cached with minikv's own reference on exactly the same requests -- in *both* directions: no
cross-tenant hit, and the same-tenant hits a working cache must have.

Engine runs use ``verify_hits=False``: the engine's hit verification is a second wall that
would hide a hasher bug, and these checks test the first wall alone.  Tests call the
``engine_stage_*`` functions on their own to prove the engine run catches each mutant by itself.
"""
from __future__ import annotations

import functools

from ._report import CheckFailed, expect, single_thread
from .engines import ENGINE_SECRET, GREEDY, HitLog, tiny_llm, use_block_keys, use_key_derivation

SYSTEM = list(range(40, 50))   # 10 tokens: blocks 0-1 public, block 2 straddles the prefix end
DOC = list(range(60, 72))      # 12 tokens of a tenant's private document
LEAD = [80, 81, 82, 83]        # one block ...
MOVED = list(range(90, 98))    # ... and two blocks that later start a prompt (contamination test)


def _q(i: int) -> list[int]:
    return [120 + 3 * i, 121 + 3 * i, 122 + 3 * i]


#: (tenant, prompt) run one after another; see the comments for what a correct engine does.
WORKLOAD = [
    ("alice", SYSTEM + DOC + _q(0)),   # first request: nothing cached
    ("alice", SYSTEM + DOC + _q(1)),   # same tenant, same prefix: 5 full blocks hit (20 tokens)
    ("bob", SYSTEM + DOC + _q(2)),     # another tenant: only the 2 public blocks (8 tokens)
    (None, SYSTEM + DOC + _q(3)),      # the anonymous tenant: only the public blocks
    ("carol", LEAD + MOVED + _q(4)),   # carol: a lead block, then two blocks ...
    ("carol", MOVED + _q(7)),          # ... sent again at the start: chained keys must miss
    ("", SYSTEM + DOC + _q(5)),        # tenant "" is not the anonymous tenant: public blocks only
    ("bob", SYSTEM + DOC + _q(6)),     # bob again: his own blocks hit
]


def tenant_name(t) -> str:
    return "None (anonymous)" if t is None else ("'' (empty name)" if t == "" else str(t))


def run_workload(llm, workload=WORKLOAD) -> tuple[list[int], HitLog]:
    """Cached-token count of every request of ``workload``, and the hit log."""
    log = HitLog(llm.engine)
    cached = [llm.generate([prompt], GREEDY, tenant=tenant)[0].num_cached_tokens for tenant, prompt in workload]
    return cached, log


def compare_with_reference(cached: list[int], log: HitLog, ref_cached: list[int], hint: str,
                           workload=WORKLOAD) -> None:
    """Both directions: no cross-tenant hit, same-tenant hits happen, and every request's
    cached-token count equals the reference engine's."""
    if log.cross:
        who = sorted({(h[0], h[1]) for h in log.cross}, key=str)
        pairs = ", ".join(f"{tenant_name(a)} hit {tenant_name(b)}'s private block" for a, b in who)
        raise CheckFailed(f"cross-tenant cache hits in the engine: {pairs} ({len(log.cross)} block hits)", hint)
    expect(log.same, "no request ever hit its own tenant's cache: isolation that never hits is not isolation, "
           "it is a cache that does not work", hint)
    for i, ((tenant, prompt), got, want) in enumerate(zip(workload, cached, list(ref_cached))):
        expect(got == want,
               f"request {i + 1} ({tenant_name(tenant)}, {len(prompt)} tokens) had {got} cached tokens, "
               f"the reference engine {want}", hint)


# --------------------------------------------------------------------------- engine stages
# Each runs the learner's code inside a real engine on WORKLOAD and raises CheckFailed on any
# difference from the engine's reference.  The graders call them after the direct-call checks;
# tests call them alone to prove the engine run catches each mutant by itself.

def _engine(**kwargs):
    return tiny_llm(enable_prefix_caching=True, verify_hits=False, shared_prefixes=[SYSTEM],
                    engine_secret=ENGINE_SECRET, **kwargs)


@functools.lru_cache(maxsize=None)
def reference_cached(hash_algo: str = "sha256") -> tuple[int, ...]:
    """Cached tokens per WORKLOAD request on minikv's own engine (deterministic, so computed once)."""
    with single_thread():
        return tuple(run_workload(_engine(hash_algo=hash_algo))[0])


@single_thread()
def engine_stage_hasher(hasher, reference_algo: str) -> tuple[list[int], HitLog]:
    """``LLM(block_hasher=hasher)`` must cache exactly what ``hash_algo=reference_algo`` caches."""
    cached, log = run_workload(_engine(block_hasher=hasher))
    ref_cached = reference_cached(reference_algo)
    compare_with_reference(cached, log, ref_cached,
                           "a hit needs the same parent, tokens, extra and tenant key, and the tenant key must enter "
                           "every block: bob may hit only the public system-prompt blocks, and blocks sent again at "
                           "the start of a prompt must miss (their parent differs).")
    return cached, log


@single_thread()
def engine_stage_key_derivation(derive_tenant_key) -> tuple[list[int], HitLog]:
    """An engine deriving tenant keys with the learner's function must cache what minikv's does."""
    cached, log = run_workload(use_key_derivation(_engine(), derive_tenant_key, ENGINE_SECRET))
    ref_cached = reference_cached("sha256")
    compare_with_reference(cached, log, ref_cached,
                           "every tenant (including None and '') needs its own key, derived from the secret.")
    return cached, log


@single_thread()
def engine_stage_block_keys(block_keys) -> tuple[list[int], HitLog]:
    """An engine computing its chains with the learner's ``block_keys`` must cache what minikv's does."""
    cached, log = run_workload(use_block_keys(_engine(hash_algo="hmac-sha256"), block_keys))
    ref_cached = reference_cached("hmac-sha256")
    compare_with_reference(cached, log, ref_cached, "the tenant key must reach every private block's key.")
    return cached, log
