"""``minikv serve`` and the engine/policy flags it shares with ``generate`` and ``audit isolation``.

Flag names are the engine's setting names (``EngineConfig``) with dashes: ``--cache-isolation``
sets ``cache_isolation``, and so on, so a setting means the same thing in Python, on the command
line and in the docs.  A flag left out keeps the engine's default (secure) value.

This module imports only argparse at import time; the engine, FastAPI and uvicorn are imported
when a command runs.
"""
from __future__ import annotations

import argparse
import ipaddress
import logging
import sys

CACHE_ISOLATION = ("shared", "tenant", "request")
HASH_ALGOS = ("sha256", "hmac-sha256", "blake2b-keyed", "builtin", "trunc32", "poly")
SCRUB = ("none", "on_free", "on_alloc")
DTYPES = ("auto", "float32", "bfloat16", "float16")
_VERIFY = {"true": True, "false": False, "tokens": "tokens"}


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected an integer > 0, got {value}")
    return value


def _quota(text: str):
    return "unlimited" if text == "unlimited" else _positive_int(text)


def add_engine_arguments(p: argparse.ArgumentParser, model_required: bool = True) -> None:
    """Engine core + isolation policy flags (all default to the engine's own defaults)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", required=model_required,
                   help="model name (smollm2-135m-instruct, tiny-random) or checkpoint directory")
    g.add_argument("--device", help="cpu, cuda (default: cuda when available)")
    g.add_argument("--dtype", choices=DTYPES, help="weights/KV dtype (default: fp32 on CPU, bf16 on CUDA)")
    g.add_argument("--seed", type=int, help="engine RNG seed for requests without their own")
    g.add_argument("--block-size", type=_positive_int, help="tokens per KV block (default 16)")
    g.add_argument("--num-blocks", type=_positive_int, help="KV blocks in the pool (default: sized from memory)")
    g.add_argument("--max-num-seqs", type=_positive_int, help="most sequences in one batch (default 64)")
    g.add_argument("--max-num-batched-tokens", type=_positive_int, help="prefill token budget per step")
    g.add_argument("--max-model-len", type=_positive_int, help="longest sequence (default: the model's)")
    g.add_argument("--kv-cache-memory-gb", type=float, help="KV pool budget when --num-blocks is not given")
    s = p.add_argument_group("cache policy")
    s.add_argument("--enable-prefix-caching", action="store_true", default=None,
                   help="reuse the KV of identical prefix blocks (within the isolation domain)")
    s.add_argument("--cache-isolation", choices=CACHE_ISOLATION,
                   help="tenant (default): hits only within a tenant; request: no reuse; shared: UNSAFE")
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


_FIELDS = ("model", "device", "dtype", "seed", "block_size", "num_blocks", "max_num_seqs",
           "max_num_batched_tokens", "max_model_len", "kv_cache_memory_gb", "enable_prefix_caching",
           "cache_isolation", "hash_algo", "chain_hashes", "scrub", "max_cached_blocks_per_tenant",
           "audit_log", "audit_level")


def read_engine_secret(path: str) -> bytes:
    """Raw bytes of the secret file, surrounding whitespace removed.  Never printed."""
    with open(path, "rb") as fh:
        return fh.read().strip()


def engine_kwargs_from_args(args: argparse.Namespace) -> dict:
    """``EngineConfig`` keyword arguments for every flag that was given."""
    kw = {f: getattr(args, f) for f in _FIELDS if getattr(args, f, None) is not None}
    if getattr(args, "verify_hits", None) is not None:
        kw["verify_hits"] = _VERIFY[args.verify_hits]
    if getattr(args, "shared_prefix", None):
        kw["shared_prefixes"] = tuple(args.shared_prefix)
    if getattr(args, "engine_secret_file", None):
        kw["engine_secret"] = read_engine_secret(args.engine_secret_file)
    return kw


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_LIMIT_FLAGS = ("requests_per_s", "burst", "max_concurrent", "max_queued", "max_tokens_in_flight",
                "max_body_bytes", "max_prompt_chars", "max_messages")


def limits_from_args(args: argparse.Namespace):
    """A :class:`~minikv.serve.limits.ServeLimits` from the flags given (0 turns the rate,
    concurrency and decode-budget limits off; ``--max-queued 0`` means no queue); the defaults
    are the dataclass's."""
    from .limits import ServeLimits

    given = {f: getattr(args, f) for f in _LIMIT_FLAGS if getattr(args, f, None) is not None}
    for f in ("requests_per_s", "max_concurrent", "max_queued", "max_tokens_in_flight"):
        if given.get(f) == 0:
            given[f] = None
    return ServeLimits(**given)


def _cmd_serve(args: argparse.Namespace) -> int:
    from .app import create_app, create_metrics_app
    from .auth import load_api_keys

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        keys = load_api_keys(args.api_keys)
        ops = load_api_keys(args.operator_keys, what="operator") if args.operator_keys else None
        limits = limits_from_args(args)
    except (OSError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        kwargs = engine_kwargs_from_args(args)
        from ..llm import LLM
        llm = LLM(**kwargs)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    unsafe = llm.engine.config.unsafe_settings()
    if unsafe:
        print("warning: serving with UNSAFE settings: " + ", ".join(unsafe), file=sys.stderr)
    for host in {args.host, args.metrics_host}:
        if not _is_loopback(host):
            print(f"warning: listening on {host}, not loopback: put TLS and a firewall in front",
                  file=sys.stderr)
    app = create_app(llm, keys, model_name=args.served_model_name or args.model,
                     report_cached_tokens=args.report_cached_tokens, limits=limits, operator_keys=ops)
    import asyncio

    import uvicorn
    logging.getLogger("minikv.serve").info("serving %s for %d tenant(s) on %s:%d", app.state.model_name,
                                           len(keys.tenants), args.host, args.port)
    servers = [uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                             log_config=None, access_log=not args.no_access_log))]
    if args.metrics_port is not None:
        metrics_app = create_metrics_app(app.state.metrics, ops)
        servers.append(uvicorn.Server(uvicorn.Config(metrics_app, host=args.metrics_host, port=args.metrics_port,
                                                     log_level=args.log_level, log_config=None,
                                                     access_log=not args.no_access_log, lifespan="off")))
        logging.getLogger("minikv.serve").info("metrics on %s:%d", args.metrics_host, args.metrics_port)

    async def serve_all():
        await asyncio.gather(*(s.serve() for s in servers))

    try:
        asyncio.run(serve_all())
    finally:
        if llm.engine.audit is not None:  # write the summaries of requests still in flight
            llm.engine.audit.close()
    return 0


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


def _nonneg_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value}")
    return value


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    from_docs = " (default: ServeLimits' value; 0 = no limit)"
    g = p.add_argument_group("per-tenant and per-request limits (see minikv.serve.limits)")
    g.add_argument("--requests-per-s", type=_nonneg_float, help="sustained requests/s per tenant" + from_docs)
    g.add_argument("--burst", type=_positive_int, help="requests a tenant may send at once")
    g.add_argument("--max-concurrent", type=_nonneg_int, help="requests per tenant served at once" + from_docs)
    g.add_argument("--max-queued", type=_nonneg_int, help="requests per tenant waiting for a slot (0: no queue)")
    g.add_argument("--max-tokens-in-flight", type=_nonneg_int,
                   help="sum of max_tokens over a tenant's admitted requests" + from_docs)
    g.add_argument("--max-body-bytes", type=_positive_int, help="largest request body (default 1 MiB; -> 413)")
    g.add_argument("--max-prompt-chars", type=_positive_int, help="largest prompt, in characters (-> 400)")
    g.add_argument("--max-messages", type=_positive_int, help="most messages in one chat request (-> 400)")


def add_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``serve`` on a subparsers action; sets ``func`` to the handler."""
    p = subparsers.add_parser("serve", help="OpenAI-compatible HTTP server",
                              description="Serve /v1/completions, /v1/chat/completions, /v1/models, "
                                          "/health and (operators only) /metrics.  The tenant of each request is the "
                                          "one its API key maps to; clients cannot choose it.")
    p.add_argument("--host", default="127.0.0.1", help="listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="listen port (default 8000)")
    p.add_argument("--api-keys", required=True, metavar="FILE",
                   help='JSON object mapping API key -> tenant, e.g. {"sk-a": "alice"}')
    p.add_argument("--served-model-name", help="model id clients send (default: --model)")
    p.add_argument("--report-cached-tokens", action="store_true",
                   help="report usage.prompt_tokens_details.cached_tokens")
    p.add_argument("--operator-keys", metavar="FILE",
                   help="JSON object mapping operator key -> name; these keys (only) may read /metrics")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of --metrics-port (default 127.0.0.1)")
    p.add_argument("--metrics-port", type=int,
                   help="serve /metrics on this separate, operator-only port (no tenant key opens it)")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true", help="no per-request access log lines")
    _add_limit_arguments(p)
    add_engine_arguments(p)
    p.set_defaults(func=_cmd_serve)
    return p
