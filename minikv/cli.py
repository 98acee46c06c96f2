"""The ``minikv`` command: ``generate``, ``serve``, ``gateway``, ``audit``, ``bench``.

    minikv generate --model tiny-random "Once upon a time" --max-tokens 16 --temperature 0
    minikv serve --model smollm2-135m-instruct --api-keys keys.json --enable-prefix-caching
    minikv gateway --upstream http://127.0.0.1:8017/v1 --api-keys keys.json --secret-file gw.secret
    minikv audit isolation --model tiny-random --enable-prefix-caching
    minikv audit timing --base-url http://127.0.0.1:8000/v1 --api-key sk-... --victim-key sk-...
    minikv bench ...

Every subcommand's handler returns the process exit status.  Heavy imports (torch, FastAPI)
happen inside the handlers, so ``minikv --help`` is instant.
"""
from __future__ import annotations

import argparse
import importlib
import sys


def _cmd_generate(args: argparse.Namespace) -> int:
    from .engine.cli_flags import engine_kwargs_from_args

    try:
        from .llm import LLM
        from .engine.sampling import SamplingParams
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.sample_seed, stop=args.stop or None,
                                ignore_eos=args.ignore_eos)
        llm = LLM(**engine_kwargs_from_args(args))
        if args.chat:
            out = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
        else:
            out = llm.generate(args.prompt, params)[0]
    except (OSError, ValueError, TypeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(out.outputs[0].text)
    return 0


def _add_generate(sub: argparse._SubParsersAction) -> None:
    from .engine.cli_flags import add_engine_arguments

    p = sub.add_parser("generate", help="complete one prompt and print the completion")
    p.add_argument("prompt", help="the prompt text")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sample-seed", type=int, help="per-request sampling seed")
    p.add_argument("--stop", action="append", help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    add_engine_arguments(p)
    p.set_defaults(func=_cmd_generate)


def _cmd_bench(args: argparse.Namespace) -> int:
    return run_bench(list(args.bench_args))


def run_bench(argv: list[str]) -> int:
    """Delegate to ``minikv.bench.main(argv)`` when that module exists."""
    try:
        bench = importlib.import_module("minikv.bench")
    except ModuleNotFoundError as exc:
        if exc.name not in ("minikv.bench",):
            raise
        print("error: minikv.bench is not available in this installation", file=sys.stderr)
        return 1
    main = getattr(bench, "main", None)
    if main is None:
        print("error: minikv.bench has no main()", file=sys.stderr)
        return 1
    rc = main(argv)
    return int(rc or 0)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="run the benchmarks (minikv.bench)", add_help=False,
                       description="Every argument is passed on to minikv.bench.main.")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd_bench)


def _detector_monitor(config, **knobs):
    """``minikv serve --selective-strategy monitor``'s monitor: the audit detector's probing rule
    (:class:`~minikv.audit.monitor.DetectorMonitor`); ``knobs`` are its ``threshold`` and
    ``window``, from ``--selective-monitor-threshold`` / ``--selective-monitor-window`` when given
    (it checks them: ``window >= threshold >= 2``).  It is wired in here, at the top, because
    neither the engine nor the server may import ``minikv.audit`` (docs/ARCHITECTURE.md, "Layers");
    the import waits until an engine is built, so ``minikv --help`` stays instant."""
    from .audit.monitor import DetectorMonitor

    return DetectorMonitor(config, **knobs)


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .audit.cli import add_audit_parser
    from .audit.isolation import add_isolation_parser
    from .gateway.cli import add_gateway_parser
    from .serve.cli import add_serve_parser

    parser = argparse.ArgumentParser(prog="minikv", description="KV-cache security course engine")
    parser.add_argument("--version", action="version", version=f"minikv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,serve,gateway,audit,bench}")
    _add_generate(sub)
    add_serve_parser(sub, reuse_monitor=_detector_monitor)
    add_gateway_parser(sub)
    add_audit_parser(sub, extra=[add_isolation_parser])
    _add_bench(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # everything after "bench" belongs to minikv.bench, options included
        return run_bench(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
