"""The security settings of :class:`~minikv.engine.config.EngineConfig`: what each means, how
it is checked, and which are UNSAFE.

The config is one flat dataclass (vLLM's style: every setting is a keyword of ``LLM(...)`` and a
``minikv serve`` flag); :mod:`~minikv.engine.config` holds the core fields a learner reads first
-- model, device, dtype, pool and batch sizes, backend -- and this module the rest: isolation,
hashing, scrubbing, the per-tenant quota, selective sharing, the audit trail and the KV tiers.

Settings marked UNSAFE exist for teaching.  They reproduce what real engines did (or still do)
and each one enables a leak that a lesson demonstrates; choosing one emits an
:class:`UnsafeSettingWarning` (``unsafe_settings`` lists them).

Fields (see ``minikv.security``):

    cache_isolation: ``"tenant"`` (hits only within a tenant), ``"request"`` (no reuse
        across requests), ``"selective"`` (tenant-keyed, except what ``selective_strategy``
        shares: ``minikv.sharing``) or UNSAFE ``"shared"`` (any request hits any
        cached block).
    selective_strategy: under ``"selective"``, ``"k_tenants"`` (default: content becomes
        public once ``selective_k`` distinct tenants computed it) or ``"monitor"`` (shared
        until ``reuse_monitor`` flags a tenant or prefix; UNSAFE before the first flag).
    selective_k: distinct tenants before promotion (default 3; an attacker needs k-1
        accounts; UNSAFE 2: one account suffices).
    reuse_monitor: factory ``reuse_monitor(config) -> ReuseMonitor`` for ``"monitor"``
        (``minikv.audit.monitor.DetectorMonitor``: the audit detector).
    hash_algo: ``"sha256"``, ``"hmac-sha256"``, ``"blake2b-keyed"``, or UNSAFE
        ``"builtin"``, ``"trunc32"``, ``"poly"``.
    chain_hashes: a block key covers its parent's key; UNSAFE when False.
    verify_hits: what a hit must match before its K/V are reused (``lifecycle.VerifyHits``;
        stored as that enum): its whole identity -- tokens, parent block and domain (True,
        ``VerifyHits.IDENTITY``); UNSAFE ``"tokens"``, tokens only (what nano-vllm does);
        UNSAFE False, nothing (trust the hash).
    scrub: ``"on_alloc"``, ``"on_free"`` or UNSAFE ``"none"``.
    engine_secret: bytes from which per-tenant keys are derived (random when None).
        Never logged, never returned: it is excluded from ``repr``.
    shared_prefixes: operator-declared public prefixes (str or token lists) whose blocks
        every tenant may share; what follows them stays tenant-keyed.
    sensitive_prefixes: operator-marked sensitive content (str or token lists): under
        ``"selective"``, the block where one of them occurs in a prompt and every block after
        it stay private (never opened or promoted; ``minikv/sharing/``).  Refused under
        ``"shared"``; ``"tenant"`` and ``"request"`` keep everything private already.
    max_cached_blocks_per_tenant: most cached blocks one tenant may keep, the defense against
        prime-and-probe (an attacker fills the pool with its own cached blocks and counts how
        many a victim's load evicts).  With a quota, a tenant that needs room recycles its
        own cached blocks before anyone else's, and trims its cache to the quota when a
        request ends.  None (default) means ``max(1, num_blocks // 8)`` under ``"tenant"``
        and ``"request"`` isolation: one tenant keeps at most 1/8 of the pool, so the other
        7/8 is left for everyone else's running requests and caches, and one attacker account
        cannot make a victim's request evict its blocks unless that request (plus the caches
        of the other busy tenants) needs more than 7/8 of the pool.  A bigger share raises
        a lone tenant's hit rate and shrinks the room the guarantee needs; 1/8 is a plain
        middle.  Under ``"shared"`` the default stays unbounded (that mode is UNSAFE
        anyway).  UNSAFE ``"unlimited"`` turns the quota off, for the lessons that show the
        attack.  **No per-tenant quota survives an attacker with many accounts**: 8 accounts
        at quota fill the pool, and then every new allocation must evict somebody's cached
        block -- the channel is narrowed to "one account's share", not closed.
    audit_log: path of the operator's JSONL audit trail, or None.
    audit_level: ``"request"`` (one summary line per request) or ``"block"`` (one line per
        block event, for tracing); see docs/ARCHITECTURE.md, "Audit trail".
    kv_tiers: KV tiers below the pool, in lookup order (``minikv.tiers``): specs such
        as ``"host"`` (bounded, in-process; the pool's LRU evicts into it) and
        ``"redis://127.0.0.1:6390/0"`` (shared by instances; TTL, per-tenant byte budget).
        Empty (default): no tier, the pool is the whole cache.  Instances sharing a store
        must share ``engine_secret`` (their keys and MACs derive from it).  An entry may also
        be a tier object (``HostTier(..., name="store", when="store")``), used as it is:
        engines in one process given the same object share it.
    kv_tier_keys: ``"tenant"`` (default: a block's tier key is its tenant-keyed pool hash) or
        UNSAFE ``"content"`` (the content chain alone: LMCache #4825's ``cache_salt=''``).
    kv_tier_encrypt: seal K/V with per-tenant AES-GCM in the tiers (default); UNSAFE False
        stores them in the clear (still MACed).
    block_hasher / scrubber: learner-supplied implementations of the seams; they override
        ``hash_algo`` / ``scrub``.
"""
from __future__ import annotations

import os
from typing import Any

from ..security.hashing import HASHERS, UNSAFE_HASHES
from ..security.keys import check_secret
from ..security.scrub import SCRUBBERS, UNSAFE_SCRUBBERS
from .checks import as_int, check_bool, check_choice, positive_int, show
from .lifecycle import VerifyHits

CACHE_ISOLATION = ("shared", "tenant", "request", "selective")
#: the selective-sharing strategies' names (``minikv.sharing.STRATEGIES`` builds them)
SHARING_STRATEGIES = ("k_tenants", "monitor")
SCRUB_POLICIES = tuple(SCRUBBERS)  # the registries' names, in registration order
HASH_ALGOS = tuple(HASHERS)
UNSAFE_HASH_ALGOS = tuple(a for a in HASH_ALGOS if a in UNSAFE_HASHES)
AUDIT_LEVELS = ("request", "block")  # = minikv.audit.trail.LEVELS (not imported: the engine stays audit-free)
UNLIMITED = "unlimited"  # max_cached_blocks_per_tenant: no quota (UNSAFE; lessons on prime-and-probe)
QUOTA_SHARE = 8  # default quota: 1/QUOTA_SHARE of the pool per tenant (see cache_quota)
#: ``kv_tier_keys``: "tenant" (the pool's tenant-keyed hash) or UNSAFE "content" (the salt dropped
#: at the tier boundary: LMCache #4825's ``cache_salt=''``)
TIER_KEYS = ("tenant", "content")


class UnsafeSettingWarning(UserWarning):
    """An engine setting that deliberately re-creates a known leak (for lessons)."""


def check_security_settings(c) -> None:
    """Check (and normalize, in place) config ``c``'s security settings; errors name the field."""
    check_choice("cache_isolation", c.cache_isolation, CACHE_ISOLATION)
    check_choice("scrub", c.scrub, SCRUB_POLICIES)
    check_choice("selective_strategy", c.selective_strategy, SHARING_STRATEGIES)
    c.selective_k = as_int("selective_k", c.selective_k)
    if c.selective_k < 2:
        raise ValueError(f"selective_k must be >= 2, got {show(c.selective_k)} (k=1 would share "
                         "every block at once: that is cache_isolation='shared')")
    if c.reuse_monitor is not None and not callable(c.reuse_monitor):
        raise TypeError(f"reuse_monitor must be a factory reuse_monitor(config) -> monitor, got "
                        f"{type(c.reuse_monitor).__name__}")
    if c.selective_strategy == "monitor" and c.cache_isolation == "selective" and c.reuse_monitor is None:
        raise ValueError("selective_strategy='monitor' needs reuse_monitor= (a factory; "
                         "minikv.audit.monitor.DetectorMonitor wraps the audit detector)")
    check_choice("audit_level", c.audit_level, AUDIT_LEVELS)
    check_choice("hash_algo", c.hash_algo, HASH_ALGOS)
    c.verify_hits = VerifyHits.of(c.verify_hits)
    if c.max_cached_blocks_per_tenant not in (None, UNLIMITED):
        if isinstance(c.max_cached_blocks_per_tenant, str):
            raise ValueError(f"max_cached_blocks_per_tenant={show(c.max_cached_blocks_per_tenant)} is not "
                             f"valid; give a number of blocks, None (the default quota) or {UNLIMITED!r}")
        c.max_cached_blocks_per_tenant = positive_int("max_cached_blocks_per_tenant", c.max_cached_blocks_per_tenant)
    if c.audit_log is not None and not isinstance(c.audit_log, (str, os.PathLike)):
        raise TypeError(f"audit_log must be a path or None, got {type(c.audit_log).__name__}")
    if c.block_hasher is not None and not callable(c.block_hasher):
        raise TypeError(f"block_hasher must be callable, got {type(c.block_hasher).__name__}")
    if c.scrubber is not None and not all(callable(getattr(c.scrubber, m, None)) for m in ("on_free", "on_alloc")):
        raise TypeError(f"scrubber must have on_free and on_alloc methods, got {type(c.scrubber).__name__}")
    c.kv_tiers = _tier_entries(c.kv_tiers)
    check_choice("kv_tier_keys", c.kv_tier_keys, TIER_KEYS)
    for flag in ("chain_hashes", "kv_tier_encrypt"):
        check_bool(flag, getattr(c, flag))
    if c.engine_secret is not None:
        c.engine_secret = check_secret(c.engine_secret, "engine_secret")
    c.shared_prefixes = _prefixes("shared_prefixes", c.shared_prefixes)
    c.sensitive_prefixes = _prefixes("sensitive_prefixes", c.sensitive_prefixes)
    if c.sensitive_prefixes and c.cache_isolation == "shared":
        raise ValueError(f"sensitive_prefixes={show(c.sensitive_prefixes)} cannot stay private under "
                         "cache_isolation='shared'; use 'selective' (or 'tenant', where all is private)")


def cache_quota(c, num_blocks: int) -> int | None:
    """The cached-block quota per tenant for a pool of ``num_blocks`` (None = no quota): see
    ``max_cached_blocks_per_tenant`` above for why 1/8 and what a quota cannot do."""
    q = c.max_cached_blocks_per_tenant
    if q == UNLIMITED or (q is None and c.cache_isolation == "shared"):
        return None
    return q if q is not None else max(1, num_blocks // QUOTA_SHARE)


def unsafe_settings(c) -> list[str]:
    """Names and values of every deliberately insecure setting in config ``c``."""
    found = []
    if c.enable_prefix_caching and c.cache_isolation == "shared":
        found.append("cache_isolation='shared'")
    if c.hash_algo in UNSAFE_HASH_ALGOS and c.block_hasher is None:
        found.append(f"hash_algo={c.hash_algo!r}")
    if not c.chain_hashes:
        found.append("chain_hashes=False")
    if c.verify_hits is not VerifyHits.IDENTITY:
        found.append(f"verify_hits={c.verify_hits.value!r}")
    if c.scrub in UNSAFE_SCRUBBERS and c.scrubber is None:
        found.append(f"scrub={c.scrub!r}")
    if c.enable_prefix_caching and c.cache_isolation == "selective":
        if c.selective_strategy == "monitor":  # shared until the first flag
            found.append("selective_strategy='monitor'")
        elif c.selective_k == 2:  # one attacker account tests any guess
            found.append("selective_k=2")
    if c.enable_prefix_caching and c.kv_tiers and c.kv_tier_keys == "content":
        found.append("kv_tier_keys='content'")
    if c.enable_prefix_caching and c.kv_tiers and not c.kv_tier_encrypt:
        found.append("kv_tier_encrypt=False")
    if c.enable_prefix_caching and c.max_cached_blocks_per_tenant == UNLIMITED:
        found.append(f"max_cached_blocks_per_tenant={UNLIMITED!r}")
    return found


def _tier_entries(specs) -> tuple:
    """``kv_tiers`` as a tuple.  Each entry (a spec string or a tier object) is checked by
    :mod:`minikv.tiers` (``parse_tiers``), which the engine does not import: ``minikv.LLM``
    checks them before the weights load, and attaching the tiers checks them again."""
    if specs is None:
        return ()
    return tuple(specs) if isinstance(specs, (list, tuple)) else (specs,)


def _prefixes(name: str, value: Any) -> tuple:
    """``value`` as a tuple of non-empty str or token-id lists (one str alone is one prefix);
    token ids are checked against the vocabulary by the engine, which has it."""
    if value is None or isinstance(value, str):
        value = (value,) if value else ()
    elif not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a str or a list of prefixes, got {type(value).__name__} ({show(value)})")
    value = tuple(value)
    for i, p in enumerate(value):
        is_text = isinstance(p, str) and p
        is_ids = isinstance(p, (list, tuple)) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        if not (is_text or is_ids):
            raise TypeError(f"{name}[{i}] must be a non-empty str or list of token ids, got {show(p)}")
    return value
