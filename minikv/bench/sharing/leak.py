"""The leak side: the course's own attacks against every policy (tiny-random, a fresh engine each).

* **count oracle** -- lesson 04's :func:`~minikv.attacks.prefix_oracle.recover_secret_by_count`
  (against :class:`~minikv.bench.sharing.cost.DecisionsOnly`: the cached-token count without the
  forward pass) with the attacker's model as guesser, on the three victims of
  :func:`~minikv.bench.sharing.workload.secrets`: ``top1`` (one probe per block when the cache
  answers), ``ranked`` (up to 16 probes) and ``deep`` (the 16th probe finds it, after the
  monitor's threshold); every run stops after :data:`MAX_PROBES` probes (searching 4**16 fillings
  of a block is not an attack).  Under ``k_tenants`` the attacker also gets k-1 accounts
  (:class:`SybilOracle`): the Sybil limit;
* **TTFT oracle** -- :func:`~minikv.attacks.prefix_oracle.timing_rounds` over the true block and
  three wrong ones, each followed by the same 512 known tokens (the secret is the first block, so a
  hit saves the whole prefill), 8 rounds, then ``repeats_needed`` up to 4 (None: not decided);
* **timing audit** -- the protocol of ``minikv audit timing`` (Gu et al.: victim primes a random
  384-token prompt, the attacker re-sends it; misses are fresh prompts; shuffled; 20 per arm;
  one-sided KS + AUC via :func:`minikv.audit.stats.audit_samples`) run in-process on the engine's
  TTFT, not over HTTP, so that it runs in seconds;
* **prime-and-probe** -- lesson 10's :func:`minikv.edge.fleet.prime_and_probe`: the attacker's
  cached tokens after 0 and after 6 victim requests (a difference is the signal).
"""
from __future__ import annotations

import random
import warnings

from ...attacks.prefix_oracle import (PROBE_PARAMS, ModelRanker, recover_secret_by_count, repeats_needed,
                                     timing_rounds)
from ...audit.stats import audit_samples
from ...edge.fleet import prime_and_probe
from ...engine import UnsafeSettingWarning
from .cost import DecisionsOnly
from .workload import SELECTIVE, fork_caching, policies, random_tokens, secrets

MAX_PROBES = 16  # per extraction run: the ranked secret needs at most 4**2; top1 needs 1 when the cache answers


class SybilOracle:
    """Lesson 04's attack, unchanged, against ``k_tenants`` with ``accounts`` colluding tenants.

    Each probe (known prefix + guess + one filler token) is sent by every account with one extra
    block ``Y`` after the guess, then once more by the last account.  If a k-th tenant -- the
    victim -- computed the guess, the last account's store promoted it, and the re-send hits the
    public guess but misses ``Y`` (chained on the guess's old private key): exactly the guess's
    block end is cached.  A wrong guess stays private and the re-send hits all of its own copy.
    The attack sees a hit exactly in the first case.  ``requests`` counts what was really sent."""

    def __init__(self, llm, accounts: list[str], filler: list[int]):
        self.llm, self.engine, self.accounts, self.filler = llm, llm.engine, accounts, filler
        self.requests = 0

    def generate(self, prompts, params=None, tenant=None):
        (ids,) = prompts
        bs = self.engine.block_size
        block_end = (len(ids) - 1) // bs * bs
        extended = ids[:block_end] + self.filler[:bs] + ids[block_end:]
        for a in self.accounts:
            self.llm.generate([extended], PROBE_PARAMS, tenant=a)
        out = self.llm.generate([extended], PROBE_PARAMS, tenant=self.accounts[-1])[0]
        self.requests += len(self.accounts) + 1
        if out.num_cached_tokens >= block_end + bs:  # its own private copy: no promotion
            out.num_cached_tokens = 0
        return [out]


def count_oracle(tiny, kw: dict, victim: tuple, accounts: int = 1, seed: int = 0) -> dict:
    prefix, secret, suffix = victim
    llm = DecisionsOnly(fork_caching(tiny, num_blocks=256, **kw))  # the model only ranks guesses (attacker side)
    llm.generate([prefix + secret + suffix + [3]], PROBE_PARAMS, tenant="victim")
    names = [f"attacker{a}" for a in range(accounts)]
    filler = random_tokens(random.Random(seed + 99), tiny.engine.model.shape.vocab_size, 16)
    k_tenants = kw.get("cache_isolation") == "selective" and "selective_k" in kw
    oracle = SybilOracle(llm, names, filler) if k_tenants else llm
    rec = recover_secret_by_count(oracle, prefix, len(secret), suffix, attacker_tenant=names[0],
                                  ranker=ModelRanker(tiny.engine, 4), max_probes=MAX_PROBES)
    right = 0
    while right < len(rec.token_ids) and rec.token_ids[right] == secret[right]:
        right += 1
    sent = oracle.requests if isinstance(oracle, SybilOracle) else rec.probes
    return dict(recovered=right, of=len(secret), probes=rec.probes, requests=sent, accounts=accounts,
                flags=getattr(llm.engine.sharing, "num_flags", None))


def ttft_oracle(tiny, kw: dict, seed: int = 0, rounds: int = 8) -> dict:
    """Lesson 04's TTFT oracle: the repeats needed to pick the true block among 4 by lowest median
    TTFT.  Only up to ``rounds // 2`` counts: drawing r of ``rounds`` rounds with r near ``rounds``
    gives nearly the same draw every time, so one lucky ordering (1 in 4) would pass."""
    vocab = tiny.engine.model.shape.vocab_size
    rng = random.Random(seed)
    known = random_tokens(rng, vocab, 512)  # after the secret block: a hit on the secret saves all of it
    cands = [random_tokens(rng, vocab, 16) for _ in range(4)]
    llm = fork_caching(tiny, num_blocks=512, **kw)
    llm.generate([cands[0] + known + [3]], PROBE_PARAMS, tenant="victim")
    ttft = timing_rounds(llm, [c + known + [3] for c in cands], rounds=rounds, attacker_tenant="attacker", seed=seed)
    return dict(repeats_needed=repeats_needed(ttft, 0, max_repeats=rounds // 2), rounds=rounds,
                candidates=len(cands))


def timing_audit(tiny, kw: dict, n: int = 20, tokens: int = 384, seed: int = 0) -> dict:
    vocab = tiny.engine.model.shape.vocab_size
    rng = random.Random(seed)
    llm = fork_caching(tiny, num_blocks=512, **kw)
    llm.generate([random_tokens(rng, vocab, 64)], PROBE_PARAMS, tenant="attacker")  # warm-up
    trials = ["hit"] * n + ["miss"] * n
    rng.shuffle(trials)
    times = {"hit": [], "miss": []}
    for kind in trials:
        prompt = random_tokens(rng, vocab, tokens)
        if kind == "hit":
            llm.generate([prompt], PROBE_PARAMS, tenant="victim")
        times[kind].append(llm.generate([prompt], PROBE_PARAMS, tenant="attacker")[0].metrics.ttft_s)
    r = audit_samples(times["hit"], times["miss"])
    return dict(p=r.p_value, auc=r.auc, detected=r.detected, median_hit_ms=1e3 * r.median_hit,
                median_miss_ms=1e3 * r.median_miss, n=n)


def bench_leaks(tiny, timing: bool = True) -> dict:
    """Every attack against every policy (``timing=False``: only the deterministic ones, the count
    oracle and prime-and-probe, as lesson 10 runs them)."""
    victims = secrets(tiny)
    rows = {}
    for label, kw in policies([])[:2] + [("tenant + shared_prefixes", dict(cache_isolation="tenant",
                                          shared_prefixes=[victims["top1"][0][:16]]))] + list(SELECTIVE):
        row = {name: count_oracle(tiny, kw, v) for name, v in victims.items()}
        k = kw.get("selective_k") if kw.get("selective_strategy", "k_tenants") == "k_tenants" else None
        if kw.get("cache_isolation") == "selective" and k:
            for m in sorted({k - 2, k - 1} - {0, 1}):
                row.update({f"{name}, {m} accounts": count_oracle(tiny, kw, v, accounts=m) for name, v in victims.items()})
        if timing:
            row["ttft"] = ttft_oracle(tiny, kw)
            row["timing_audit"] = timing_audit(tiny, kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnsafeSettingWarning)
            row["prime_and_probe"] = {v: prime_and_probe(tiny, v, **kw) for v in (0, 6)}
        rows[label] = row
    return rows
