"""The ``tiers`` section, ``python -m minikv.bench --only tiers``: what KV tiers below the pool cost and save.

Two engine *instances* (forks of the bench's model: own pools, one operator secret) each with
``kv_tiers=["host", "redis://..."]``, as two ``minikv serve --kv-tier host --kv-tier redis://...``
processes sharing one Redis.  Without a reachable Redis (``$MINIKV_REDIS_URL``, default
``redis://127.0.0.1:6390/0``: ``make redis`` starts one) the Redis rows are skipped, saying so, and
the host tier's still run.

* **Workload**: several tenants send the same few prefixes, round after round, to alternating
  instances, on pools smaller than the prefixes together: pool hit rate, tier hit rate (per tier)
  and the fraction recomputed, of prompt tokens; and the hits on a tenant's *first* request of a
  prefix, which would be cross-tenant (tiers are tenant-keyed: 0 expected).
* **TTFT** of a 1,000-token prefix (median over ``repeats``): a pool hit, a host-tier hit (the
  prefix offloaded by another tenant's flood), a Redis hit (on the *other* instance) and a miss
  (a miss on a tiered instance pays the store: sealing and writing every full block).  Each
  timed hit is checked to have come from the tier it is named after.
* **Sealing**: seal (AES-256-GCM, whose tag is the MAC) and open per block, from the tier link's own
  timers (``TierLink.stats`` ``seal_s``/``open_s``), per 1,000-token request, and the cleartext setting's HMAC-only seal
  of the same block beside it; the open time of a Redis hit over that hit's TTFT.

Targets: a Redis hit <= 0.5x a miss at 1,000 tokens; encryption + MAC <= 10% of a Redis hit.
"""
from __future__ import annotations

import os
import statistics
import time

from .base import completed, random_prompts, resident
from ..engine import SamplingParams

TARGETS = {"redis_hit_over_miss": 0.5, "seal_over_redis_hit": 0.10}
DEFAULT_REDIS = "redis://127.0.0.1:6390/0"


def redis_unreachable(url: str) -> str | None:
    """None when a Redis answers at ``url``; else why not, naming ``make redis``."""
    try:
        import redis
    except ImportError:
        return "the redis client is not installed (pip install 'minikv[tiers]')"
    try:
        redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0).ping()
    except Exception as exc:  # noqa: BLE001 -- any failure means "no Redis here"
        return f"no Redis at {url} ({type(exc).__name__}): start one with `make redis`"
    return None


def _instances(llm, tiers, num_blocks, secret):
    """Two instances over the same tiers and secret (forks: the bench's weights, fresh pools)."""
    kw = dict(enable_prefix_caching=True, num_blocks=num_blocks, kv_tiers=tiers, engine_secret=secret,
              max_cached_blocks_per_tenant=num_blocks, max_num_seqs=1)
    return resident(llm.fork(**kw)), resident(llm.fork(**kw))


def _one(llm, prompt, tenant):
    """``(output, tier tokens, {tier: blocks})`` of one request alone."""
    eng = llm.engine
    tok0, by0 = eng.stats["tier_tokens"], dict(eng.tiers.hits_by_tier)
    out = completed(llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
                                 tenant=tenant))[0]
    return out, eng.stats["tier_tokens"] - tok0, {k: v - by0[k] for k, v in eng.tiers.hits_by_tier.items()}


def hit_rates(llm, tiers, secret, tenants=3, prefixes=2, rounds=3, tokens=256, seed=0) -> dict:
    """The workload: every tenant sends the same ``prefixes`` (+ a question of its own) each round,
    on pools that hold half the distinct prefix blocks.  The rounds but the last go to instance A,
    every other one in reverse order (its first requests hit the pool, later ones the host tier);
    the last round goes to instance B (hits there come from Redis)."""
    vocab, bs = llm.engine.model.shape.vocab_size, llm.engine.block_size
    texts = random_prompts(vocab, prefixes, tokens, tokens, seed)
    questions = random_prompts(vocab, rounds * tenants * prefixes, 16, 16, seed + 1)
    per_request = -(-(tokens + 17) // bs)
    num_blocks = max(per_request + 2, prefixes * tenants * (tokens // bs) // 2)
    pair = _instances(llm, tiers, num_blocks, secret)
    order = [(t, p) for t in range(tenants) for p in range(prefixes)]
    prompt = cached = tier = first_hits = 0
    by_tier: dict[str, int] = {}
    seen = set()
    for r in range(rounds):
        for n, (t, p) in enumerate(order if r % 2 == 0 else order[::-1]):
            q = questions[r * len(order) + n]
            out, tier_tokens, blocks = _one(pair[r == rounds - 1], texts[p] + q, f"tenant-{t}")
            prompt += len(out.prompt_token_ids)
            cached += out.num_cached_tokens
            tier += tier_tokens
            for k, v in blocks.items():
                by_tier[k] = by_tier.get(k, 0) + v * bs
            if (t, p) not in seen:  # a tenant's first request of a prefix: any hit crossed tenants
                first_hits += out.num_cached_tokens
                seen.add((t, p))
    return {"requests": rounds * len(order), "tenants": tenants, "prompt_tokens": prompt,
            "pool_blocks": num_blocks, "distinct_prefix_blocks": len(order) * (tokens // bs),
            "pool_hit_rate": (cached - tier) / prompt, "tier_hit_rate": tier / prompt,
            "tier_hit_rate_by_tier": {k: v / prompt for k, v in by_tier.items()},
            "recompute": 1 - cached / prompt, "first_request_hit_tokens": first_hits}


def _seal_micro(link, repeats=20) -> dict:
    """Seconds per block to seal with AES-GCM, to seal with the cleartext HMAC alone, and to open."""
    from ..security.sealing import Sealer, binding, tier_key
    payload = os.urandom(link.nbytes)
    bound = binding(tier_key(link.space, b"\x01" * 32), link.model, link.dtype, link.geometry, tuple(range(link.bs)))
    best = {}
    for name, sealer in (("seal", link.sealer), ("mac_only", Sealer(b"m" * 32, encrypt=False))):
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            value = sealer.seal(payload, bound, ("domain", b"t"))
            times.append(time.perf_counter() - t0)
        best[name] = statistics.median(times)
        if name == "seal":
            t = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                sealer.open(value, bound, ("domain", b"t"))
                t.append(time.perf_counter() - t0)
            best["open"] = statistics.median(t)
    return best


def ttfts(llm, tiers, secret, prefix_tokens=1000, repeats=5, seed=0) -> dict:
    """TTFT (ms, median of ``repeats``) of a pool hit, a host-tier hit, a Redis hit and a miss on a
    ``prefix_tokens`` prefix, each checked to be what it is named; the sealing costs beside them.
    The four alternate within each round (a shared machine's load moves all four alike), after one
    untimed round (every forward shape seen once)."""
    vocab, bs = llm.engine.model.shape.vocab_size, llm.engine.block_size
    x, flood = random_prompts(vocab, 2, prefix_tokens, prefix_tokens, seed)
    qs = random_prompts(vocab, 5 * (repeats + 1), 20, 20, seed + 1)
    a, b = _instances(llm, tiers, -(-(prefix_tokens + 21) // bs) + 2, secret)  # room for one request
    la, lb = a.engine.tiers, b.engine.tiers
    full = prefix_tokens // bs  # the prefix's full blocks: what a hit can reuse
    redis_on = any(s.startswith("redis") for s in tiers)
    times: dict[str, list[float]] = {"miss": [], "pool_hit": [], "host_hit": [], "redis_hit": []}
    out: dict = {"prefix_tokens": prefix_tokens, "repeats": repeats, "blocks_per_prefix": full}
    seal = opened = open_s = stored = 0.0
    host_blocks = []
    for i in range(repeats + 1):
        q = qs[5 * i: 5 * i + 5]
        a.engine.reset_prefix_cache()  # a miss: fresh tokens, an empty pool (no eviction in the clock)
        seal0, stored0 = la.stats["seal_s"], la.stats["stored"]
        miss, tier_tokens, _ = _one(a, [t ^ (i + 1) for t in x] + q[0], f"miss-{i}")
        assert miss.num_cached_tokens == 0 and tier_tokens == 0, (miss.num_cached_tokens, tier_tokens)
        seal_i, stored_i = la.stats["seal_s"] - seal0, la.stats["stored"] - stored0  # the store on full (Redis)
        a.engine.reset_prefix_cache()
        _one(a, x + q[1], "t0")  # X into A's pool (from Redis when on; computed, and stored, the first time)
        pool, tier_tokens, _ = _one(a, x + q[2], "t0")
        assert pool.num_cached_tokens >= full * bs and tier_tokens == 0
        _one(a, flood + q[3], "flood")  # another tenant evicts X into the host tier
        a.engine.reset_prefix_cache("flood")  # its blocks go without offload: room for X, nothing sealed in the clock
        host, _, hblocks = _one(a, x + q[4], "t0")
        assert host.num_cached_tokens >= full * bs and hblocks["host"] >= full // 2, (host.num_cached_tokens, hblocks)
        if redis_on:  # instance B: an empty pool, nothing in its host tier, the same Redis
            b.engine.reset_prefix_cache()
            open0, opened0 = lb.stats["open_s"], lb.stats["onloaded"]
            red, _, blocks = _one(b, x + q[0], "t0")
            assert red.num_cached_tokens >= full * bs and blocks.get("redis", 0) >= full, (red.num_cached_tokens, blocks)
        if i == 0:
            continue  # the untimed round
        times["miss"].append(miss.metrics.ttft_s)
        times["pool_hit"].append(pool.metrics.ttft_s)
        times["host_hit"].append(host.metrics.ttft_s)
        host_blocks.append(hblocks["host"])
        seal, stored = seal + seal_i, stored + stored_i
        if redis_on:
            times["redis_hit"].append(red.metrics.ttft_s)
            open_s += lb.stats["open_s"] - open0
            opened += lb.stats["onloaded"] - opened0
    for k, v in times.items():
        if v:
            out[f"{k}_ms"] = 1000 * statistics.median(v)
    out["seal_per_miss_s"], out["stored_per_miss"] = seal / repeats, stored / repeats
    out["host_blocks_per_hit"] = statistics.median(host_blocks)  # the rest of the prefix was still in the pool
    micro = _seal_micro(la)
    out.update(block_bytes=la.nbytes, seal_per_block_s=micro["seal"], mac_only_per_block_s=micro["mac_only"],
               open_per_block_micro_s=micro["open"])
    for k in ("pool_hit", "host_hit", "redis_hit"):
        if f"{k}_ms" in out:
            out[f"{k}_over_miss"] = out[f"{k}_ms"] / out["miss_ms"]
    if redis_on:
        out["open_per_redis_hit_s"], out["open_per_block_s"] = open_s / repeats, open_s / opened
        out["seal_over_redis_hit"] = out["open_per_redis_hit_s"] * 1000 / out["redis_hit_ms"]
    return out


def bench_tiers(llm, redis_url: str | None = None, prefix_tokens=1000, repeats=5, tenants=3,
                workload_tokens=256, seed=0) -> dict:
    """The tiers section: the workload's hit rates, the TTFTs and the sealing costs."""
    url = redis_url or os.environ.get("MINIKV_REDIS_URL") or DEFAULT_REDIS
    skipped = redis_unreachable(url)
    tiers = ["host"] + ([] if skipped else [f"{url}?ttl=600"])
    secret = os.urandom(32)  # this run's operator secret: its keys never meet an earlier run's
    return {"model": str(llm.engine.config.model), "dtype": str(llm.engine.dtype).removeprefix("torch."),
            "block_size": llm.engine.block_size, "tiers": ["host", "redis" if not skipped else "redis (skipped)"],
            "redis_skipped": skipped,
            "workload": hit_rates(llm, tiers, secret, tenants=tenants, tokens=workload_tokens, seed=seed),
            "ttft": ttfts(llm, tiers, secret, prefix_tokens=prefix_tokens, repeats=repeats, seed=seed)}


def _verdict(value: float, target: float) -> str:
    return f"target <= {target:g}   {'PASS' if value <= target else 'FAIL'}"


def format_tiers(r: dict) -> list[str]:
    w, t = r["workload"], r["ttft"]
    lines = [f"  KV tiers ({r['model']}, {r['dtype']}, block {r['block_size']}; 2 instances, tiers "
             f"{' + '.join(r['tiers'])}):"]
    if r["redis_skipped"]:
        lines.append(f"    redis rows skipped: {r['redis_skipped']}")
    lines.append(f"    workload: {w['requests']} requests, {w['tenants']} tenants, {w['prompt_tokens']} prompt tokens; "
                 f"pool {w['pool_blocks']} blocks per instance < {w['distinct_prefix_blocks']} distinct prefix blocks")
    per_tier = ", ".join(f"{k} {v:.1%}" for k, v in w["tier_hit_rate_by_tier"].items())
    lines.append(f"    pool hit rate {w['pool_hit_rate']:6.1%}   tier hit rate {w['tier_hit_rate']:6.1%} ({per_tier})   "
                 f"recompute {w['recompute']:6.1%}")
    lines.append(f"    hit tokens on a tenant's first request of a prefix (cross-tenant): {w['first_request_hit_tokens']}")
    lines.append(f"    TTFT, {t['prefix_tokens']:,}-token prefix (median of {t['repeats']}):")
    for k, label in (("pool_hit", "pool hit"), ("host_hit", "host-tier hit"), ("redis_hit", "redis hit"), ("miss", "miss")):
        if f"{k}_ms" in t:
            ratio = f"   / miss {t[f'{k}_over_miss']:.3f}" if k != "miss" else ""
            more = f"   ({t['host_blocks_per_hit']:.0f} of {t['blocks_per_prefix']} blocks from the host tier)" if k == "host_hit" else ""
            lines.append(f"      {label:<14} {t[f'{k}_ms']:9.1f} ms{ratio}{more}")
        else:
            lines.append(f"      {label:<14}   skipped (no Redis: `make redis`)")
    if "redis_hit_over_miss" in t:
        lines.append(f"    redis hit / miss {t['redis_hit_over_miss']:.3f} ({t['redis_hit_ms']:.2f} / {t['miss_ms']:.2f} ms)   "
                     + _verdict(t["redis_hit_over_miss"], TARGETS["redis_hit_over_miss"]))
    lines.append(f"    sealing, per block of {t['block_bytes']:,} bytes: seal (AES-256-GCM) {1e6 * t['seal_per_block_s']:.1f} us "
                 f"(cleartext HMAC alone {1e6 * t['mac_only_per_block_s']:.1f} us), open {1e6 * t['open_per_block_micro_s']:.1f} us")
    lines.append(f"    per miss that stores {t['stored_per_miss']:.0f} blocks: seal {1000 * t['seal_per_miss_s']:.2f} ms")
    if "seal_over_redis_hit" in t:
        lines.append(f"    per redis hit ({t['blocks_per_prefix']} blocks): open {1000 * t['open_per_redis_hit_s']:.2f} ms "
                     f"({1e6 * t['open_per_block_s']:.1f} us/block); open / redis hit {t['seal_over_redis_hit']:.3f} "
                     f"({1000 * t['open_per_redis_hit_s']:.3f} / {t['redis_hit_ms']:.2f} ms)   "
                     + _verdict(t["seal_over_redis_hit"], TARGETS["seal_over_redis_hit"]))
    return lines
