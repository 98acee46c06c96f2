"""Every engine setting in one dataclass, validated in one place.

The same names are used by ``LLM(...)`` keyword arguments and by ``minikv serve`` flags, so a
setting means the same thing everywhere.  Validation happens here, before any memory is
allocated, so a typo never half-builds an engine: bad values raise ``ValueError`` or
``TypeError`` naming the value.

This module documents and checks the core fields: which model, where, in what precision, how
big the pool and the batch, which attention backend.  The security settings (isolation, hashing,
scrubbing, quota, selective sharing, audit, KV tiers) are fields of the same dataclass, documented
and checked in :mod:`~minikv.engine.security_settings`, which also says which are UNSAFE.
"""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

from . import security_settings
from .checks import as_real, as_seed, check_bool, check_choice, positive_int, show
# The device checks live in device.py; DEVICE_TYPES and resolve_device stay importable from here.
from .device import DEVICE_TYPES, check_device, is_torch_dtype, resolve_device  # noqa: F401
from .lifecycle import VerifyHits
from .security_settings import (AUDIT_LEVELS, CACHE_ISOLATION, HASH_ALGOS, QUOTA_SHARE,  # noqa: F401
                                SCRUB_POLICIES, SHARING_STRATEGIES, TIER_KEYS, UNLIMITED, UNSAFE_HASH_ALGOS,
                                UnsafeSettingWarning)

#: the attention backends' names; ``minikv.backends`` describes and builds them (the engine runs
#: whichever it is handed, see ``model_runner.Backend``)
ATTENTION_BACKENDS = ("reference", "fused", "cpu_kernels", "triton", "auto")
RENAMED_BACKENDS = {"paged": "cpu_kernels"}  # an old name is refused with a message naming the new one
DTYPES = ("auto", "float32", "bfloat16", "float16")


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
        max_num_batched_tokens: the token budget of one step (decodes, then prefill chunks).
        contended_num_batched_tokens: the step budget while two or more tenants have had work in the
            last second (None: ``max_num_batched_tokens`` always); a server's knob, see ``scheduler.py``.
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

    Security (isolation, hashing, scrubbing, quota, selective sharing, audit trail, KV tiers)
        cache_isolation, selective_strategy, selective_k, reuse_monitor, hash_algo, chain_hashes,
        verify_hits, scrub, engine_secret, shared_prefixes, sensitive_prefixes,
        max_cached_blocks_per_tenant, audit_log, audit_level, kv_tiers, kv_tier_keys,
        kv_tier_encrypt, block_hasher, scrubber: see :mod:`~minikv.engine.security_settings`.
    """

    model: str = "smollm2-135m-instruct"
    device: str | None = None
    dtype: Any = None
    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    contended_num_batched_tokens: int | None = None
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
        security_settings.check_security_settings(self)
        if self.attention_backend in RENAMED_BACKENDS:
            raise ValueError(f"attention_backend={self.attention_backend!r} is now called "
                             f"{RENAMED_BACKENDS[self.attention_backend]!r}")
        check_choice("attention_backend", self.attention_backend, ATTENTION_BACKENDS)
        if is_torch_dtype(self.dtype):
            check_choice("dtype", str(self.dtype).removeprefix("torch."), DTYPES)
        elif self.dtype is not None:
            check_choice("dtype", self.dtype, DTYPES)
        if self.device is not None:
            self.device = check_device(self.device)
        if not isinstance(self.model, (str, os.PathLike)):
            raise TypeError(f"model must be a name or a path, got {type(self.model).__name__} ({show(self.model)})")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            setattr(self, name, positive_int(name, getattr(self, name)))
        for name in ("num_blocks", "max_model_len", "contended_num_batched_tokens"):
            if getattr(self, name) is not None:
                setattr(self, name, positive_int(name, getattr(self, name)))
        # NaN and inf slip past "<= 0" and blow up only after the model has loaded.
        self.kv_cache_memory_gb = as_real("kv_cache_memory_gb", self.kv_cache_memory_gb)
        if self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb!r}")
        self.seed = as_seed("seed", self.seed)
        for flag in ("enforce_eager", "enable_prefix_caching"):
            check_bool(flag, getattr(self, flag))
        self._warn_unsafe()

    def default_num_blocks(self, bytes_per_token: int, max_model_len: int) -> int:
        """Pool size when ``num_blocks`` is None: what ``kv_cache_memory_gb`` holds, but no more
        than ``max_num_seqs`` full-length sequences need, and never less than one of them."""
        budget = int(self.kv_cache_memory_gb * 2**30) // (bytes_per_token * self.block_size)
        wanted = math.ceil(max_model_len * self.max_num_seqs / self.block_size)
        return max(math.ceil(max_model_len / self.block_size) + 1, min(budget, wanted))

    def cache_quota(self, num_blocks: int) -> int | None:
        """The cached-block quota per tenant for a pool of ``num_blocks`` (None = no quota):
        ``max(1, num_blocks // 8)`` by default under ``"tenant"`` and ``"request"`` isolation."""
        return security_settings.cache_quota(self, num_blocks)

    def unsafe_settings(self) -> list[str]:
        """Names and values of every deliberately insecure setting in this config."""
        return security_settings.unsafe_settings(self)

    def _warn_unsafe(self) -> None:
        found = self.unsafe_settings()
        if found:
            warnings.warn("minikv: UNSAFE settings (for teaching only): " + ", ".join(found),
                          UnsafeSettingWarning, stacklevel=4)

