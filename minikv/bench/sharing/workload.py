"""What the sharing benchmark runs: the policies it compares and the requests it sends.

Everything here is fixed in advance (seeded, sized by constants), so that no row can be tuned
after seeing its result.  The rows (:func:`policies`): UNSAFE ``shared``, ``tenant`` with and
without an operator-declared ``shared_prefixes``, and the selective strategies (:data:`SELECTIVE`).

* The Zipf workload (:data:`ZIPF`): seed 0, 64 tenants, 16 system prompts of 256 tokens drawn
  with Zipf popularity (exponent 1.1), each request one system prompt + a 64-token suffix unique
  to it, 1,024 requests, sent one at a time, token ids on tiny-random.  Pool: :data:`POOL_BLOCKS`
  blocks of 16 tokens.
* The victims of the leak side (:func:`secrets`): ``top1``, 16 tokens that are the attacker
  model's greedy continuation (the guesser's best case), ``ranked``, 2 tokens at seeded ranks 0-3
  of the guesser, and ``deep``, 2 tokens both ranked 4th.

Every row uses the same quota setting, the engine's default (``max_cached_blocks_per_tenant=None``):
``num_blocks // 8`` cached blocks per tenant under ``tenant`` and ``selective``; none under
``shared``, where the engine applies no default quota.
"""
from __future__ import annotations

import random
import warnings

from ...attacks.prefix_oracle import greedy_fill, rank_candidates
from ...audit.monitor import DetectorMonitor
from ...engine import UnsafeSettingWarning

ZIPF = dict(seed=0, tenants=64, prompts=16, prompt_tokens=256, exponent=1.1, suffix_tokens=64, requests=1024)
POOL_BLOCKS = 1024
MONITOR = dict(cache_isolation="selective", selective_strategy="monitor", reuse_monitor=DetectorMonitor)
SELECTIVE = (("selective k=2 (BROKEN: 1 account)", dict(cache_isolation="selective", selective_k=2)),
             ("selective k=3", dict(cache_isolation="selective", selective_k=3)),
             ("selective k=5", dict(cache_isolation="selective", selective_k=5)),
             ("selective monitor", MONITOR))


def policies(shared_prefixes) -> list[tuple[str, dict]]:
    """Every row: ``(label, fork settings)``; ``shared_prefixes`` for the operator-declared one."""
    return [("shared (unsafe)", dict(cache_isolation="shared")), ("tenant", dict(cache_isolation="tenant")),
            ("tenant + shared_prefixes", dict(cache_isolation="tenant", shared_prefixes=shared_prefixes)),
            *SELECTIVE]


def fork_caching(llm, **kw):
    """``llm.fork`` with prefix caching on, quietly: some rows are UNSAFE on purpose."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        return llm.fork(enable_prefix_caching=True, **kw)


def random_tokens(rng, vocab: int, n: int) -> list[int]:
    """``n`` token ids drawn by ``rng``, clear of the special ids at both ends of the vocabulary."""
    edge = min(1000, vocab // 4)  # as minikv.bench's prompts
    return [rng.randrange(edge, vocab - edge) for _ in range(n)]


def zipf_workload(vocab: int) -> tuple[list[list[int]], list[tuple[str, list[int]]]]:
    """The fixed workload (:data:`ZIPF`): system prompts and ``(tenant, prompt ids)`` requests."""
    z = ZIPF
    rng = random.Random(z["seed"])
    systems = [random_tokens(rng, vocab, z["prompt_tokens"]) for _ in range(z["prompts"])]
    weights = [1 / (r + 1) ** z["exponent"] for r in range(z["prompts"])]
    reqs = []
    for _ in range(z["requests"]):
        system = rng.choices(systems, weights)[0]
        reqs.append((f"t{rng.randrange(z['tenants'])}", system + random_tokens(rng, vocab, z["suffix_tokens"])))
    return systems, reqs


def secrets(tiny, seed: int = 0) -> dict:
    """Three victims: ``(known prefix, secret, known suffix)`` (see the module doc)."""
    eng, vocab = tiny.engine, tiny.engine.model.shape.vocab_size
    rng = random.Random(seed)
    out = {}
    prefix = random_tokens(rng, vocab, 32)
    out["top1"] = (prefix, greedy_fill(eng, prefix, 16), random_tokens(rng, vocab, 16))
    prefix, secret = random_tokens(rng, vocab, 30), []
    for _ in range(2):
        secret.append(rank_candidates(eng, prefix + secret, 4)[rng.randrange(4)])
    out["ranked"] = (prefix, secret, random_tokens(rng, vocab, 16))
    prefix = random_tokens(rng, vocab, 30)
    deep = rank_candidates(eng, prefix, 4)[3:]
    deep.append(rank_candidates(eng, prefix + deep, 4)[3])
    out["deep"] = (prefix, deep, random_tokens(rng, vocab, 16))
    return out
