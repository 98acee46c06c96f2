"""The engine's settings as command-line flags, shared by ``minikv generate``, ``serve`` and ``audit isolation``.

Flag names are the engine's setting names (``EngineConfig``) with dashes: ``--cache-isolation``
sets ``cache_isolation``, and so on, so a setting means the same thing in Python, on the command
line and in the docs.  A flag left out keeps the engine's default (secure) value.  The choices
come from :mod:`minikv.engine.config` (which takes them from the registries), so a new hasher or
scrubber is a new flag value with no second list to update; config imports no torch, so neither
does this module: the engine itself is imported when a command runs.
"""
from __future__ import annotations

import argparse

from .config import ATTENTION_BACKENDS, CACHE_ISOLATION, DTYPES, HASH_ALGOS, RENAMED_BACKENDS, TIER_KEYS
from .config import SCRUB_POLICIES as SCRUB
from .config import SHARING_STRATEGIES
_VERIFY = {"true": "IDENTITY", "false": "NOTHING", "tokens": "TOKENS"}  # --verify-hits -> VerifyHits


def int_at_least(least: int):
    """An argparse ``type``: the flag's text as an int >= ``least``; anything else is refused
    with argparse's usage error naming the value (``expected an integer >= 2, got 1``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < least:
            raise argparse.ArgumentTypeError(f"expected an integer >= {least}, got {value}")
        return value
    return parse


positive_int = int_at_least(1)


def _quota(text: str):
    return "unlimited" if text == "unlimited" else positive_int(text)


def _backend_name(value: str) -> str:
    """An ``--attention-backend`` value; an old name fails naming its new one."""
    if value in RENAMED_BACKENDS:
        raise argparse.ArgumentTypeError(f"{value!r} is now called {RENAMED_BACKENDS[value]!r}")
    return value


def add_engine_arguments(p: argparse.ArgumentParser, model_required: bool = True, monitor: bool = False) -> None:
    """Engine core + isolation policy flags (all default to the engine's own defaults).
    ``monitor``: offer ``--selective-strategy monitor``, for a command that hands the engine a
    ``reuse_monitor`` (``minikv serve``: :mod:`minikv.cli` wires the audit detector in), and the
    monitor's own knobs, ``--selective-monitor-threshold`` and ``--selective-monitor-window``:
    not engine settings but the factory's keyword arguments (:func:`monitor_kwargs_from_args`)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required,
                   help="model name (smollm2-135m-instruct, tiny-random) or checkpoint directory")
    g.add_argument("--device", help="cpu, cuda (default: cuda when available)")
    g.add_argument("--dtype", choices=DTYPES, help="weights/KV dtype (default: fp32 on CPU, bf16 on CUDA)")
    g.add_argument("--seed", type=int, help="engine RNG seed for requests without their own")
    g.add_argument("--block-size", type=positive_int, help="tokens per KV block (default 16)")
    g.add_argument("--num-blocks", type=positive_int, help="KV blocks in the pool (default: sized from memory)")
    g.add_argument("--max-num-seqs", type=positive_int, help="most sequences in one batch (default 64)")
    g.add_argument("--max-num-batched-tokens", type=positive_int,
                   help="token budget per step: decodes, then prefill chunks (minikv serve: 512 on a CPU; otherwise 4096)")
    g.add_argument("--contended-num-batched-tokens", type=positive_int,
                   help="the step budget while two or more tenants have had work in the last second (minikv "
                        "serve: 32 on a CPU, 512 on CUDA; otherwise the same as --max-num-batched-tokens)")
    g.add_argument("--max-model-len", type=positive_int, help="longest sequence (default: the model's)")
    g.add_argument("--kv-cache-memory-gb", type=float, help="KV pool budget when --num-blocks is not given")
    g.add_argument("--attention-backend", type=_backend_name, choices=ATTENTION_BACKENDS,
                   help="reference (explicit gather), fused (batched, per-step metadata), cpu_kernels (fused + "
                        "minikv's C++ kernels, CPU), triton (CUDA) or auto (default: cpu_kernels on a CPU where the "
                        "kernels are built and fit the model, else fused)")
    g.add_argument("--enforce-eager", action="store_true", default=None,
                   help="never capture CUDA graphs for decode or one-prefill steps (default: captured on CUDA)")
    s = p.add_argument_group("cache policy")
    s.add_argument("--enable-prefix-caching", action="store_true", default=None,
                   help="reuse the KV of identical prefix blocks (within the isolation domain)")
    s.add_argument("--cache-isolation", choices=CACHE_ISOLATION,
                   help="tenant (default): hits only within a tenant; request: no reuse; shared: UNSAFE")
    s.add_argument("--selective-strategy", choices=tuple(n for n in SHARING_STRATEGIES if monitor or n != "monitor"),
                   help="under --cache-isolation selective: k_tenants (default: share a block once k tenants "
                        "computed it)" + (" or monitor (share until the audit detector flags a prober, then "
                        "isolate it; UNSAFE before the first flag)" if monitor else "; 'monitor' needs the "
                        "audit detector: minikv serve, or reuse_monitor= from Python"))
    s.add_argument("--selective-k", type=positive_int,
                   help="k_tenants: distinct tenants that must compute a block before it is shared "
                        "(default 3; an attacker needs k-1 accounts; 2 is UNSAFE)")
    if monitor:  # the monitor's knobs: passed to the factory as threshold=, window= (monitor_kwargs_from_args)
        s.add_argument("--selective-monitor-threshold", type=int_at_least(2), metavar="N",
                       help="monitor: a tenant is flagged and isolated once N of its requests look like "
                            "probes of one prefix (distinct, sharing that prefix, differing only in the next "
                            "block, at similar lengths; default 8, at least 2).  Lower catches a prober sooner "
                            "(its first N guesses are answered from the shared cache) but risks flagging a "
                            "benign tenant that "
                            "sends N short questions after a system prompt other tenants share: it loses its "
                            "cross-tenant hits for the life of the server, and every tenant loses the shared "
                            "continuations of that prompt")
        s.add_argument("--selective-monitor-window", type=int_at_least(2), metavar="N",
                       help="monitor: how many of each tenant's latest requests the detector remembers and "
                            "scans (default 256; at least the threshold).  Recent means the last N requests, "
                            "not a time span: a prober goes unseen while fewer than threshold of its probes "
                            "fall within any N consecutive requests of its own (diluted with decoys).  Larger "
                            "catches more diluted probing, at the cost of N request summaries (fingerprints, "
                            "no text) of memory per tenant and a scan of up to N records per request")
    s.add_argument("--hash-algo", choices=HASH_ALGOS, help="block hash (builtin, trunc32, poly are UNSAFE)")
    s.add_argument("--chain-hashes", action=argparse.BooleanOptionalAction, default=None,
                   help="block keys cover their parent's key (--no-chain-hashes is UNSAFE)")
    s.add_argument("--verify-hits", choices=tuple(_VERIFY), help="check a hit's tokens+parent (true, default), "
                   "tokens only (UNSAFE) or nothing (false, UNSAFE)")
    s.add_argument("--scrub", choices=SCRUB, help="zero KV blocks on_alloc (default), on_free, or none (UNSAFE)")
    s.add_argument("--shared-prefix", action="append", default=None, metavar="TEXT",
                   help="operator-declared public prefix every tenant may share (repeatable)")
    s.add_argument("--max-cached-blocks-per-tenant", type=_quota,
                   help="quota of cached blocks per tenant (prime+probe defence; default num_blocks // 8; "
                        "'unlimited' is UNSAFE)")
    s.add_argument("--audit-log", metavar="PATH", help="write the operator's JSONL audit trail here")
    s.add_argument("--audit-level", choices=("request", "block"),
                   help="request (default): one summary line per request; block: one line per block event")
    s.add_argument("--engine-secret-file", metavar="PATH",
                   help="file holding the engine secret (>= 16 bytes); default: random per start")
    t = p.add_argument_group("KV tiers")
    t.add_argument("--kv-tier", action="append", default=None, metavar="SPEC", dest="kv_tiers",
                   help="a KV tier below the pool, in lookup order (repeatable): 'host' or 'host?mib=N' "
                        "(in-process; the pool's LRU evicts into it), 'redis://127.0.0.1:6390/0?ttl=S&budget_mib=N' "
                        "(shared by instances: give them the same --engine-secret-file).  Default: none")
    t.add_argument("--kv-tier-keys", choices=TIER_KEYS,
                   help="tenant (default: tier keys are the tenant-keyed block hashes) or content (UNSAFE: "
                        "the content hash alone, LMCache #4825's cache_salt='')")
    t.add_argument("--kv-tier-encrypt", action=argparse.BooleanOptionalAction, default=None,
                   help="seal K/V in the tiers with per-tenant AES-GCM (default); --no-kv-tier-encrypt is UNSAFE")


_FIELDS = ("model", "device", "dtype", "seed", "block_size", "num_blocks", "max_num_seqs",
           "max_num_batched_tokens", "contended_num_batched_tokens", "max_model_len", "kv_cache_memory_gb", "attention_backend", "enforce_eager",
           "enable_prefix_caching", "cache_isolation", "hash_algo", "chain_hashes", "scrub", "max_cached_blocks_per_tenant",
           "audit_log", "audit_level")

_FIELDS += ("selective_strategy", "selective_k", "kv_tier_keys", "kv_tier_encrypt")


_MONITOR_FLAGS = {"selective_monitor_threshold": "threshold", "selective_monitor_window": "window"}


def monitor_kwargs_from_args(args: argparse.Namespace) -> dict:
    """Keyword arguments for the ``reuse_monitor`` factory (``threshold=``, ``window=``, the
    audit detector's own parameter names) for every ``--selective-monitor-*`` flag given; a flag
    left out keeps the monitor's own default."""
    return {kw: getattr(args, f) for f, kw in _MONITOR_FLAGS.items() if getattr(args, f, None) is not None}


def read_engine_secret(path: str) -> bytes:
    """Raw bytes of the secret file, surrounding whitespace removed.  Never printed.  A path
    that is not a regular file, or one over 64 KiB, is a ValueError naming the flag."""
    from ..security.keys import read_secret_file
    return read_secret_file(path, "--engine-secret-file").strip()


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """``EngineConfig`` keyword arguments for every flag that was given."""
    kw = {f: getattr(args, f) for f in _FIELDS if getattr(args, f, None) is not None}
    if getattr(args, "verify_hits", None) is not None:
        from ..engine.lifecycle import VerifyHits
        kw["verify_hits"] = VerifyHits[_VERIFY[args.verify_hits]]
    if getattr(args, "kv_tiers", None):
        kw["kv_tiers"] = tuple(args.kv_tiers)
    if getattr(args, "shared_prefix", None):
        kw["shared_prefixes"] = tuple(args.shared_prefix)
    if getattr(args, "engine_secret_file", None):
        kw["engine_secret"] = read_engine_secret(args.engine_secret_file)
    return kw
