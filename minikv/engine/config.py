"""Every engine setting in one dataclass, validated in one place.

The same names are used by ``LLM(...)`` keyword arguments and by ``minikv serve`` flags, so a
setting means the same thing everywhere.  Validation happens here, before any memory is
allocated, so a typo never half-builds an engine: bad values raise ``ValueError`` or
``TypeError`` naming the value.

Settings marked UNSAFE exist for teaching.  They reproduce what real engines did (or still do)
and each one enables a leak that a lesson demonstrates; choosing one emits an
:class:`UnsafeSettingWarning`.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from ..security.keys import check_secret
from ..security.hashing import HASHERS, UNSAFE_HASHES
from ..security.scrub import SCRUBBERS, UNSAFE_SCRUBBERS
from .checks import as_int, as_real, as_seed, check_bool, show
# The device checks live in device.py; DEVICE_TYPES and resolve_device stay importable from here.
from .device import DEVICE_TYPES, check_device, is_torch_dtype, resolve_device  # noqa: F401
from .lifecycle import VerifyHits

CACHE_ISOLATION = ("shared", "tenant", "request", "selective")
#: the attention backends' names; ``minikv.backends`` describes and builds them (the engine runs
#: whichever it is handed, see ``model_runner.Backend``)
ATTENTION_BACKENDS = ("reference", "fused", "cpu_kernels", "triton", "auto")
RENAMED_BACKENDS = {"paged": "cpu_kernels"}  # an old name is refused with a message naming the new one
#: the selective-sharing strategies' names (``minikv.sharing.STRATEGIES`` builds them)
SHARING_STRATEGIES = ("k_tenants", "monitor")
SCRUB_POLICIES = tuple(SCRUBBERS)  # the registries' names, in registration order
HASH_ALGOS = tuple(HASHERS)
UNSAFE_HASH_ALGOS = tuple(a for a in HASH_ALGOS if a in UNSAFE_HASHES)
DTYPES = ("auto", "float32", "bfloat16", "float16")
AUDIT_LEVELS = ("request", "block")  # = minikv.audit.trail.LEVELS (not imported: the engine stays audit-free)
UNLIMITED = "unlimited"  # max_cached_blocks_per_tenant: no quota (UNSAFE; lessons on prime-and-probe)
QUOTA_SHARE = 8  # default quota: 1/QUOTA_SHARE of the pool per tenant (see cache_quota)
#: ``kv_tier_keys``: "tenant" (the pool's tenant-keyed hash) or UNSAFE "content" (the salt dropped
#: at the tier boundary: LMCache #4825's ``cache_salt=''``)
TIER_KEYS = ("tenant", "content")


def _tier_entries(specs) -> tuple:
    """``kv_tiers`` as a tuple.  Each entry (a spec string or a tier object) is checked by
    :mod:`minikv.tiers` (``parse_tiers``), which the engine does not import: ``minikv.LLM``
    checks them before the weights load, and attaching the tiers checks them again."""
    if specs is None:
        return ()
    return tuple(specs) if isinstance(specs, (list, tuple)) else (specs,)


class UnsafeSettingWarning(UserWarning):
    """An engine setting that deliberately re-creates a known leak (for lessons)."""


@dataclass
class EngineConfig:
    """Configuration of one :class:`~minikv.engine.engine.LLMEngine`.

    Engine core
        model: a registry name (``"smollm2-135m-instruct"``, ``"tiny-random"``) or a local
            transformers checkpoint directory of a Llama-family model.
        device: ``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"mps"`` or None (CUDA when available).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or None/``"auto"`` (fp32 on CPU,
            bf16 on CUDA).
        block_size: tokens per KV block (PagedAttention's page size).
        num_blocks: blocks in the pool; None sizes the pool from ``kv_cache_memory_gb``.
        max_num_seqs: most sequences running at once (the batch size cap).
        max_num_batched_tokens: most prompt tokens prefilled in one step.
        max_model_len: longest sequence (prompt + output); None = the model's context.
        enable_prefix_caching: reuse the KV of identical full prefix blocks.
        seed: seeds the engine RNG used by requests that set no seed of their own.
        attention_backend: ``"reference"`` (the explicit gather the lessons read), ``"fused"``
            (per-step metadata, batched attention), ``"cpu_kernels"`` (fused, attention read in
            place by the prebuilt C++ CPU kernels; formerly ``"paged"``), ``"triton"`` (CUDA:
            fused, prefix hits and their steps' decodes read in place by a Triton kernel) or
            ``"auto"`` (cpu_kernels where built, else fused; never compiles); see
            ``minikv/backends/registry.py``.  All compute the same logits.
        enforce_eager: never run CUDA graphs (vLLM's name and meaning); by default a decode-only
            step of the fused backend on CUDA replays one, and so does a step that prefills one
            sequence alone, hit or miss (``minikv/backends/cuda_graphs.py``, ``prefill_graphs.py``).

    Isolation (see ``minikv.security``)
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

    model: str = "smollm2-135m-instruct"
    device: str | None = None
    dtype: Any = None
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    max_model_len: int | None = None
    kv_cache_memory_gb: float = 1.0
    enable_prefix_caching: bool = False
    seed: int = 0
    attention_backend: str = "auto"
    enforce_eager: bool = False
    cache_isolation: str = "tenant"
    hash_algo: str = "sha256"
    chain_hashes: bool = True
    verify_hits: VerifyHits | bool | str = True  # stored as VerifyHits
    scrub: str = "on_alloc"
    engine_secret: bytes | None = field(default=None, repr=False)
    shared_prefixes: tuple = ()
    sensitive_prefixes: tuple = ()
    max_cached_blocks_per_tenant: int | str | None = None  # None: num_blocks // 8 (see cache_quota)
    selective_strategy: str = "k_tenants"
    selective_k: int = 3
    reuse_monitor: Any = None
    audit_log: str | None = None
    audit_level: str = "request"
    kv_tiers: tuple = ()
    kv_tier_keys: str = "tenant"
    kv_tier_encrypt: bool = True
    block_hasher: Any = None
    scrubber: Any = None

    def __post_init__(self) -> None:
        _check_choice("cache_isolation", self.cache_isolation, CACHE_ISOLATION)
        _check_choice("scrub", self.scrub, SCRUB_POLICIES)
        _check_choice("selective_strategy", self.selective_strategy, SHARING_STRATEGIES)
        self.selective_k = as_int("selective_k", self.selective_k)
        if self.selective_k < 2:
            raise ValueError(f"selective_k must be >= 2, got {show(self.selective_k)} (k=1 would share "
                             "every block at once: that is cache_isolation='shared')")
        if self.reuse_monitor is not None and not callable(self.reuse_monitor):
            raise TypeError(f"reuse_monitor must be a factory reuse_monitor(config) -> monitor, got "
                            f"{type(self.reuse_monitor).__name__}")
        if self.selective_strategy == "monitor" and self.cache_isolation == "selective" and self.reuse_monitor is None:
            raise ValueError("selective_strategy='monitor' needs reuse_monitor= (a factory; "
                             "minikv.audit.monitor.DetectorMonitor wraps the audit detector)")
        if self.attention_backend in RENAMED_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is now called "
                             f"{RENAMED_BACKENDS[self.attention_backend]!r}")
        _check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        _check_choice("audit_level", self.audit_level, AUDIT_LEVELS)
        _check_choice("hash_algo", self.hash_algo, HASH_ALGOS)
        self.verify_hits = VerifyHits.of(self.verify_hits)
        if is_torch_dtype(self.dtype):
            _check_choice("dtype", str(self.dtype).removeprefix("torch."), DTYPES)
        elif self.dtype is not None:
            _check_choice("dtype", self.dtype, DTYPES)
        if self.device is not None:
            self.device = check_device(self.device)
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a name or a path, got {type(self.model).__name__} ({show(self.model)})")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            setattr(self, name, _positive_int(name, getattr(self, name)))
        for name in ("num_blocks", "max_model_len"):
            if getattr(self, name) is not None:
                setattr(self, name, _positive_int(name, getattr(self, name)))
        if self.max_cached_blocks_per_tenant not in (None, UNLIMITED):
            if isinstance(self.max_cached_blocks_per_tenant, str):
                raise ValueError(f"max_cached_blocks_per_tenant={show(self.max_cached_blocks_per_tenant)} is not "
                                 f"valid; give a number of blocks, None (the default quota) or {UNLIMITED!r}")
            self.max_cached_blocks_per_tenant = _positive_int("max_cached_blocks_per_tenant",
                                                              self.max_cached_blocks_per_tenant)
        # NaN and inf slip past "<= 0" and blow up only after the model has loaded.
        self.kv_cache_memory_gb = as_real("kv_cache_memory_gb", self.kv_cache_memory_gb)
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        self.seed = as_seed("seed", self.seed)
        if self.audit_log is not None and not isinstance(self.audit_log, (str, os.PathLike)):
            raise TypeError(f"audit_log must be a path or None, got {type(self.audit_log).__name__}")
        if self.block_hasher is not None and not callable(self.block_hasher):
            raise TypeError(f"block_hasher must be callable, got {type(self.block_hasher).__name__}")
        if self.scrubber is not None and not all(callable(getattr(self.scrubber, m, None))
                                                 for m in ("on_free", "on_alloc")):
            raise TypeError(f"scrubber must have on_free and on_alloc methods, got {type(self.scrubber).__name__}")
        self.kv_tiers = _tier_entries(self.kv_tiers)
        _check_choice("kv_tier_keys", self.kv_tier_keys, TIER_KEYS)
        for flag in ("enforce_eager", "chain_hashes", "enable_prefix_caching", "kv_tier_encrypt"):
            check_bool(flag, getattr(self, flag))
        if self.engine_secret is not None:
            self.engine_secret = check_secret(self.engine_secret, "engine_secret")
        self.shared_prefixes = _prefixes("shared_prefixes", self.shared_prefixes)
        self.sensitive_prefixes = _prefixes("sensitive_prefixes", self.sensitive_prefixes)
        if self.sensitive_prefixes and self.cache_isolation == "shared":
            raise ValueError(f"sensitive_prefixes={show(self.sensitive_prefixes)} cannot stay private under "
                             "cache_isolation='shared'; use 'selective' (or 'tenant', where all is private)")
        self._warn_unsafe()

    def default_num_blocks(self, bytes_per_token: int, max_model_len: int) -> int:
        """Pool size when ``num_blocks`` is None: what ``kv_cache_memory_gb`` holds, but no more
        than ``max_num_seqs`` full-length sequences need, and never less than one of them."""
        budget = int(self.kv_cache_memory_gb * 2**30) // (bytes_per_token * self.block_size)
        wanted = math.ceil(max_model_len * self.max_num_seqs / self.block_size)
        return max(math.ceil(max_model_len / self.block_size) + 1, min(budget, wanted))

    def cache_quota(self, num_blocks: int) -> int | None:
        """The cached-block quota per tenant for a pool of ``num_blocks`` (None = no quota).

        Default (``max_cached_blocks_per_tenant=None``): ``max(1, num_blocks // 8)`` under
        ``"tenant"`` and ``"request"`` isolation; no quota under ``"shared"``, which is UNSAFE
        anyway.  See the class docstring for why 1/8 and what a quota cannot do."""
        q = self.max_cached_blocks_per_tenant
        if q == UNLIMITED or (q is None and self.cache_isolation == "shared"):
            return None
        return q if q is not None else max(1, num_blocks // QUOTA_SHARE)

    def unsafe_settings(self) -> list[str]:
        """Names and values of every deliberately insecure setting in this config."""
        found = []
        if self.enable_prefix_caching and self.cache_isolation == "shared":
            found.append("cache_isolation='shared'")
        if self.hash_algo in UNSAFE_HASH_ALGOS and self.block_hasher is None:
            found.append(f"hash_algo={self.hash_algo!r}")
        if not self.chain_hashes:
            found.append("chain_hashes=False")
        if self.verify_hits is not VerifyHits.IDENTITY:
            found.append(f"verify_hits={self.verify_hits.value!r}")
        if self.scrub in UNSAFE_SCRUBBERS and self.scrubber is None:
            found.append(f"scrub={self.scrub!r}")
        if self.enable_prefix_caching and self.cache_isolation == "selective":
            if self.selective_strategy == "monitor":  # shared until the first flag
                found.append("selective_strategy='monitor'")
            elif self.selective_k == 2:  # one attacker account tests any guess
                found.append("selective_k=2")
        if self.enable_prefix_caching and self.kv_tiers and self.kv_tier_keys == "content":
            found.append("kv_tier_keys='content'")
        if self.enable_prefix_caching and self.kv_tiers and not self.kv_tier_encrypt:
            found.append("kv_tier_encrypt=False")
        if self.enable_prefix_caching and self.max_cached_blocks_per_tenant == UNLIMITED:
            found.append(f"max_cached_blocks_per_tenant={UNLIMITED!r}")
        return found

    def _warn_unsafe(self) -> None:
        found = self.unsafe_settings()
        if found:
            warnings.warn("minikv: UNSAFE settings (for teaching only): " + ", ".join(found),
                          UnsafeSettingWarning, stacklevel=4)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={show(value)} is not valid; choose one of {', '.join(map(repr, choices))}")


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


def _positive_int(name: str, value: Any) -> int:
    value = as_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {show(value)}")
    return value
