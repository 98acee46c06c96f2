"""Selective sharing, both sides in one run: what each cache policy saves, and what it leaks.

    python -m minikv.bench --only sharing [--model smollm2-135m-instruct]

Cost (hit rate = cached / prompt tokens; saved = prompt tokens not prefilled):

* the hit-rate table of ``--only isolation`` (N tenants sharing one system prompt, 2 questions
  each; :func:`minikv.bench.hit_rate_vs_tenants`, on ``--model``: hit rates depend on the
  tokenizer), with the selective rows added;
* a Zipf workload, fixed so that it cannot be tuned (:data:`ZIPF`): seed 0, 64 tenants, 16
  system prompts of 256 tokens drawn with Zipf popularity (exponent 1.1), each request one system
  prompt + a 64-token suffix unique to it, 1,024 requests, sent one at a time, token ids on
  tiny-random.  Pool: :data:`POOL_BLOCKS` blocks of 16 tokens.

Both cost tables run the engine's cache decisions without its forward pass (:func:`admit_only`):
a hit rate depends on the block manager alone.

Every row uses the same quota setting, the engine's default (``max_cached_blocks_per_tenant=None``):
``num_blocks // 8`` cached blocks per tenant under ``tenant`` and ``selective``; none under
``shared``, where the engine applies no default quota.

Leak (tiny-random, a fresh engine per policy; the attacks are the course's own):

* **count oracle** -- lesson 04's :func:`~minikv.attacks.prefix_oracle.recover_secret_by_count`
  (against :class:`DecisionsOnly`: the cached-token count without the forward pass)
  with the attacker's model as guesser, on two secrets: ``top1``, 16 tokens that are the model's
  greedy continuation (the guesser's best case: one probe per block when the cache answers), and
  ``ranked``, 2 tokens at seeded ranks 0-3 of the guesser (up to 16 probes), and ``deep``, 2
  tokens both ranked 4th (the 16th probe finds them, after the monitor's threshold); every run stops
  after :data:`MAX_PROBES` probes (searching 4**16 fillings of a block is not an attack).  Under
  ``k_tenants`` the attacker also gets k-1 accounts (:class:`SybilOracle`): the Sybil limit;
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

import gc
import random
import time
import warnings
from types import SimpleNamespace

from .attacks.prefix_oracle import (PROBE_PARAMS, ModelRanker, greedy_fill, rank_candidates,
                                    recover_secret_by_count, repeats_needed, timing_rounds)
from .audit.monitor import DetectorMonitor
from .audit.stats import audit_samples
from .edge.fleet import prime_and_probe
from .engine import SamplingParams, UnsafeSettingWarning

ZIPF = dict(seed=0, tenants=64, prompts=16, prompt_tokens=256, exponent=1.1, suffix_tokens=64, requests=1024)
POOL_BLOCKS = 1024
MAX_PROBES = 16  # per extraction run: the ranked secret needs at most 4**2; top1 needs 1 when the cache answers
MONITOR = dict(cache_isolation="selective", selective_strategy="monitor", reuse_monitor=DetectorMonitor)
SELECTIVE = (("selective k=2 (BROKEN: 1 account)", dict(cache_isolation="selective", selective_k=2)),
             ("selective k=3", dict(cache_isolation="selective", selective_k=3)),
             ("selective k=5", dict(cache_isolation="selective", selective_k=5)),
             ("selective monitor", MONITOR))
GOAL = "Zipf: selective recovers >= 70% of the tenant->shared gap; 0 tokens with < k-1 accounts"


def _fork(llm, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        return llm.fork(enable_prefix_caching=True, **kw)


def _tokens(rng, vocab: int, n: int) -> list[int]:
    edge = min(1000, vocab // 4)  # clear of special ids, as minikv.bench's prompts
    return [rng.randrange(edge, vocab - edge) for _ in range(n)]


# ------------------------------------------------------------------------------------ cost
def admit_only(llm, prompt, tenant) -> tuple[int, int]:
    """One request's cache decisions, without its forward pass: ``(cached tokens, prompt tokens)``.

    The engine's own admission (isolation domain, strategy), then what ``step`` does to the block
    manager for a one-token request: allocate (lookup and hits), commit the prefilled blocks (store,
    promotions), free, finish (the monitor's record).  Only the model is skipped, and with it the
    K/V: hit rates depend on bookkeeping alone, and 1,024 prefills per row would make the bench
    too slow to run twice.  ``tests/test_selective.py`` checks it against ``generate``."""
    eng = llm.engine
    ids, text = eng.encode_prompt(prompt)
    seq = eng._new_sequence(eng.new_request_id(), ids, text, PROBE_PARAMS, tenant)
    if not eng.block_manager.allocate(seq):
        raise RuntimeError(f"a {len(ids)}-token prompt does not fit the pool of {eng.num_blocks} blocks")
    cached = seq.num_computed_tokens
    seq.num_computed_tokens = seq.num_tokens
    eng.block_manager.commit(seq)
    eng.block_manager.free(seq)
    if eng.sharing is not None:
        eng.sharing.finish(seq)
    return cached, len(ids)


class _CollectBetweenForks:
    """``admit_only`` for :func:`minikv.bench.hit_rate_vs_tenants`, which forks one engine per row:
    an engine and its block manager's listeners form a reference cycle, and without the model's
    allocations between requests the cyclic GC rarely runs, so the forks' KV pools (1 GiB each for
    SmolLM2 by default) would pile up.  Collect whenever a new engine shows up."""

    def __init__(self):
        self.engine = None

    def __call__(self, llm, prompt, tenant):
        if llm.engine is not self.engine:
            self.engine = llm.engine
            gc.collect()
        return admit_only(llm, prompt, tenant)


def zipf_workload(vocab: int) -> tuple[list[list[int]], list[tuple[str, list[int]]]]:
    """The fixed workload (:data:`ZIPF`): system prompts and ``(tenant, prompt ids)`` requests."""
    z = ZIPF
    rng = random.Random(z["seed"])
    systems = [_tokens(rng, vocab, z["prompt_tokens"]) for _ in range(z["prompts"])]
    weights = [1 / (r + 1) ** z["exponent"] for r in range(z["prompts"])]
    reqs = []
    for _ in range(z["requests"]):
        system = rng.choices(systems, weights)[0]
        reqs.append((f"t{rng.randrange(z['tenants'])}", system + _tokens(rng, vocab, z["suffix_tokens"])))
    return systems, reqs


def policies(shared_prefixes) -> list[tuple[str, dict]]:
    return [("shared (unsafe)", dict(cache_isolation="shared")), ("tenant", dict(cache_isolation="tenant")),
            ("tenant + shared_prefixes", dict(cache_isolation="tenant", shared_prefixes=shared_prefixes)),
            *SELECTIVE]


def bench_zipf(tiny) -> dict:
    """Hit rate and prefill tokens saved on the Zipf workload, one fresh pool per policy."""
    systems, reqs = zipf_workload(tiny.engine.model.shape.vocab_size)
    rows = {}
    for label, kw in policies(systems):
        llm = _fork(tiny, num_blocks=POOL_BLOCKS, **kw)
        cached = total = 0
        t0 = time.perf_counter()
        for tenant, prompt in reqs:
            c, n = admit_only(llm, prompt, tenant)
            cached, total = cached + c, total + n
        s = llm.engine.sharing
        rows[label] = dict(hit_rate=cached / total, saved_tokens=cached, prompt_tokens=total,
                           quota=llm.engine.block_manager.max_cached_per_tenant,
                           flags=getattr(s, "num_flags", None), seconds=time.perf_counter() - t0)
    gap = rows["shared (unsafe)"]["hit_rate"] - rows["tenant"]["hit_rate"]
    for r in rows.values():
        r["gap_recovered"] = (r["hit_rate"] - rows["tenant"]["hit_rate"]) / gap if gap > 0 else float("nan")
    return rows


# ------------------------------------------------------------------------------------ leak
class DecisionsOnly:
    """``llm`` seen through :func:`admit_only`: ``generate`` answers ``num_cached_tokens`` -- all the
    count oracle reads -- without running the model, so an extraction costs bookkeeping only."""

    def __init__(self, llm):
        self.llm, self.engine = llm, llm.engine

    def generate(self, prompts, params=None, tenant=None):
        return [SimpleNamespace(num_cached_tokens=admit_only(self.llm, p, tenant)[0]) for p in prompts]


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


def secrets(tiny, seed: int = 0) -> dict:
    """Three victims: ``(known prefix, secret, known suffix)`` (see the module doc)."""
    eng, vocab = tiny.engine, tiny.engine.model.shape.vocab_size
    rng = random.Random(seed)
    out = {}
    prefix = _tokens(rng, vocab, 32)
    out["top1"] = (prefix, greedy_fill(eng, prefix, 16), _tokens(rng, vocab, 16))
    prefix, secret = _tokens(rng, vocab, 30), []
    for _ in range(2):
        secret.append(rank_candidates(eng, prefix + secret, 4)[rng.randrange(4)])
    out["ranked"] = (prefix, secret, _tokens(rng, vocab, 16))
    prefix = _tokens(rng, vocab, 30)
    deep = rank_candidates(eng, prefix, 4)[3:]
    deep.append(rank_candidates(eng, prefix + deep, 4)[3])
    out["deep"] = (prefix, deep, _tokens(rng, vocab, 16))
    return out


def count_oracle(tiny, kw: dict, victim: tuple, accounts: int = 1, seed: int = 0) -> dict:
    prefix, secret, suffix = victim
    llm = DecisionsOnly(_fork(tiny, num_blocks=256, **kw))  # the model only ranks guesses (attacker side)
    llm.generate([prefix + secret + suffix + [3]], PROBE_PARAMS, tenant="victim")
    names = [f"attacker{a}" for a in range(accounts)]
    filler = _tokens(random.Random(seed + 99), tiny.engine.model.shape.vocab_size, 16)
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
    known = _tokens(rng, vocab, 512)  # after the secret block: a hit on the secret saves all of it
    cands = [_tokens(rng, vocab, 16) for _ in range(4)]
    llm = _fork(tiny, num_blocks=512, **kw)
    llm.generate([cands[0] + known + [3]], PROBE_PARAMS, tenant="victim")
    ttft = timing_rounds(llm, [c + known + [3] for c in cands], rounds=rounds, attacker_tenant="attacker", seed=seed)
    return dict(repeats_needed=repeats_needed(ttft, 0, max_repeats=rounds // 2), rounds=rounds,
                candidates=len(cands))


def timing_audit(tiny, kw: dict, n: int = 20, tokens: int = 384, seed: int = 0) -> dict:
    vocab = tiny.engine.model.shape.vocab_size
    rng = random.Random(seed)
    llm = _fork(tiny, num_blocks=512, **kw)
    llm.generate([_tokens(rng, vocab, 64)], PROBE_PARAMS, tenant="attacker")  # warm-up
    trials = ["hit"] * n + ["miss"] * n
    rng.shuffle(trials)
    times = {"hit": [], "miss": []}
    for kind in trials:
        prompt = _tokens(rng, vocab, tokens)
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


def bench_sharing(llm, tiny=None) -> dict:
    """Everything above.  ``llm``: the bench's model (the 2-question table); ``tiny``: tiny-random."""
    from .bench import hit_rate_vs_tenants
    from .llm import LLM

    tiny = tiny if tiny is not None else LLM("tiny-random", device=str(llm.engine.device))
    return {"hit_rate": hit_rate_vs_tenants(llm, extra_policies=SELECTIVE, measure=_CollectBetweenForks()), "zipf": bench_zipf(tiny),
            "leaks": bench_leaks(tiny), "zipf_workload": ZIPF, "zipf_pool_blocks": POOL_BLOCKS}


def format_sharing(rep: dict) -> list[str]:
    lines = ["  selective sharing -- cost (quota: the engine default, max_cached_blocks_per_tenant=None):"]
    lines.append("    hit rate, N tenants sharing one system prompt, 2 questions each:")
    for label, by_n in rep["hit_rate"].items():
        lines.append(f"      {label:<36} " + "  ".join(f"N={n}: {r:5.1%}" for n, r in by_n.items()))
    lines.append(f"    Zipf workload {rep['zipf_workload']}, pool {rep['zipf_pool_blocks']} blocks, tiny-random:")
    for label, r in rep["zipf"].items():
        flags = f"  flags {r['flags']}" if r["flags"] is not None else ""
        lines.append(f"      {label:<36} hit {r['hit_rate']:6.1%}  saved {r['saved_tokens']:7,d} of "
                     f"{r['prompt_tokens']:,} prompt tokens  gap recovered {r['gap_recovered']:6.1%}  "
                     f"quota {r['quota']}{flags}  ({r['seconds']:.1f} s)")
    lines.append("  selective sharing -- leak (tiny-random; attacks of lessons 04, 09, 10):")
    for label, row in rep["leaks"].items():
        lines.append(f"    {label}:")
        for name, r in row.items():
            if name == "ttft":
                lines.append(f"      TTFT oracle: repeats needed {r['repeats_needed']} ({r['rounds']} rounds, "
                             f"{r['candidates']} candidates)")
            elif name == "timing_audit":
                lines.append(f"      timing audit: p={r['p']:.3g} AUC={r['auc']:.3f} detected={r['detected']} "
                             f"(median {r['median_hit_ms']:.2f} ms vs {r['median_miss_ms']:.2f} ms, n={r['n']}/arm)")
            elif name == "prime_and_probe":
                lines.append(f"      prime-and-probe: attacker's cached tokens {r[0]} (no victim) vs {r[6]} (6 victim requests)")
            else:
                flags = f", flags {r['flags']}" if r["flags"] is not None else ""
                lines.append(f"      count oracle [{name}]: {r['recovered']}/{r['of']} secret tokens recovered, "
                             f"{r['probes']} probes = {r['requests']} requests, {r['accounts']} account(s){flags}")
    lines.append(f"  goal: {GOAL}")
    return lines
