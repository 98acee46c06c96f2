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

import warnings
from dataclasses import dataclass, field
from typing import Any

CACHE_ISOLATION = ("shared", "tenant", "request")
SCRUB_POLICIES = ("none", "on_free", "on_alloc")
HASH_ALGOS = ("sha256", "hmac-sha256", "blake2b-keyed", "builtin", "trunc32", "poly")
UNSAFE_HASH_ALGOS = ("builtin", "trunc32", "poly")
VERIFY_MODES = (True, False, "tokens")
DTYPES = ("auto", "float32", "bfloat16", "float16")
AUDIT_LEVELS = ("request", "block")  # = minikv.audit.trail.LEVELS (not imported: the engine stays audit-free)


class UnsafeSettingWarning(UserWarning):
    """An engine setting that deliberately re-creates a known leak (for lessons)."""


@dataclass
class EngineConfig:
    """Configuration of one :class:`~minikv.engine.engine.LLMEngine`.

    Engine core
        model: a registry name (``"smollm2-135m-instruct"``, ``"tiny-random"``) or a local
            transformers checkpoint directory of a Llama-family model.
        device: ``"cpu"``, ``"cuda"`` or None (CUDA when available).
        dtype: ``"float32"``, ``"bfloat16"``, ``"float16"`` or None/``"auto"`` (fp32 on CPU,
            bf16 on CUDA).
        block_size: tokens per KV block (PagedAttention's page size).
        num_blocks: blocks in the pool; None sizes the pool from ``kv_cache_memory_gb``.
        max_num_seqs: most sequences running at once (the batch size cap).
        max_num_batched_tokens: most prompt tokens prefilled in one step.
        max_model_len: longest sequence (prompt + output); None = the model's context.
        enable_prefix_caching: reuse the KV of identical full prefix blocks.
        seed: seeds the engine RNG used by requests that set no seed of their own.

    Isolation (see ``minikv.security``)
        cache_isolation: ``"tenant"`` (hits only within a tenant), ``"request"`` (no reuse
            across requests) or UNSAFE ``"shared"`` (any request hits any cached block).
        hash_algo: ``"sha256"``, ``"hmac-sha256"``, ``"blake2b-keyed"``, or UNSAFE
            ``"builtin"``, ``"trunc32"``, ``"poly"``.
        chain_hashes: a block key covers its parent's key; UNSAFE when False.
        verify_hits: before reusing a hit, compare its tokens AND its parent block (True);
            UNSAFE ``"tokens"`` compares tokens only (what nano-vllm does); UNSAFE False trusts the hash.
        scrub: ``"on_alloc"``, ``"on_free"`` or UNSAFE ``"none"``.
        engine_secret: bytes from which per-tenant keys are derived (random when None).
            Never logged, never returned: it is excluded from ``repr``.
        shared_prefixes: operator-declared public prefixes (str or token lists) whose blocks
            every tenant may share; what follows them stays tenant-keyed.
        max_cached_blocks_per_tenant: quota of cached blocks per tenant (prime-and-probe defense).
        audit_log: path of the operator's JSONL audit trail, or None.
        audit_level: ``"request"`` (one summary line per request) or ``"block"`` (one line per
            block event, for tracing); see docs/ARCHITECTURE.md, "Audit trail".
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
    cache_isolation: str = "tenant"
    hash_algo: str = "sha256"
    chain_hashes: bool = True
    verify_hits: Any = True
    scrub: str = "on_alloc"
    engine_secret: bytes | None = field(default=None, repr=False)
    shared_prefixes: tuple = ()
    max_cached_blocks_per_tenant: int | None = None
    audit_log: str | None = None
    audit_level: str = "request"
    block_hasher: Any = None
    scrubber: Any = None

    def __post_init__(self) -> None:
        _check_choice("cache_isolation", self.cache_isolation, CACHE_ISOLATION)
        _check_choice("scrub", self.scrub, SCRUB_POLICIES)
        _check_choice("audit_level", self.audit_level, AUDIT_LEVELS)
        _check_choice("hash_algo", self.hash_algo, HASH_ALGOS)
        if self.verify_hits not in VERIFY_MODES or isinstance(self.verify_hits, int) and not isinstance(self.verify_hits, bool):
            raise ValueError(f"verify_hits must be True, False or 'tokens', got {self.verify_hits!r}")
        if self.dtype is not None and not _is_torch_dtype(self.dtype):
            _check_choice("dtype", self.dtype, DTYPES)
        if self.device is not None and not isinstance(self.device, str):
            self.device = str(self.device)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            _check_positive_int(name, getattr(self, name))
        for name in ("num_blocks", "max_model_len", "max_cached_blocks_per_tenant"):
            if getattr(self, name) is not None:
                _check_positive_int(name, getattr(self, name))
        if not isinstance(self.chain_hashes, bool):
            raise TypeError(f"chain_hashes must be a bool, got {type(self.chain_hashes).__name__}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise TypeError("enable_prefix_caching must be a bool, "
                            f"got {type(self.enable_prefix_caching).__name__}")
        if self.engine_secret is not None:
            if not isinstance(self.engine_secret, (bytes, bytearray)):
                raise TypeError(f"engine_secret must be bytes, got {type(self.engine_secret).__name__}")
            if len(self.engine_secret) < 16:
                raise ValueError(f"engine_secret must be at least 16 bytes, got {len(self.engine_secret)}")
            self.engine_secret = bytes(self.engine_secret)
        if isinstance(self.shared_prefixes, (str, bytes)):
            self.shared_prefixes = (self.shared_prefixes,)
        self.shared_prefixes = tuple(self.shared_prefixes or ())
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        self._warn_unsafe()

    def unsafe_settings(self) -> list[str]:
        """Names and values of every deliberately insecure setting in this config."""
        found = []
        if self.enable_prefix_caching and self.cache_isolation == "shared":
            found.append("cache_isolation='shared'")
        if self.hash_algo in UNSAFE_HASH_ALGOS and self.block_hasher is None:
            found.append(f"hash_algo={self.hash_algo!r}")
        if not self.chain_hashes:
            found.append("chain_hashes=False")
        if self.verify_hits is not True:
            found.append(f"verify_hits={self.verify_hits!r}")
        if self.scrub == "none" and self.scrubber is None:
            found.append("scrub='none'")
        return found

    def _warn_unsafe(self) -> None:
        found = self.unsafe_settings()
        if found:
            warnings.warn("minikv: UNSAFE settings (for teaching only): " + ", ".join(found),
                          UnsafeSettingWarning, stacklevel=4)


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={value!r} is not valid; choose one of {', '.join(map(repr, choices))}")


def _check_positive_int(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")


def _is_torch_dtype(value: Any) -> bool:
    return type(value).__name__ == "dtype" and type(value).__module__ == "torch"
