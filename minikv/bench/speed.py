"""The ``throughput`` and ``ops`` sections: engine speed, every ratio printed beside its two absolutes.

A ratio alone cannot be audited: a figure printed from *one* timed run of each side, one after the
other on a shared machine, carries the load of each half and the library versions of the day, and
nobody can tell afterwards which of them moved it (docs/BENCHMARKS.md, "What the benchmark
measures", tells of such a figure).  So every side is timed ``repeats`` times, *interleaved*
(minikv, reference, transformers, minikv, ...), the median is kept, and the report prints the
tokens/s of each side and the load average before and after.

Figures here (all measured in the run that prints them):

* throughput: generated tokens/s of minikv (``auto`` backend), of the ``reference`` backend and
  of transformers' padded ``generate`` (sdpa), per dtype, and their ratios;
* aten ops dispatched per decode step at batch 16, per backend (``torch.profiler``); on CUDA
  also the kernels launched.  On a GPU a small model's step is launch-bound, so these counts
  explain its time better than FLOPs do.

Prefill FLOP/s against the matmul peak are :mod:`minikv.bench.prefill`'s; this module prints
them with the rest (:func:`format_engine`).
"""
from __future__ import annotations

import os
import random
import statistics

import torch

from ..engine import SamplingParams
from ..backends.cuda_graphs import REPLAY
from ..backends.matmuls import amx_available
from ..llm import LLM
from ..models.hub import resolve_model
from .base import completed, random_prompts, release, resident, sync, timed
from .prefill import format_prefill

BATCH_FOR_OPS = 16


def machine_info(device) -> dict:
    """What a figure was measured on: the CPU's model name and whether it has AMX (Intel's matrix
    units: bf16 matmuls run several times faster with them, so bf16 figures are not comparable
    between machines with and without), the ISA torch dispatches to, cores, torch's version, and
    the GPU's name on CUDA (docs/BENCHMARKS.md compares machines with and without AMX)."""
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
        return lambda: sum(len(o.outputs[0].token_ids) for o in completed(engine_llm.generate(prompts, params)))

    engines = {"minikv": llm}
    if eng.attention_backend == "cpu_kernels":  # what the C++ kernels buy, side by side in the same run
        engines["fused"] = llm.fork(attention_backend="fused")
    engines["reference"] = ref
    for e in engines.values():
        resident(e)
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
            tokens, seconds = timed(fn, eng.device)
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


def bench_throughput(model: str, device, dtypes: list[str], n=16, max_tokens=64, **engine) -> dict:
    """minikv vs transformers' padded ``generate`` in each dtype (:func:`throughput`):
    tokens/s of minikv, of its reference backend and of transformers, and the ratios."""
    path = resolve_model(model)
    out = {}
    for d in dtypes:   # one dtype's engines and transformers model are gone before the next is built
        out[d] = throughput(LLM(model, device=device, dtype=d, **engine), path, n=n, max_tokens=max_tokens)
        release()
    return out


def _is_op(name: str) -> bool:
    """A dispatched operator: ATen's, oneDNN's packed matmuls (``matmuls.PackedMatmuls``) or minikv's C++ ops (``minikv/backends/cpu_kernels.py``: attention, norms, the few-row matmul)."""
    return name.startswith(("aten::", "mkldnn::", "minikv::"))


def count_ops(fn, device) -> dict[str, int]:
    """Operators (ATen's, oneDNN's, minikv's) that ``fn()`` dispatches from Python (top level: ops
    an op calls inside are not counted), by name; on CUDA ``"cuda kernels"`` counts the kernels
    launched too.  On a GPU a small model's step is launch-bound, so these counts, not FLOPs,
    explain its time.  A graph replay (``cuda_graphs.REPLAY``) is one op, as it is one launch for
    the host; ``"replayed ops"`` counts the ops the CPU's eager stand-in runs inside it (on CUDA
    the replay runs kernels, not ops: 0), the step's work in ops where nothing was captured."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        fn()
        sync(device)
    counts: dict[str, int] = {}
    for e in prof.events():
        parent = e.cpu_parent
        if _is_op(e.name) and (parent is None or not _is_op(parent.name)):
            counts[e.name] = counts.get(e.name, 0) + 1
        elif _is_op(e.name) and parent.name == REPLAY:
            counts["replayed ops"] = counts.get("replayed ops", 0) + 1
        if device.type == "cuda" and getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA:
            counts["cuda kernels"] = counts.get("cuda kernels", 0) + 1
    return counts


def op_totals(counts: dict[str, int]) -> dict:
    """``ops`` (all operators, a graph replay as one), ``casts`` (dtype conversions),
    ``cuda_kernels`` (None on a CPU) and ``replayed`` (ops run inside replays, see :func:`count_ops`)
    of a :func:`count_ops` result."""
    return {"ops": sum(v for k, v in counts.items() if _is_op(k)),
            "casts": counts.get("aten::to", 0) + counts.get("aten::_to_copy", 0),
            "cuda_kernels": counts.get("cuda kernels"), "replayed": counts.get("replayed ops", 0)}


def count_decode_ops(engine, batch=BATCH_FOR_OPS, seed=0) -> dict[str, int]:
    """:func:`count_ops` of one decode-only step of ``batch`` sequences of ``engine``, by op name.
    Leaves the engine idle."""
    rng = random.Random(seed)
    vocab = engine.model.shape.vocab_size
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"ops-{seed}-{i}", [rng.randrange(3, vocab) for _ in range(rng.randint(20, 60))], p)
    while engine.scheduler.waiting or any(s.num_computed_tokens == 0 for s in engine.scheduler.running):
        engine.step()
    engine.step()
    counts = count_ops(engine.step, engine.device)
    while engine.has_unfinished_requests():
        engine.step()
    return counts


def decode_ops(llm) -> dict:
    """Ops per decode step at batch 16 for each backend run eagerly (and CUDA kernels on a GPU);
    on CUDA also the fused backend replaying its CUDA graph (``cuda_graphs.py``): what the host
    dispatches then, and the kernels the replay runs."""
    runs = {"reference": dict(attention_backend="reference", enforce_eager=True),
            "fused": dict(attention_backend="fused", enforce_eager=True)}
    if llm.engine.attention_backend == "cpu_kernels":  # the C++ kernels are built here: count them too
        runs["cpu_kernels"] = dict(attention_backend="cpu_kernels", enforce_eager=True)
    if llm.engine.device.type == "cuda":
        runs["graphs"] = dict(attention_backend="fused", enforce_eager=False)
    out = {name: op_totals(count_decode_ops(llm.fork(**overrides).engine)) for name, overrides in runs.items()}
    out["batch"] = BATCH_FOR_OPS
    out["default"] = "graphs" if "graphs" in out else llm.engine.attention_backend  # what auto runs
    return out


def target_label(report: dict) -> str:
    """How the report names its targets: every one of them was set for the CPU (a GPU run of a
    135M model is launch-bound, and its prefill/peak is no CPU figure), so on a GPU they are
    printed as "CPU target", beside the figures, and not as this machine's."""
    return "target" if str(report.get("device", "cpu")).startswith("cpu") else "CPU target"


def format_engine(report: dict) -> list[str]:
    """The report lines of the sections above (absolute figures beside every ratio)."""
    lines, target = [], target_label(report)
    for dtype, t in report.get("throughput_by_dtype", {}).items():
        lines.append(f"  throughput {dtype:<9} minikv[{t['backend']}] {t['minikv_tokens_per_s']:8.1f} tok/s   "
                     + (f"fused {t['fused_tokens_per_s']:8.1f} tok/s   " if "fused_tokens_per_s" in t else "")
                     + f"reference {t['reference_tokens_per_s']:8.1f} tok/s   transformers {t['transformers_tokens_per_s']:8.1f} tok/s"
                     f"   ratio {t['throughput_ratio']:.2f} (reference {t['reference_ratio']:.2f})   {target} >= 1.5"
                     f"   [load {t['load_before']:.1f} -> {t['load_after']:.1f}, median of {t['repeats']}]")
    if "ttft" in report:
        t = report["ttft"]
        lines.append(f"  ttft prefix hit {t['hit_ms']:8.1f} ms   miss {t['miss_ms']:8.1f} ms   "
                     f"hit/miss {t['ttft_hit_over_miss']:.3f}   {target} <= 0.05 (fp32)")
        if "weight_pass_ms" in t:
            lines.append(f"  ttft floor: one row through every weight {t['weight_pass_ms']:8.1f} ms = "
                         f"{t['weight_pass_ms'] / t['miss_ms']:.3f} of the miss (a hit reads every weight once)")
        if "hit_ops" in t:  # what each request dispatches: on a GPU, launches are most of its time
            kernels = t["hit_ops"]["cuda_kernels"]
            replayed = t["hit_ops"].get("replayed")  # graph replays count as one op (count_ops)
            lines.append(f"  ttft ops (ATen + oneDNN + minikv) per request: hit {t['hit_ops']['ops']}, miss {t['miss_ops']['ops']}"
                         + (f"   CUDA kernels: hit {kernels}, miss {t['miss_ops']['cuda_kernels']}" if kernels else "")
                         + (f"   (a graph replay counted as one; ops inside: hit {replayed}, miss {t['miss_ops']['replayed']})"
                            if replayed else ""))
    lines += format_prefill(report.get("prefill_by_dtype", {}), target)
    if "ops" in report:
        o = report["ops"]
        for backend in [b for b in ("reference", "fused", "cpu_kernels", "graphs") if b in o]:
            kernels = o[backend]["cuda_kernels"]
            lines.append(f"  ops (ATen + oneDNN + minikv) per decode step (batch {o['batch']}) {backend:<9} {o[backend]['ops']:6d}"
                         f"   casts {o[backend]['casts']:4d}" + (f"   CUDA kernels {kernels}" if kernels else "")
                         + (f"   {target} <= 500 (SmolLM2)" if backend == o.get("default", "fused") else ""))
    return lines
