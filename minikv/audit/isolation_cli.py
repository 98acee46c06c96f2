"""``minikv audit isolation``: the isolation audit from the command line.

``--model M`` audits an engine in-process (:mod:`minikv.audit.isolation_engine`), ``--base-url URL
--api-keys FILE`` a running server (:mod:`minikv.audit.isolation_server`).  The exit status carries
the verdict so a CI job can gate on it: 0 pass, 2 violation, 3 inconclusive -- kept apart from a
violation because "the audit saw no hits at all" needs a different fix (turn on caching, or
``--report-cached-tokens``) than a leak -- and 1 for an error.
"""
from __future__ import annotations

import argparse
import json
import sys

from .isolation import FAIL, INCONCLUSIVE, PASS
from .isolation_engine import audit_engine
from .isolation_server import audit_server


def _cmd_isolation(args: argparse.Namespace) -> int:
    try:
        if args.base_url:
            if args.model:
                print("error: give either --model (in-process) or --base-url (server), not both",
                      file=sys.stderr)
                return 1
            if not args.api_keys:
                print("error: --base-url needs --api-keys FILE (JSON: key -> tenant, >= 2 tenants)",
                      file=sys.stderr)
                return 1
            with open(args.api_keys, encoding="utf-8") as fh:
                keys = json.load(fh)
            if not isinstance(keys, dict):
                raise ValueError("--api-keys must hold a JSON object mapping key -> tenant")
            report = audit_server(args.base_url, keys, model=args.served_model, rounds=args.rounds,
                                  seed=args.seed_workload, concurrency=args.concurrency,
                                  prompt_words=args.prompt_words, timeout=args.timeout, prime_url=args.prime_url)
        else:
            if not args.model:
                print("error: give --model M (in-process) or --base-url URL --api-keys FILE", file=sys.stderr)
                return 1
            from ..engine.cli_flags import engine_kwargs_from_args
            tenants = [t for t in args.tenants.split(",") if t]
            report = audit_engine(engine_kwargs_from_args(args), tenants=tenants, rounds=args.rounds,
                                  seed=args.seed_workload, prompt_words=args.prompt_words)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(report.to_json() if args.json else report.summary())
    for note in report.notes:
        print(f"note: {note}", file=sys.stderr)
    return {PASS: 0, FAIL: 2, INCONCLUSIVE: 3}[report.verdict]


def add_isolation_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``audit isolation`` on the audit subparsers (see ``minikv.audit.cli``)."""
    from ..engine.cli_flags import add_engine_arguments

    p = sub.add_parser("isolation", help="concurrent multi-tenant isolation audit (engine or server)",
                       description="Check that no request is served from another tenant's cache, and that "
                                   "the audit could see same-tenant hits at all.  Exit status: 0 pass, "
                                   "2 violation, 3 inconclusive, 1 error.")
    p.add_argument("--base-url", help="audit a running server (API root ending in /v1)")
    p.add_argument("--api-keys", metavar="FILE", help="JSON key -> tenant (server mode; >= 2 tenants)")
    p.add_argument("--prime-url", metavar="URL",
                   help="server mode: send the first sends of every prompt to this other instance (same keys), "
                        "the rest to --base-url: audits instances sharing a KV tier (--kv-tier redis://...)")
    p.add_argument("--served-model", help="server mode: model id (default: first of GET /models)")
    p.add_argument("--tenants", default="alice,bob,carol", help="engine mode: comma-separated tenants")
    p.add_argument("--rounds", type=int, default=2, help="rounds of repeated prefixes (default 2)")
    p.add_argument("--prompt-words", type=int, default=40, help="words per system prompt / document")
    p.add_argument("--concurrency", type=int, default=8, help="server mode: parallel requests")
    p.add_argument("--timeout", type=float, default=120.0, help="server mode: per-request timeout (s)")
    p.add_argument("--seed-workload", type=int, default=0, help="order of requests within waves")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    add_engine_arguments(p, model_required=False)
    p.set_defaults(func=_cmd_isolation)
    return p
