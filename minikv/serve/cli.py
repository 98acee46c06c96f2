"""``minikv serve``: the server's own flags (limits, keys, addresses) next to the engine's
(:mod:`minikv.engine.cli_flags`, shared with ``generate`` and ``audit isolation``).

This module imports only argparse (and those flags) at import time; the engine, FastAPI and
uvicorn are imported when a command runs.
"""
from __future__ import annotations

import argparse
import functools
import ipaddress
import logging
import sys
import time

from ..engine.cli_flags import (add_engine_arguments, engine_kwargs_from_args, int_at_least, monitor_kwargs_from_args,
                           positive_int)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


#: ``minikv serve``'s step token budgets when none are given, by device type: (alone, contended),
#: i.e. ``--max-num-batched-tokens`` and ``--contended-num-batched-tokens``.  A server is shared:
#: every tenant's decode shares a step with whatever prefill chunks fill the rest of the budget.  On
#: a CPU a step's time grows with its tokens, so while tenants compete the budget is what bounds how
#: much one tenant's prompts slow another's tokens: 32.  A tenant alone gets 512, since tiny chunks
#: cost a lone long prompt several times its one-piece prefill; 512 also bounds the one step a
#: newcomer may find in flight when it arrives.  On a GPU a step of a few hundred tokens costs about
#: what a decode does, so the budgets are larger.  docs/BENCHMARKS.md (availability) has the runs.
SERVE_STEP_BUDGET = {"cpu": (512, 32), "cuda": (4096, 512)}


def serve_step_budget(device: str | None) -> tuple[int, int]:
    """``minikv serve``'s default (alone, contended) step budgets for ``device`` (None: the device
    the engine would pick)."""
    from ..engine.device import resolve_device
    return SERVE_STEP_BUDGET.get(resolve_device(device).type, SERVE_STEP_BUDGET["cpu"])


_LIMIT_FLAGS = ("requests_per_s", "burst", "max_concurrent", "max_queued", "max_tokens_in_flight",
                "max_body_bytes", "max_prompt_chars", "max_messages")


def limits_from_args(args: argparse.Namespace):
    """A :class:`~minikv.serve.limits.ServeLimits` from the flags given (0 turns the rate,
    concurrency and decode-budget limits off; ``--max-queued 0`` means no queue); the defaults
    are the dataclass's."""
    from .limits import ServeLimits

    given = {f: getattr(args, f) for f in _LIMIT_FLAGS if getattr(args, f, None) is not None}
    for f in ("requests_per_s", "max_concurrent", "max_tokens_in_flight"):   # not max_queued: 0 = no queue
        if given.get(f) == 0:
            given[f] = None
    return ServeLimits(**given)


def app_from_args(args: argparse.Namespace):
    """``(app, operator keys)``: what ``minikv serve`` runs for ``args`` -- keys, limits, the engine
    (with ``args.reuse_monitor`` handed in under ``--selective-strategy monitor``, given the
    ``--selective-monitor-*`` values as keyword arguments) and the app around it.  Bad settings
    raise (OSError, ValueError, TypeError, RuntimeError) before a port is opened -- the monitor's
    own checks too (``window`` below ``threshold``), before the model is loaded; warnings about
    settings go to stderr."""
    from ..llm import LLM
    from .app import create_app
    from .auth import check_disjoint, load_api_keys

    keys = load_api_keys(args.api_keys)
    ops = load_api_keys(args.operator_keys, what="operator", flag="--operator-keys") if args.operator_keys else None
    gateways = load_api_keys(args.gateway_keys, what="gateway", flag="--gateway-keys") if args.gateway_keys else None
    check_disjoint(api_keys=keys, operator_keys=ops, gateway_keys=gateways)  # before the model loads
    limits = limits_from_args(args)
    kwargs = engine_kwargs_from_args(args)
    alone, contended = serve_step_budget(kwargs.get("device"))
    kwargs.setdefault("max_num_batched_tokens", alone)
    kwargs.setdefault("contended_num_batched_tokens", min(contended, kwargs["max_num_batched_tokens"]))
    knobs = monitor_kwargs_from_args(args)
    if kwargs.get("selective_strategy") == "monitor":  # the factory is set by the parser's composition root
        kwargs["reuse_monitor"] = functools.partial(args.reuse_monitor, **knobs)
        # Build one throw-away monitor (no engine yet: config=None) so that its own checks of the
        # knobs (``window`` below ``threshold``) refuse a bad command before the model loads.
        kwargs["reuse_monitor"](None)
    llm = LLM(**kwargs)
    config = llm.engine.config
    if args.prefault_kv:  # before the port opens: the first requests find every block resident
        pool, t0 = llm.engine.pool, time.perf_counter()
        how = pool.prefault()
        logging.getLogger("minikv.serve").info("KV pool resident (%s): %.2f GiB in %.2f s", how,
                                               pool.nbytes / 2**30, time.perf_counter() - t0)
    if args.trust_client_salt and config.cache_isolation != "tenant":
        print("warning: --trust-client-salt has no effect unless --cache-isolation tenant", file=sys.stderr)
    if knobs and getattr(llm.engine.sharing, "name", None) != "monitor":
        print("warning: --selective-monitor-* flags have no effect unless --enable-prefix-caching "
              "--cache-isolation selective --selective-strategy monitor", file=sys.stderr)
    unsafe = config.unsafe_settings()
    if unsafe:
        print("warning: serving with UNSAFE settings: " + ", ".join(unsafe), file=sys.stderr)
    for host in {args.host, args.metrics_host}:
        if not _is_loopback(host):
            print(f"warning: listening on {host}, not loopback: put TLS and a firewall in front",
                  file=sys.stderr)
    app = create_app(llm, keys, model_name=args.served_model_name or args.model,
                     report_cached_tokens=args.report_cached_tokens, limits=limits, operator_keys=ops,
                     trust_client_salt=args.trust_client_salt, gateway_keys=gateways)
    return app, ops


def _cmd_serve(args: argparse.Namespace) -> int:
    from .app import create_metrics_app

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        app, ops = app_from_args(args)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    engine, keys = app.state.engine, app.state.api_keys

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
        if engine.audit is not None:  # write the summaries of requests still in flight
            engine.audit.close()
    return 0


def _nonneg_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (value >= 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"expected a finite number >= 0, got {text!r}")
    return value


_nonneg_int = int_at_least(0)


def _add_limit_arguments(p: argparse.ArgumentParser) -> None:
    from_docs = " (default: ServeLimits' value; 0 = no limit)"
    g = p.add_argument_group("per-tenant and per-request limits (see minikv.serve.limits)")
    g.add_argument("--requests-per-s", type=_nonneg_float, help="sustained requests/s per tenant" + from_docs)
    g.add_argument("--burst", type=positive_int, help="requests a tenant may send at once")
    g.add_argument("--max-concurrent", type=_nonneg_int, help="requests per tenant served at once" + from_docs)
    g.add_argument("--max-queued", type=_nonneg_int, help="requests per tenant waiting for a slot (0: no queue)")
    g.add_argument("--max-tokens-in-flight", type=_nonneg_int,
                   help="sum of max_tokens over a tenant's admitted requests" + from_docs)
    g.add_argument("--max-body-bytes", type=positive_int, help="largest request body (default 1 MiB; -> 413)")
    g.add_argument("--max-prompt-chars", type=positive_int, help="largest prompt, in characters (-> 400)")
    g.add_argument("--max-messages", type=positive_int, help="most messages in one chat request (-> 400)")


def add_serve_parser(subparsers: argparse._SubParsersAction, reuse_monitor=None) -> argparse.ArgumentParser:
    """Register ``serve`` on a subparsers action; sets ``func`` to the handler.

    ``reuse_monitor``: the factory ``--selective-strategy monitor`` hands the engine
    (``EngineConfig.reuse_monitor``), called as ``reuse_monitor(config, threshold=N, window=N)``
    with whichever ``--selective-monitor-*`` flags were given; without one neither that strategy
    nor those flags are offered.  The server may not import ``minikv.audit``, where minikv's
    monitor lives (tests/test_layering.py), so the ``minikv`` command, which sits above both,
    passes it in (:mod:`minikv.cli`)."""
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
    p.add_argument("--trust-client-salt", action="store_true",
                   help="honour the request's cache_salt like vLLM (a salt narrows the key's tenant domain; "
                        "see minikv.serve.client_salt); off by default")
    p.add_argument("--operator-keys", metavar="FILE",
                   help="JSON object mapping operator key -> name; these keys (only) may read /metrics")
    p.add_argument("--gateway-keys", metavar="FILE",
                   help="JSON object mapping gateway key -> gateway name; a request with one of these keys may "
                        "name its tenant in X-Minikv-Tenant and is served as '<gateway>/<tenant>' "
                        "(see minikv.serve.identity); a tenant key sending that header gets 403")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address of --metrics-port (default 127.0.0.1)")
    p.add_argument("--metrics-port", type=int,
                   help="serve /metrics on this separate, operator-only port (no tenant key opens it)")
    p.add_argument("--prefault-kv", action="store_true",
                   help="make the whole KV pool resident at start-up, so that no request pays for the first "
                        "touch of blocks never written before (CPU: one madvise, logged with its time; CUDA "
                        "memory is resident already); off by default: it holds the pool's memory from the start")
    p.add_argument("--log-level", default="info", choices=("critical", "error", "warning", "info", "debug"))
    p.add_argument("--no-access-log", action="store_true", help="no per-request access log lines")
    _add_limit_arguments(p)
    add_engine_arguments(p, monitor=reuse_monitor is not None)
    p.set_defaults(func=_cmd_serve, reuse_monitor=reuse_monitor)
    return p
