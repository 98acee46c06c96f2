"""``make gpu-check``: every CUDA check in one command, with a summary at the end.

    .venv/bin/python scripts/gpu_check.py [--keep DIR] [--skip-bench] [--report DIR]

No network and no SmolLM2 checkpoint are needed: the script builds a random-weight Llama with
SmolLM2-135M's shapes (30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49,152; seeded)
and the byte-level test tokenizer, saves it to a temporary directory and checks on the GPU:

1. correctness against transformers on the same weights: ``score`` logits of both attention
   backends in fp32 (within 1e-4 of the largest logit: CUDA kernels may pick other reduction orders
   than transformers' calls, so the CPU's 1e-5 is not asked here) and bf16 (within 8% of the
   largest logit), greedy tokens of a batch identical to transformers';
2. the CUDA tests (``pytest -k cuda`` over the engine's attention and CUDA-graph tests and every
   backend's equality with the reference in logits, tokens and pool: they skip on a CPU), and
   that the greedy run's decode steps were CUDA graph replays;
3. ``python -m minikv.bench --device cuda`` on that model in bf16 and fp32: throughput against
   transformers, TTFT, prefill FLOP/s against the measured matmul peak, ops and kernels per
   decode step;
4. the TTFT scan (``minikv.bench.ttft_scan``): prefix hit against miss at 256, 1,024, 4,096
   and 7,000 tokens, bf16 and fp32, 12 alternating pairs each, medians of the engine's TTFT, the
   one-sided Mann-Whitney p and a 1,024-token miss against its FLOP floor, printed as a
   table with PASS/FAIL per row against its targets (each a check of the summary), and that every
   request of it replayed a prefill CUDA graph (``prefill_graphs.py``), then again in bf16 on the
   ``triton`` backend (its rows named ``[triton] ...``; its hits replay graphs that call its kernel);
5. the ``triton`` backend (Triton paged attention, hits read in place from the pool): its kernel
   against the reference attention on prefill, hit, decode and mixed calls in fp32, fp16 and
   bf16, and a tiny-random engine on it against the reference backend (run after step 1; in a
   dry run under Triton's interpreter when ``make triton`` has installed it).

Exit status: 0 when every check passed, 1 when one failed, 2 when there is **no CUDA device**
("no CUDA device: nothing to check"): a GPU check that checked nothing has not passed, so a CI
job that expects a GPU must not go green on a machine without one.  Budget: under 6 minutes on
one GPU (each step has its own timeout).

``--dry-run-cpu`` runs the same steps on the CPU (no graphs, the CUDA tests skip): a GPU session
has minutes, not hours, so the script's own code and imports are checked here first, the
benchmark and its summary included.  The CPU bench is the same code on a smaller workload (4
requests of 8 tokens, against 16 of 64 on a GPU): the full one takes about 9 minutes on 2 cores,
beyond the bench step's 240 s.  Its KV pools are 0.25 GiB instead of 1 (``--kv-cache-gb``): the
bench makes every pool resident, and with 1 GiB pools the dry run's bench peaked at 8.7 GB resident
on the 2-core CPU, the largest process of ``make test``.  A dry run spends no GPU minutes, so its
bench step may take up to 600 s on a busy machine (240 s on a GPU).  A dry run checks nothing about CUDA and says so in its summary.
Its TTFT scan runs on tiny-random at 32 and 64 tokens with 4 pairs: the table is printed, but its
targets are a GPU's, so the summary records only that the scan ran.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import zlib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOLLM2_SHAPE = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192,
                     rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True)


def build_random_smollm2(out: Path, layers: int | None = None) -> Path:
    """Save a seeded random-weight Llama with SmolLM2-135M's shapes (and the byte-level test
    tokenizer: prompts here are random token ids, so the tokenizer only decodes) to ``out``.
    ``layers``: fewer decoder layers than SmolLM2's 30, every layer's shape unchanged (the test of
    this script: its code paths are the same, at a fifteenth of the work)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))
    from minikv.models.tiny import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    shape = dict(SMOLLM2_SHAPE, **({"num_hidden_layers": layers} if layers else {}))
    config = LlamaConfig(**shape, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():  # the tiny-random recipe's scales: logits that depend on the context
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            p.copy_(torch.ones_like(p) if "norm" in name else
                    torch.randn(p.shape, generator=gen) * (1.0 if "embed_tokens" in name else 0.04))
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def attempt(results: list, name: str, fn) -> None:
    """Run one check, ``fn() -> (ok, detail)``, and record it.  A check that raises is a FAIL
    with the exception named (and its traceback printed), and the checks after it still run: a
    GPU session has minutes, so one broken check must not hide what the others would say."""
    try:
        ok, detail = fn()
    except Exception as exc:  # noqa: BLE001 -- any failure of a check is that check's FAIL
        traceback.print_exc()
        ok, detail = False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    results.append((name, ok, detail))
    print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}", flush=True)


def check_correctness(path: Path, device: str = "cuda") -> list[tuple[str, bool, str]]:
    """minikv (both backends) against transformers on ``device`` (the GPU; the CPU for a dry run), fp32 and bf16."""
    import random

    import torch
    from transformers import AutoModelForCausalLM

    from minikv import LLM, SamplingParams

    results: list[tuple[str, bool, str]] = []
    rng = random.Random(0)
    ids = [rng.randrange(1000, 48000) for _ in range(300)]
    prompts = [[rng.randrange(1000, 48000) for _ in range(n)] for n in (17, 64, 200, 333)]
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 0.08)):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa").to(device).eval()
        with torch.no_grad():
            want = hf(torch.tensor([ids], device=device)).logits[0].float()
        scale = want.abs().max().item()

        def score(backend, dtype=dtype, tol=tol):
            llm = LLM(str(path), device=device, dtype=dtype, attention_backend=backend)
            diff = (llm.engine.score(ids) - want).abs().max().item()
            limit = tol * scale
            return diff <= limit, f"max |diff| {diff:.3g} (limit {limit:.3g}, largest logit {scale:.3g})"
        for backend in ("reference", "fused"):
            attempt(results, f"score {dtype} {backend} vs transformers", lambda b=backend: score(b))
        if dtype == "float32":  # greedy tokens of a batch, fused backend
            llm = None

            def greedy(hf=hf):
                nonlocal llm
                llm = LLM(str(path), device=device, dtype=dtype, attention_backend="fused")
                got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]
                same = 0
                for p, g in zip(prompts, got):
                    with torch.no_grad():
                        out = hf.generate(torch.tensor([p], device=device), max_new_tokens=16, min_new_tokens=16,
                                          do_sample=False, pad_token_id=2)
                    same += out[0, len(p):].tolist() == g
                return same == len(prompts), f"{same}/{len(prompts)} sequences identical"
            attempt(results, "greedy tokens fp32 (fused, batch of 4) == transformers", greedy)

            def graphs():  # those decode steps ran as CUDA graph replays (cuda_graphs.py)
                g = llm.engine.backend.graphs if llm is not None else None
                return (g is not None and g.replays > 0,
                        f"{g.captures} captures, {g.replays} replays" if g is not None else "no graph runner")
            if device == "cuda":  # the CPU never captures graphs: nothing to check in a dry run
                attempt(results, "CUDA graphs ran the decode steps", graphs)
        del hf
        if device == "cuda":
            torch.cuda.empty_cache()
    return results


def scan_step(results: list, path: str, device: str) -> None:
    """The TTFT scan, its table printed; on a GPU each row is a check against its targets,
    in a dry run (tiny-random, 32 and 64 tokens, 4 pairs) one check that it ran and printed every row."""
    from minikv.bench.ttft_scan import format_scan, run_scan, verdicts

    t0 = time.perf_counter()
    if device == "cpu":
        kw = dict(path="tiny-random", lengths=(32, 64), pairs=4, kv_cache_gb=0.05, floor_length=64)
    else:
        kw = dict(path=path)
    try:
        scan = run_scan(device=device, **kw)
    except Exception as exc:  # noqa: BLE001 -- a scan that raises is its FAIL; the summary still prints
        traceback.print_exc()
        results.append(("ttft scan", False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
        return
    print(f"\n== TTFT scan ({time.perf_counter() - t0:.0f} s) ==", flush=True)
    print("\n".join(format_scan(scan)), flush=True)
    if device == "cpu":
        rows = sum(len(s["rows"]) for s in scan.values())
        results.append(("ttft scan ran (DRY RUN on tiny-random, targets not held)", True,
                        f"{rows} rows, {time.perf_counter() - t0:.0f} s"))
    else:
        results.extend(verdicts(scan))
        triton_scan(results, path)


def triton_scan(results: list, path: str) -> None:
    """The scan again in bf16 on the ``triton`` backend (hits read the pool in place, no gather),
    its rows checks of their own, named ``[triton] ...``."""
    from minikv.bench.ttft_scan import format_scan, run_scan, verdicts

    t0 = time.perf_counter()
    try:
        scan = run_scan(device="cuda", path=path, dtypes=("bfloat16",), attention_backend="triton")
    except Exception as exc:  # noqa: BLE001 -- as scan_step
        traceback.print_exc()
        results.append(("[triton] ttft scan", False, f"raised {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"))
        return
    print(f"\n== TTFT scan, triton backend (bf16; {time.perf_counter() - t0:.0f} s) ==", flush=True)
    print("\n".join(format_scan(scan)), flush=True)
    results.extend((f"[triton] {name}", ok, detail) for name, ok, detail in verdicts(scan))


def triton_step(results: list, device: str) -> None:
    """The ``triton`` backend: its kernel against the reference attention on prefill, hit, decode
    and mixed calls (``scripts/triton_check.py``), and a tiny-random engine on it against the
    reference backend step by step (``tests/triton_engine_check.py``), and again with its hits
    replayed from prefill graphs (``prefill-graphs``).  On CUDA with torch's own
    Triton, bf16 included; in a dry run in Triton's interpreter, from ``.triton-site`` (``make
    triton``; without it the dry run says so and checks nothing of Triton)."""
    extra = {}
    if device == "cpu":
        if not (ROOT / ".triton-site" / "triton").is_dir():
            print("  (triton backend not checked in this dry run: no .triton-site, `make triton` installs it)", flush=True)
            return
        extra = {"PYTHONPATH": str(ROOT / ".triton-site"), "TRITON_INTERPRET": "1"}
    dtypes = "float32,float16" if device == "cpu" else "float32,float16,bfloat16"
    for name, cmd in ((f"triton kernel == reference attention (prefill, hit, decode, mixed; {dtypes})",
                       ["scripts/triton_check.py", "--device", device, "--dtypes", dtypes]),
                      ("triton backend == reference backend (tiny-random engine, step by step)",
                       ["tests/triton_engine_check.py", device]),
                      ("triton hits from prefill graphs == reference backend (tiny-random, one request at a time)",
                       ["tests/triton_engine_check.py", device, "prefill-graphs"])):
        rc, out, secs = run([sys.executable, *cmd], timeout=300, extra=extra)
        if rc != 0:
            print("\n".join(out.strip().splitlines()[-60:]), flush=True)
        worst: dict[str, float] = {}  # per dtype, over the four kinds of call
        for row in (json.loads(ln) for ln in out.splitlines() if ln.startswith("{")):
            worst[row["dtype"]] = max(worst.get(row["dtype"], 0.0), row["max_abs_diff"])
        detail = ("worst |diff| " + ", ".join(f"{d} {w:.2g}" for d, w in worst.items()) if worst
                  else (out.strip().splitlines() or [""])[-1])
        results.append((name, rc == 0, f"{detail} ({secs:.0f} s)"))
        print(f"  {'PASS' if rc == 0 else 'FAIL'}  {name}: {detail}", flush=True)


def run(cmd: list[str], timeout: int, extra: dict | None = None) -> tuple[int, str, float]:
    """``cmd`` in the repository, with the repository first on ``PYTHONPATH`` and whatever was
    on it kept after (packages carried to an offline GPU box often come in that way).  ``extra``:
    more environment (its ``PYTHONPATH`` goes after the repository's)."""
    t0 = time.perf_counter()
    extra = dict(extra or {})
    path = os.pathsep.join(filter(None, (str(ROOT), extra.pop("PYTHONPATH", None), os.environ.get("PYTHONPATH"))))
    try:
        p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, **extra, "PYTHONPATH": path})
        return p.returncode, p.stdout + p.stderr, time.perf_counter() - t0
    except subprocess.TimeoutExpired as exc:
        return 124, f"timed out after {timeout} s\n{exc.stdout or ''}", time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keep", help="build the model in this directory and keep it")
    ap.add_argument("--skip-bench", action="store_true", help="correctness and tests only")
    ap.add_argument("--report", help="also write the bench's JSON report and the summary (JSON) into this directory")
    ap.add_argument("--dry-run-cpu", action="store_true",
                    help="run every step on the CPU instead: checks this script and its imports before a GPU "
                         "session spends its minutes on them; it checks nothing about CUDA")
    ap.add_argument("--skip-scan", action="store_true", help="no TTFT scan")
    ap.add_argument("--skip-triton", action="store_true",
                    help="no triton-backend checks (tests/test_paged_triton.py runs the same two in make test)")
    ap.add_argument("--layers", type=int, default=None,
                    help="decoder layers of the random model (SmolLM2's 30; tests/test_gpu_check.py uses 2)")
    ap.add_argument("--cuda-tests", choices=("run", "collect"), default="run",
                    help="collect: only collect the -k cuda tests (they run in make test anyway; the test of "
                         "this script checks that the step works, not the tests twice)")
    ap.add_argument("--requests", type=int, default=None, help="bench workload: requests (16; dry run 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="bench workload: tokens per request (64; dry run 8)")
    args = ap.parse_args(argv)
    small = args.dry_run_cpu
    requests = (4 if small else 16) if args.requests is None else args.requests
    max_tokens = (8 if small else 64) if args.max_tokens is None else args.max_tokens
    for flag, value in (("--requests", requests), ("--max-tokens", max_tokens)):
        if value < 1:
            ap.error(f"{flag} must be at least 1, got {value}")
    import torch

    sys.path.insert(0, str(ROOT))
    from minikv.bench.speed import format_engine

    device = "cpu" if args.dry_run_cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to check (exit status 2: a GPU check that ran nothing has not passed)")
        return 2
    start = time.perf_counter()
    where = "the CPU (DRY RUN: not a GPU check)" if device == "cpu" else torch.cuda.get_device_name(0)
    print(f"gpu-check on {where}, torch {torch.__version__}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.layers is not None and args.layers < 1:
            ap.error(f"--layers must be at least 1, got {args.layers}")
        path = build_random_smollm2(Path(args.keep or tmp) / "random-smollm2-shape", args.layers)
        results = check_correctness(path, device)
        if not args.skip_triton:
            triton_step(results, device)
        collect = ["--collect-only"] if args.cuda_tests == "collect" else []
        rc, out, secs = run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *collect, "-k", "cuda",
                             "tests/test_attention_fused.py", "tests/test_attention_pad_block.py",
                             "tests/test_sampling_batched.py", "tests/test_cuda_graphs.py",
                             "tests/test_prefill_graphs.py", "tests/test_backend_equality.py"], timeout=240)
        tail = out.strip().splitlines()[-1] if out.strip() else ""
        if rc != 0:  # the failures themselves, not just the count: the session may not get a second run
            print("\n".join(out.strip().splitlines()[-120:]), flush=True)
        what = "collected, not run: " if collect else ""
        results.append(("pytest -k cuda (attention, pad block, sampling, graphs, backend equality)", rc == 0, f"{what}{tail} ({secs:.0f} s)"))
        bench = {}
        if not args.skip_bench:
            report = Path(tmp) / "bench.json"
            rc, out, secs = run([sys.executable, "-m", "minikv.bench", "--device", device, "--model", str(path),
                                 "--dtypes", "bfloat16,float32", "--only", "throughput,ttft,prefill,ops",
                                 "--requests", str(requests), "--max-tokens", str(max_tokens),
                                 *(["--kv-cache-gb", "0.25"] if small else []),
                                 "--json", str(report)], timeout=600 if small else 240)
            print(out, flush=True)
            results.append((f"python -m minikv.bench --device {device} (bf16, fp32)", rc == 0, f"exit {rc} ({secs:.0f} s)"))
            bench = json.loads(report.read_text()) if rc == 0 else {}
            if args.report and rc == 0:
                Path(args.report).mkdir(parents=True, exist_ok=True)
                (Path(args.report) / "bench.json").write_text(report.read_text())
        if not args.skip_scan:
            scan_step(results, str(path), device)
    print("\n== gpu-check summary ==" + (" (DRY RUN on the CPU: the script ran, no GPU was checked)" if device == "cpu" else ""))
    for name, ok, detail in results:
        print(f"  {'PASS' if ok else 'FAIL'}  {name}: {detail}")
    for line in format_engine(bench):  # the bench's own report lines: every figure beside its ratio
        print(line)
    total = time.perf_counter() - start
    print(f"  total {total:.0f} s (budget 360 s)")
    if args.report:
        Path(args.report).mkdir(parents=True, exist_ok=True)
        (Path(args.report) / "summary.json").write_text(json.dumps(
            {"device": where, "torch": torch.__version__, "seconds": round(total, 1),
             "checks": [{"name": n, "ok": ok, "detail": d} for n, ok, d in results]}, indent=1))
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
