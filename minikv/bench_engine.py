"""Engine speed figures for ``python -m minikv.bench``: every ratio printed beside its two absolutes.

Issue 2 reported minikv at **4.46x** transformers' padded ``generate``; on the same workload later
runs gave 1.3x (quiet) and 0.85x (busy).  The 4.46 cannot be reproduced or audited: the benchmark
of the time (``git show 79fb75b:minikv/bench.py``) printed only the ratio, from *one* timed run of
each side, minikv first and transformers second, on a 2-core machine shared with other jobs.
Its code computes the same ratio as today's (same prompts, same token counts: 16 x 64 on each
side), so the gap lies in what was not recorded: the load during each half (a busy machine moved
the ratio from 1.32 to 0.85, issue 11) and the torch/transformers versions (not pinned before
``constraints.txt``; transformers' padded path has changed since).  So now every side is timed
``repeats`` times, *interleaved* (minikv, reference, transformers, minikv, ...), the median is
kept, and the report prints the tokens/s of each side and the load average before and after.

Figures here (all measured in the run that prints them):

* throughput: generated tokens/s of minikv (``auto`` backend), of the ``reference`` backend and
  of transformers' padded ``generate`` (sdpa), per dtype, and their ratios;
* prefill FLOP/s: the useful FLOPs of prefilling the throughput prompts (matmuls + causal
  attention, no padding counted) over its time, against the FLOP/s ``torch.matmul`` reaches here
  on the model's own matmul shapes (the "peak" is measured, not looked up);
* aten ops dispatched per decode step at batch 16, per backend (``torch.profiler``); on CUDA
  also the kernels launched.
"""
from __future__ import annotations

import os
import random
import statistics
import time

import torch

from .engine import SamplingParams
from .engine.matmuls import amx_available

BATCH_FOR_OPS = 16


def random_prompts(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    edge = min(1000, vocab // 4)  # avoid special and rare ids at both ends of the vocabulary
    return [[rng.randrange(edge, vocab - edge) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def machine_info(device) -> dict:
    """What a figure was measured on: the CPU's model name and whether it has AMX (Intel's matrix
    units: bf16 matmuls run several times faster with them, so bf16 figures are not comparable
    between machines with and without), the ISA torch dispatches to, cores, torch's version, and
    the GPU's name on CUDA.  The same benchmark gave 230 bf16 tokens/s on one 2-core machine of
    this project (Intel, AMX) and 113 on another (AMD EPYC, AVX-512 without AMX)."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and model == "unknown":
                    model = value.strip()
    except OSError:  # not Linux: the model name is all platform knows
        import platform
        model = platform.processor() or model
    # AMX by the test that chooses the bf16 kernels (matmuls.amx_available, PyTorch's own), so the
    # "AMX yes" printed is what the engine acted on, not a second reading of /proc/cpuinfo's flags
    info = {"cpu": model, "amx": amx_available(), "cores": os.cpu_count(), "torch": torch.__version__,
            "isa": torch.backends.cpu.get_cpu_capability()}
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def format_machine(info: dict) -> str:
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ""
    return (f"  machine: {info['cpu']} ({info['cores']} cores, {info['isa']}, AMX {'yes' if info['amx'] else 'no'}), "
            f"torch {info['torch']}{gpu}")


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device) -> tuple[int, float]:
    _sync(device)
    t0 = time.perf_counter()
    tokens = fn()
    _sync(device)
    return tokens, time.perf_counter() - t0


def throughput(llm, model_path, n=16, max_tokens=64, seed=0, repeats=2) -> dict:
    """minikv vs transformers on 16 seeded prompts of 32-512 tokens, ``max_tokens`` each
    (``ignore_eos``), in ``llm``'s dtype: tokens/s of each side (median of ``repeats`` interleaved
    runs) and the ratios."""
    from transformers import AutoModelForCausalLM

    eng = llm.engine
    prompts = random_prompts(eng.model.shape.vocab_size, n, 32, 512, seed)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ref = llm.fork(attention_backend="reference")
    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=eng.dtype, attn_implementation="sdpa").to(eng.device).eval()
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=eng.device)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=eng.device)

    def run_hf():
        with torch.no_grad():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                              min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
        return (out.shape[1] - width) * n

    def run(engine_llm):
        return lambda: sum(len(o.outputs[0].token_ids) for o in engine_llm.generate(prompts, params))

    engines = {"minikv": llm}
    if eng.attention_backend == "paged":  # what the C++ kernels buy, side by side in the same run
        engines["fused"] = llm.fork(attention_backend="fused")
    engines["reference"] = ref
    sides = {**{name: run(e) for name, e in engines.items()}, "transformers": run_hf}
    warm = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for side in engines.values():
        side.generate(prompts[:2], warm)
    with torch.no_grad():
        hf.generate(input_ids=ids[:2, -64:], attention_mask=mask[:2, -64:], max_new_tokens=4, do_sample=False, pad_token_id=0)
    load_before = os.getloadavg()[0]
    rates: dict[str, list[float]] = {k: [] for k in sides}
    for _ in range(repeats):
        for name, fn in sides.items():
            tokens, seconds = _timed(fn, eng.device)
            rates[name].append(tokens / seconds)
    tps = {k: statistics.median(v) for k, v in rates.items()}
    del hf
    return {"minikv_tokens_per_s": tps["minikv"], "reference_tokens_per_s": tps["reference"],
            "transformers_tokens_per_s": tps["transformers"],
            "throughput_ratio": tps["minikv"] / tps["transformers"],
            "reference_ratio": tps["reference"] / tps["transformers"],
            **({"fused_tokens_per_s": tps["fused"], "fused_ratio": tps["fused"] / tps["transformers"]} if "fused" in tps else {}),
            "backend": eng.attention_backend, "repeats": repeats, "requests": n, "tokens_per_request": max_tokens,
            "prompt_tokens": sum(map(len, prompts)), "padded_prompt_tokens": width * n,
            "load_before": load_before, "load_after": os.getloadavg()[0], "threads": torch.get_num_threads()}


def _linear_shapes(model) -> list[tuple[int, int]]:
    """(in, out) of each matmul one layer runs on every token: qkv, o_proj, gate_up, down."""
    layer = model.layers[0]
    return [tuple(reversed(getattr(layer, w).shape)) for w in ("qkv", "o_proj", "gate_up", "down")]


def matmul_peak(model, tokens: int, repeats=3) -> float:
    """FLOP/s of ``torch.matmul`` on this machine for ``[tokens, in] @ [in, out]`` over the model's
    own layer shapes, in its dtype and on its device (best of ``repeats``)."""
    dev, dt = model.device, model.dtype
    pairs = [(torch.randn(tokens, i, device=dev, dtype=dt), torch.randn(i, o, device=dev, dtype=dt))
             for i, o in _linear_shapes(model)]
    flops = sum(2 * tokens * b.shape[0] * b.shape[1] for _, b in pairs)
    for a, b in pairs:  # warm-up
        torch.matmul(a, b)
    best = float("inf")
    for _ in range(repeats):
        _sync(dev)
        t0 = time.perf_counter()
        for a, b in pairs:
            torch.matmul(a, b)
        _sync(dev)
        best = min(best, time.perf_counter() - t0)
    return flops / best


def weight_pass_s(model, repeats=3) -> float:
    """Seconds for one token row through every weight matrix of ``model`` in order (each layer's
    four matmuls, then the LM head): the floor of any forward pass, prefix hit included, since a
    hit still reads every weight once.  On a CPU that is memory bandwidth (SmolLM2 in fp32 is
    about 540 MB of weights), so the best prefix-hit TTFT is this pass, not zero."""
    import torch.nn.functional as F

    weights = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o_proj", "gate_up", "down")]
    weights.append(model.lm_head)
    rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=model.dtype, device=model.device) for w in weights}
    best = float("inf")
    for _ in range(repeats):
        _sync(model.device)
        t0 = time.perf_counter()
        for w in weights:
            F.linear(rows[w.shape[1]], w)
        _sync(model.device)
        best = min(best, time.perf_counter() - t0)
    return best


def prefill_flops(model, lengths: list[int]) -> float:
    """Useful FLOPs of prefilling sequences of ``lengths`` tokens: every layer's matmuls on every
    token, causal attention (QK^T and PV over the keys at or before each query), the LM head on
    each sequence's last token.  Padding is never counted."""
    s = model.shape
    per_token = 2 * sum(i * o for i, o in _linear_shapes(model)) * s.num_layers
    attn = sum(4 * s.num_heads * s.head_dim * n * (n + 1) // 2 for n in lengths) * s.num_layers
    head = 2 * s.hidden_size * s.vocab_size * len(lengths)
    return per_token * sum(lengths) + attn + head


def prefill_efficiency(llm, n=16, seed=0, rounds=3) -> dict:
    """Prefill FLOP/s on the throughput prompts (prefix cache off, one output token each) over
    the matmul peak measured here for the same shapes and dtype.

    The two sides alternate: each of ``rounds`` rounds times one prefill of the prompts, then
    measures the peak (best of 3 passes, :func:`matmul_peak`), so that both halves of a round's
    ratio see the same minute of a shared machine.  Measured one after the other, the same code
    read 106.6 / 143.5 and then 144.3 / 182.0 GFLOP/s on one 2-core machine a minute apart: the
    peak itself moved 27%.  The figures returned are those of the median round (by its ratio),
    with every round's beside them."""
    eng = llm.engine
    prompts = random_prompts(eng.model.shape.vocab_size, n, 32, 512, seed)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    fresh = llm.fork(enable_prefix_caching=False)
    fresh.generate(prompts[:2], one)
    flops = prefill_flops(eng.model, list(map(len, prompts)))
    step_tokens = min(sum(map(len, prompts)), eng.config.max_num_batched_tokens)
    per_round = []
    for _ in range(rounds):
        seconds = _timed(lambda: fresh.generate(prompts, one), eng.device)[1]
        peak = matmul_peak(eng.model, step_tokens)
        per_round.append({"prefill_flops_per_s": flops / seconds, "matmul_peak_flops_per_s": peak,
                          "prefill_over_peak": flops / seconds / peak, "prefill_s": seconds})
    median = sorted(per_round, key=lambda r: r["prefill_over_peak"])[(rounds - 1) // 2]
    return {**median, "rounds": per_round, "prefill_tokens": sum(map(len, prompts))}


def _is_op(name: str) -> bool:
    """A dispatched operator: ATen's, oneDNN's packed matmuls (``matmuls.PackedMatmuls``) or minikv's C++ ops (``paged_cpu.py``: attention, norms, the few-row matmul)."""
    return name.startswith(("aten::", "mkldnn::", "minikv::"))


def count_decode_ops(engine, batch=BATCH_FOR_OPS, seed=0) -> dict[str, int]:
    """Operators (ATen's and oneDNN's) dispatched from Python (top level: ops an op calls inside
    are not counted) in one decode-only step of ``batch`` sequences of ``engine``, by op name; on
    CUDA ``"cuda kernels"`` counts the kernels launched too.  Leaves the engine idle."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(seed)
    vocab = engine.model.shape.vocab_size
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"ops-{seed}-{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))], p)
    while engine.scheduler.waiting or any(s.num_computed_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        engine.step()
        _sync(engine.device)
    counts: dict[str, int] = {}
    for e in prof.events():
        parent = e.cpu_parent
        if _is_op(e.name) and (parent is None or not _is_op(parent.name)):
            counts[e.name] = counts.get(e.name, 0) + 1
        if engine.device.type == "cuda" and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            counts["cuda kernels"] = counts.get("cuda kernels", 0) + 1
    while engine.has_unfinished_requests():
        engine.step()
    return counts


def decode_ops(llm) -> dict:
    """Ops per decode step at batch 16 for each backend run eagerly (and CUDA kernels on a GPU);
    on CUDA also the fused backend replaying its CUDA graph (``cuda_graphs.py``): what the host
    dispatches then, and the kernels the replay runs."""
    runs = {"reference": dict(attention_backend="reference", enforce_eager=True),
            "fused": dict(attention_backend="fused", enforce_eager=True)}
    if llm.engine.attention_backend == "paged":  # the C++ kernel is built here: count it too
        runs["paged"] = dict(attention_backend="paged", enforce_eager=True)
    if llm.engine.device.type == "cuda":
        runs["graphs"] = dict(attention_backend="fused", enforce_eager=False)
    out = {}
    for name, overrides in runs.items():
        counts = count_decode_ops(llm.fork(**overrides).engine)
        out[name] = {"ops": sum(v for k, v in counts.items() if _is_op(k)),
                     "casts": counts.get("aten::to", 0) + counts.get("aten::_to_copy", 0),
                     "cuda_kernels": counts.get("cuda kernels")}
    out["batch"] = BATCH_FOR_OPS
    out["default"] = "graphs" if "graphs" in out else llm.engine.attention_backend  # what auto runs
    return out


def format_engine(report: dict) -> list[str]:
    """The report lines of the sections above (absolute figures beside every ratio)."""
    lines = []
    for dtype, t in report.get("throughput_by_dtype", {}).items():
        lines.append(f"  throughput {dtype:<9} minikv[{t['backend']}] {t['minikv_tokens_per_s']:8.1f} tok/s   "
                     + (f"fused {t['fused_tokens_per_s']:8.1f} tok/s   " if "fused_tokens_per_s" in t else "")
                     + f"reference {t['reference_tokens_per_s']:8.1f} tok/s   transformers {t['transformers_tokens_per_s']:8.1f} tok/s"
                     f"   ratio {t['throughput_ratio']:.2f} (reference {t['reference_ratio']:.2f})   target >= 1.5"
                     f"   [load {t['load_before']:.1f} -> {t['load_after']:.1f}, median of {t['repeats']}]")
    if "ttft" in report:
        t = report["ttft"]
        lines.append(f"  ttft prefix hit {t['hit_ms']:8.1f} ms   miss {t['miss_ms']:8.1f} ms   "
                     f"hit/miss {t['ttft_hit_over_miss']:.3f}   target <= 0.05 (fp32)")
        if "weight_pass_ms" in t:
            lines.append(f"  ttft floor: one row through every weight {t['weight_pass_ms']:8.1f} ms = "
                         f"{t['weight_pass_ms'] / t['miss_ms']:.3f} of the miss (a hit reads every weight once)")
    for dtype, p in report.get("prefill_by_dtype", {}).items():
        rounds = "  ".join(f"{r['prefill_flops_per_s'] / 1e9:.1f}/{r['matmul_peak_flops_per_s'] / 1e9:.1f}"
                           for r in p.get("rounds", []))
        lines.append(f"  prefill {dtype:<9} {p['prefill_flops_per_s'] / 1e9:8.1f} GFLOP/s   matmul peak "
                     f"{p['matmul_peak_flops_per_s'] / 1e9:8.1f} GFLOP/s   prefill/peak {p['prefill_over_peak']:.2f}   "
                     f"target >= {0.8 if dtype == 'float32' else 0.6}"
                     + (f"   [median of {len(p['rounds'])} alternating rounds: {rounds} GFLOP/s]" if rounds else ""))
    if "ops" in report:
        o = report["ops"]
        for backend in [b for b in ("reference", "fused", "paged", "graphs") if b in o]:
            kernels = o[backend]["cuda_kernels"]
            lines.append(f"  ops (ATen + oneDNN + minikv) per decode step (batch {o['batch']}) {backend:<9} {o[backend]['ops']:6d}"
                         f"   casts {o[backend]['casts']:4d}" + (f"   CUDA kernels {kernels}" if kernels else "")
                         + ("   target <= 500 (SmolLM2)" if backend == o.get("default", "fused") else ""))
    return lines
