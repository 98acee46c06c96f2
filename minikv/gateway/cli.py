"""``minikv gateway``: start-up checks, then serve (see :mod:`minikv.gateway` for the design).

    minikv gateway --upstream http://127.0.0.1:8017/v1 --api-keys keys.json \\
        --secret-file gateway.secret --operator-keys ops.json --trail gateway-trail.jsonl

Start-up, in order, and the gateway refuses to start at the first failure:

1. the keys files (``minikv serve``'s strict loader) and the secret;
2. every upstream is asked for its model (``GET /v1/models``; ``owned_by`` says whether it is
   a minikv server, the only kind that can share a public prefix);
3. the paired salt probe (:mod:`minikv.gateway.probe`) on every upstream -- skipped only with
   ``--allow-unverified-upstream``, which the log then says loudly;
4. ``--public-prefix``: minikv upstreams only, and checked to be shared across salts;
5. every minikv upstream accepts the gateway's ``X-Minikv-Tenant`` (:mod:`minikv.serve.identity`).
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import sys

from ..engine.cli_flags import positive_int
from ..security.keys import read_secret_file
from ..serve.cli import _add_limit_arguments, _is_loopback, limits_from_args

log = logging.getLogger("minikv.gateway")


def _read_secret(path: str | None) -> bytes:
    if path is None:
        print("warning: no --secret-file: a random gateway secret, so every tenant's salt (and cache) "
              "changes when the gateway restarts", file=sys.stderr)
        return secrets.token_bytes(32)
    secret = read_secret_file(path, "--secret-file").strip()
    if len(secret) < 16:
        raise ValueError(f"--secret-file {path!r}: the gateway secret must be at least 16 bytes, got {len(secret)}")
    return secret


def _upstream_key(args) -> str | None:
    if args.upstream_key_file:
        raw = read_secret_file(args.upstream_key_file, "--upstream-key-file")
        try:
            return raw.decode("utf-8").strip() or None
        except UnicodeDecodeError:
            raise ValueError(f"--upstream-key-file {args.upstream_key_file!r} is not UTF-8") from None
    return os.environ.get("MINIKV_UPSTREAM_KEY") or None


def upstream_url(text: str) -> str:
    """``--upstream``'s type: an http(s) URL with a host and a valid port, or an error that names
    the value (urllib's own messages, "Port out of range 0-65535", do not)."""
    from urllib.parse import urlsplit
    try:
        parts = urlsplit(text)
        parts.port   # parses the port: ValueError for 'bad', 99999, an unclosed '[::1'
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--upstream {text!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"--upstream {text!r}: expected http(s)://HOST[:PORT]/v1")
    return text


def check_tenant_header(upstream: str, upstream_key: str | None, tenant: str, timeout: float = 10.0) -> None:
    """A minikv upstream must accept the gateway's ``X-Minikv-Tenant`` (its key listed in that
    server's ``--gateway-keys``); otherwise every tenant would reach it as the gateway, and one
    tenant's flood would get the others 429s.  Raises RuntimeError naming the fix."""
    import httpx

    from .proxy import upstream_headers
    try:
        r = httpx.get(upstream.rstrip("/") + "/models", timeout=timeout,
                      headers=upstream_headers("-", upstream_key, False, tenant))
    except httpx.HTTPError as exc:
        raise RuntimeError(f"upstream {upstream} did not answer ({type(exc).__name__})") from None
    if r.status_code != 200:
        raise RuntimeError(f"upstream {upstream} refused the gateway's X-Minikv-Tenant (HTTP {r.status_code}): "
                           "list the key of --upstream-key-file in that server's --gateway-keys")


def discover(upstream: str, upstream_key: str | None, timeout: float = 10.0) -> tuple[str, str]:
    """(model id, owner) of an upstream's first model; RuntimeError when it does not answer."""
    import httpx

    headers = {"Authorization": f"Bearer {upstream_key}"} if upstream_key else {}
    try:
        r = httpx.get(upstream.rstrip("/") + "/models", headers=headers, timeout=timeout)
        card = r.raise_for_status().json()["data"][0]
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise RuntimeError(f"upstream {upstream} did not list its models ({type(exc).__name__}: {exc})") from None
    return str(card["id"]), str(card.get("owned_by", ""))


def start_checks(args, upstream_key: str | None) -> dict:
    """Steps 2-4 of the module doc; returns {"block_size", "kinds"}; raises on any failure."""
    from .probe import UnverifiedUpstream, check_public_prefix, probe_upstream

    kinds, block_sizes, models = [], [], []
    for upstream in args.upstream:
        model, owner = discover(upstream, upstream_key)
        kinds.append(owner)
        models.append(model)
        if args.allow_unverified_upstream:
            log.warning("--allow-unverified-upstream: NOT checking that %s honours the salt", upstream)
            continue
        result = probe_upstream(upstream, model, upstream_key, salt_header=args.salt_header)
        log.info("probe: %s", result.describe())
        if not result.verified:
            raise UnverifiedUpstream(f"refusing to start: {result.describe()}.  Fix the upstream (prefix "
                                     "caching on, a vLLM with cache_salt), or pass --allow-unverified-upstream")
        if result.block_size:
            block_sizes.append(result.block_size)
    block = args.block_size or (block_sizes[0] if block_sizes else 16)
    if block_sizes and args.block_size and args.block_size not in block_sizes:
        raise UnverifiedUpstream(f"--block-size {args.block_size} but the probe measured {block_sizes}")
    if args.public_prefix:
        if any(k != "minikv" for k in kinds):
            raise UnverifiedUpstream("--public-prefix needs minikv upstreams (minikv serve --shared-prefix): "
                                     "vLLM 0.32 mixes cache_salt into block 0's hash, so no block of a salted "
                                     "request can be shared across salts")
        from .oversight import PromptTokens
        ids = PromptTokens(_tokenizer_dir(tokenizer_name(args, models))).completion(args.public_prefix)
        for upstream in args.upstream:
            shared = check_public_prefix(upstream, discover(upstream, upstream_key)[0], ids, block,
                                         upstream_key, args.salt_header)
            if shared < block:
                raise UnverifiedUpstream(f"{upstream} does not share the public prefix across salts "
                                         f"(cached {shared} tokens); start it with --shared-prefix and the same text")
    return {"block_size": block, "kinds": kinds, "models": models,
            "tenant_upstreams": tuple(u for u, k in zip(args.upstream, kinds) if k == "minikv")}


def tokenizer_name(args, models: list[str]) -> str:
    """``--tokenizer``, or with ``auto`` the model the upstreams serve (they must agree): the
    fingerprints must cut prompts exactly as the upstream's tokenizer does."""
    if args.tokenizer != "auto":
        return args.tokenizer
    if len(set(models)) != 1:
        raise ValueError(f"the upstreams serve different models {sorted(set(models))}; pass --tokenizer")
    return models[0]


def _tokenizer_dir(name: str):
    from ..models.hub import resolve_model
    try:
        return resolve_model(name, progress=False)
    except (ValueError, FileNotFoundError) as exc:
        raise ValueError(f"no local tokenizer for {name!r} ({exc}); pass --tokenizer DIR or 'none'") from None


def _cmd_gateway(args: argparse.Namespace) -> int:
    from ..serve.auth import check_disjoint, load_api_keys
    from .app import GatewayConfig, create_gateway_app
    from .oversight import GatewayTrail, PromptTokens
    from .probe import UnverifiedUpstream
    from .salt import load_gateway_keys

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        keys = load_gateway_keys(args.api_keys, args.salt_scope)
        ops = load_api_keys(args.operator_keys, what="operator", flag="--operator-keys") if args.operator_keys else None
        check_disjoint(api_keys=keys.api_keys, operator_keys=ops)
        limits = limits_from_args(args)
        secret = _read_secret(args.secret_file)
        upstream_key = _upstream_key(args)
        checks = start_checks(args, upstream_key)
        for upstream in checks["tenant_upstreams"]:
            check_tenant_header(upstream, upstream_key, keys.tenants[0])
        tokens = None if args.tokenizer == "none" else \
            PromptTokens(_tokenizer_dir(tokenizer_name(args, checks["models"])))
        trail = GatewayTrail(secret, checks["block_size"], args.trail) if tokens is not None else None
    except (OSError, ValueError, TypeError, RuntimeError, UnverifiedUpstream) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if not _is_loopback(args.host):
        print(f"warning: listening on {args.host}, not loopback: put TLS in front", file=sys.stderr)
    config = GatewayConfig(upstreams=tuple(args.upstream), secret=secret, upstream_key=upstream_key,
                           salt_scope=args.salt_scope, salt_header=args.salt_header, limits=limits,
                           max_tokens_cap=args.max_tokens_cap, prefix_tokens=checks["block_size"],
                           tenant_upstreams=checks["tenant_upstreams"])
    app = create_gateway_app(config, keys, operator_keys=ops, tokens=tokens, trail=trail)
    import uvicorn
    log.info("gateway for %d tenant(s) on %s:%d -> %s (block size %d)", len(keys.tenants), args.host,
             args.port, ", ".join(args.upstream), checks["block_size"])
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, log_config=None,
                access_log=not args.no_access_log)
    return 0


def add_gateway_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``gateway`` on a subparsers action; sets ``func`` to the handler."""
    p = subparsers.add_parser("gateway", help="salting, rate-limiting reverse proxy for vLLM or minikv serve",
                              description="An OpenAI-compatible reverse proxy that binds each request to the "
                                          "tenant of its API key: a server-derived cache_salt, per-tenant limits, "
                                          "an operator trail, salt-aware routing.")
    p.add_argument("--upstream", action="append", required=True, metavar="URL", type=upstream_url,
                   help="upstream API root ending in /v1 (repeat for several); a minikv serve upstream must "
                        "list --upstream-key-file's key in its --gateway-keys, so that it sees each tenant")
    p.add_argument("--api-keys", required=True, metavar="FILE",
                   help='JSON object API key -> "tenant" or "tenant/user" (minikv serve\'s strict loader)')
    p.add_argument("--operator-keys", metavar="FILE", help="JSON operator key -> name: /metrics, /admin/findings")
    p.add_argument("--secret-file", metavar="FILE", help="gateway secret (>= 16 bytes) the salts derive from")
    p.add_argument("--upstream-key-file", metavar="FILE",
                   help="the gateway's own key for the upstreams (default $MINIKV_UPSTREAM_KEY)")
    p.add_argument("--salt-scope", choices=("tenant", "user"), default="tenant",
                   help="one cache domain per tenant (default) or per user of a tenant")
    p.add_argument("--salt-header", action="store_true", help="also send the salt as X-Cache-Salt")
    p.add_argument("--allow-unverified-upstream", action="store_true",
                   help="skip the start-up probe that the upstream honours the salt (UNSAFE)")
    p.add_argument("--public-prefix", metavar="TEXT",
                   help="a prefix shared across tenants; minikv upstreams (--shared-prefix) only")
    p.add_argument("--tokenizer", default="auto",
                   help="the upstream model's tokenizer: a name, a directory, 'auto' (default: the model "
                        "id the upstreams list, resolved by minikv.models.hub) or 'none' (no trail)")
    p.add_argument("--block-size", type=positive_int, help="upstream KV block size (default: measured by the probe)")
    p.add_argument("--trail", metavar="FILE", help="operator trail (JSONL, keyed fingerprints, no prompt text)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=512,
                   help="largest max_tokens per request (400 above; the default when absent; default 512)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true")
    _add_limit_arguments(p)
    p.set_defaults(func=_cmd_gateway)
    return p
