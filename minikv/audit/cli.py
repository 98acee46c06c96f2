"""``minikv audit ...`` subcommands: ``timing``, ``gu``, ``detect`` (+ hooks for more, e.g. ``isolation``).

The top-level CLI calls ``add_audit_parser(subparsers)``; every leaf parser sets ``func`` to a
handler ``handler(args) -> int`` (the process exit code), so the caller runs
``sys.exit(args.func(args))``.  Exit codes: 0 = ran fine (whatever the verdict), 1 = error,
2 = sharing detected / findings present, but only with ``--fail-on-detect`` / ``--fail-on-findings``
(so a CI job can gate on isolation without every exploratory run "failing").

``python -m minikv.audit.cli ...`` runs the same commands standalone.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Callable, Iterable

from ..engine.cli_flags import int_at_least, positive_int

Registrar = Callable[["argparse._SubParsersAction"], None]

#: Extra ``audit`` sub-subcommands registered by other modules (e.g. the isolation audit).
#: Each entry receives the audit subparsers action and must add its parser with ``func`` set.
EXTRA_AUDIT_COMMANDS: list[Registrar] = []


def register_audit_command(registrar: Registrar) -> Registrar:
    """Add a registrar to ``EXTRA_AUDIT_COMMANDS`` (usable as a decorator); call before parsing."""
    EXTRA_AUDIT_COMMANDS.append(registrar)
    return registrar


def _err(msg: str) -> int:
    print(f"error: {msg}", file=sys.stderr)
    return 1


def _cmd_timing(args: argparse.Namespace) -> int:
    import httpx

    from .timing import TimingPlan, run_timing_audit
    from .timing_client import TimingAuditError

    key = args.api_key or os.environ.get("MINIKV_AUDIT_API_KEY")
    if not key:
        return _err("--api-key (or $MINIKV_AUDIT_API_KEY) is required")
    victim = args.victim_key or os.environ.get("MINIKV_AUDIT_VICTIM_KEY")
    samples, tokens = (250, 5000) if args.gu_scale else (args.samples, args.prompt_tokens)
    try:
        out = run_timing_audit(
            args.base_url, key, victim_key=victim, model=args.model, n_samples=samples,
            prompt_tokens=tokens, prefix_fraction=args.prefix_fraction,
            endpoint="chat" if args.chat else "completions", rate_limit=args.rate_limit, seed=args.seed,
            progress=not args.no_progress, victim_requests=args.victim_requests, alpha=args.alpha,
            dry_run=args.dry_run, timeout=args.timeout, prime_url=args.prime_url)
    except (TimingAuditError, httpx.HTTPError, ValueError) as exc:
        return _err(str(exc))
    if isinstance(out, TimingPlan):
        print(out.describe())
        return 0
    for note in out.notes:
        print(f"note: {note}", file=sys.stderr)
    r = out.result
    print(f"hit candidates: n={r.n_hit} median={r.median_hit * 1e3:.2f} ms | "
          f"misses: n={r.n_miss} median={r.median_miss * 1e3:.2f} ms | KS D={r.ks_stat:.3f}")
    print(out.verdict)
    try:
        outdir = Path(args.out)
        outdir.mkdir(parents=True, exist_ok=True)
        stem = outdir / time.strftime("timing-%Y%m%d-%H%M%S")
        Path(f"{stem}.json").write_text(out.to_json(), encoding="utf-8")
        out.save_plot(f"{stem}.png")
    except OSError as exc:
        return _err(f"could not write the report: {exc}")
    print(f"report: {stem}.json  plot: {stem}.png")
    return 2 if (out.detected and args.fail_on_detect) else 0


def _cmd_gu(args: argparse.Namespace) -> int:
    from .gu import find_gu_zip, gu_table, gu_verdicts
    from .gu_data import ATTRIBUTION, GU_URL, GuDataError, fetch_gu_data

    if args.fetch:   # the authors' file at the pinned commit, sha256-checked, into $MINIKV_HOME/data/
        try:
            print(f"fetched: {fetch_gu_data(args.url or GU_URL, progress=not args.no_progress)}")
        except GuDataError as exc:
            return _err(str(exc))
    path = args.zip or find_gu_zip()
    if path is None:
        return _err("gu-audit-data.zip not found: run `minikv audit gu --fetch`, pass --zip or set $MINIKV_SHARED")
    print(ATTRIBUTION)
    try:
        verdicts = gu_verdicts(path, alpha=args.alpha, bonferroni=args.bonferroni)
    except (OSError, ValueError, KeyError) as exc:
        return _err(f"{path}: {exc}")
    print(gu_table(verdicts, detail=args.detail))
    return 0


def _cmd_detect(args: argparse.Namespace) -> int:
    from .detector import detect, format_findings, load_trails

    try:
        findings = detect(load_trails(args.trail), threshold=args.threshold, block_size=args.block_size,
                          min_evictions=args.min_evictions)
    except (OSError, ValueError, TypeError) as exc:
        return _err(str(exc))
    if args.json:
        import json
        from dataclasses import asdict
        print(json.dumps([asdict(f) for f in findings], indent=2))
    else:
        print(format_findings(findings))
    return 2 if (findings and args.fail_on_findings) else 0


def _add_timing(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("timing", help="timing audit of an OpenAI-compatible endpoint (Gu et al.)",
                       description="Detect prompt-cache sharing from response times alone.")
    p.add_argument("--base-url", required=True, help="API root ending in /v1, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--api-key", help="attacker key (default $MINIKV_AUDIT_API_KEY)")
    p.add_argument("--victim-key", help="victim key (default $MINIKV_AUDIT_VICTIM_KEY); "
                   "without one the attacker primes itself (per-user caching test)")
    p.add_argument("--prime-url", metavar="URL",
                   help="send the priming requests to this other instance (same keys) and time --base-url: "
                        "audits instances sharing a KV tier (--kv-tier redis://...)")
    p.add_argument("--model", help="model id (default: first entry of GET /models)")
    p.add_argument("--samples", type=int, default=25, help="trials per arm (default 25; Gu et al.: 250)")
    p.add_argument("--prompt-tokens", type=int, default=512, help="approx. prompt length (default 512; Gu: 5000)")
    p.add_argument("--gu-scale", action="store_true", help="Gu et al.'s scale: 250 samples, 5000 tokens")
    p.add_argument("--prefix-fraction", type=float, default=1.0, help="shared prefix fraction (default 1.0)")
    p.add_argument("--victim-requests", type=int, default=1, help="victim primes per hit trial (Gu: 1, 5, 25)")
    p.add_argument("--chat", action="store_true", help="use /chat/completions instead of /completions")
    p.add_argument("--rate-limit", type=float, help="max requests per second")
    p.add_argument("--seed", type=int, default=0, help="trial-order seed")
    p.add_argument("--alpha", type=float, default=1e-8, help="significance level (default 1e-8)")
    p.add_argument("--timeout", type=float, default=120.0, help="per-request timeout in seconds")
    p.add_argument("--out", default="minikv-audit", help="folder for the JSON report and PNG plot")
    p.add_argument("--dry-run", action="store_true", help="print what would be sent; send nothing")
    p.add_argument("--fail-on-detect", action="store_true", help="exit 2 when sharing is detected")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_timing)


def _add_gu(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("gu", help="recompute Gu et al.'s verdicts from their released timings")
    p.add_argument("--zip", help="path to gu-audit-data.zip (default: $MINIKV_SHARED, then $MINIKV_HOME/data/, "
                                 "then shared/data/)")
    p.add_argument("--fetch", action="store_true",
                   help="first download the authors' audit-data.zip (pinned commit, sha256-checked) into $MINIKV_HOME")
    p.add_argument("--url", help="with --fetch: a mirror of that file (its sha256 must still match)")
    p.add_argument("--no-progress", action="store_true", help="with --fetch: no progress bar")
    p.add_argument("--alpha", type=float, default=1e-8)
    p.add_argument("--bonferroni", action="store_true", help="correct alpha for configurations per cell")
    p.add_argument("--detail", action="store_true", help="one line per configuration")
    p.set_defaults(func=_cmd_gu)


def _add_detect(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("detect", help="flag cross-tenant hits, probing and eviction pressure in an audit trail",
                       description="Read audit trails (a live path brings its rotated .N/.N.gz files, "
                                   "oldest first) and print what the detector flags.")
    p.add_argument("trail", nargs="+", help="JSONL audit trail(s) written by the server: paths or globs")
    p.add_argument("--threshold", type=int_at_least(2), default=8, help="requests per probing group (default 8)")
    p.add_argument("--min-evictions", type=positive_int, default=32,
                   help="other tenants' blocks a tenant must evict to be flagged for eviction pressure (default 32)")
    p.add_argument("--block-size", type=positive_int, help="KV block size (default: inferred from the trail)")
    p.add_argument("--json", action="store_true", help="print findings as JSON")
    p.add_argument("--fail-on-findings", action="store_true", help="exit 2 when anything is found")
    p.set_defaults(func=_cmd_detect)


def add_audit_parser(subparsers: argparse._SubParsersAction,
                     extra: Iterable[Registrar] = ()) -> argparse._SubParsersAction:
    """Register ``audit`` with its subcommands; returns the audit subparsers action.

    ``extra`` (and anything in ``EXTRA_AUDIT_COMMANDS``) are called with that action, so e.g. the
    isolation audit can add ``audit isolation`` without this module importing it.  The returned
    action also accepts ``.add_parser(...)`` afterwards.
    """
    audit = subparsers.add_parser("audit", help="audit prompt-cache isolation",
                                  description="Audit prompt-cache isolation from outside or from the trail.")
    sub = audit.add_subparsers(dest="audit_command", metavar="{timing,gu,detect,...}")
    for add in (_add_timing, _add_gu, _add_detect, *EXTRA_AUDIT_COMMANDS, *extra):
        add(sub)
    audit.set_defaults(func=lambda args: (audit.print_help(), 1)[1])
    return sub


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="minikv")
    add_audit_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main(["audit", *sys.argv[1:]] if sys.argv[1:2] != ["audit"] else sys.argv[1:]))
