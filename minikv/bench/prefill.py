"""The ``prefill`` section: how close a prefill comes to the matmul peak.

A prefill is mostly matmuls, so its useful FLOP/s are judged against what ``torch.matmul``
itself reaches on this machine for the model's own layer shapes (targets: >= 80% in fp32,
>= 60% in bf16, on the CPU).  Both halves are measured here, in the same run, alternating:

* :func:`prefill_flops` counts the useful work: every layer's matmuls on every token, causal
  attention over the keys at or before each query, the LM head on each sequence's last token.
  Padding is never counted, so a padded implementation cannot look faster by wasting work.
* :func:`matmul_passes` times the peak: one pass is the four layer shapes, ``[tokens, in] @
  [in, out]`` each, on inputs that stay in cache between passes.  The peak is the best pass.
* :func:`prefill_efficiency` alternates a timed prefill and the peak's passes over 3 rounds and
  reports the median round, with every round and every pass beside it.

Why the passes are printed, not only their best: a pass takes a fraction of a second and a
prefill several seconds, so on a shared machine the best of three short passes catches the
machine's best moment while the prefill averages over its moments, and on some machines the
peak itself is bimodal from one round to the next (docs/BENCHMARKS.md, machine E); the median
pass beside the best shows how much of a ratio is the peak's luck.  The target stays on the best pass, the stricter of the two.
"""
from __future__ import annotations

import statistics

import torch

from ..engine import SamplingParams
from ..llm import LLM
from .base import completed, random_prompts, release, resident, timed


def _linear_shapes(model) -> list[tuple[int, int]]:
    """(in, out) of each matmul one layer runs on every token: qkv, o_proj, gate_up, down."""
    layer = model.layers[0]
    return [tuple(reversed(getattr(layer, w).shape)) for w in ("qkv", "o_proj", "gate_up", "down")]


def matmul_passes(model, tokens: int, repeats=3) -> list[float]:
    """FLOP/s of each of ``repeats`` passes of ``torch.matmul`` over the model's own layer shapes,
    ``[tokens, in] @ [in, out]``, in its dtype and on its device, after one warm-up pass."""
    dev, dt = model.device, model.dtype
    pairs = [(torch.randn(tokens, i, device=dev, dtype=dt), torch.randn(i, o, device=dev, dtype=dt))
             for i, o in _linear_shapes(model)]
    flops = sum(2 * tokens * b.shape[0] * b.shape[1] for _, b in pairs)

    def one_pass():
        for a, b in pairs:
            torch.matmul(a, b)

    one_pass()  # warm-up
    return [flops / timed(one_pass, dev)[1] for _ in range(repeats)]


def weight_pass_s(model, repeats=3) -> float:
    """Seconds for one token row through every weight matrix of ``model`` in order (each layer's
    four matmuls, then the LM head): the floor of any forward pass, prefix hit included, since a
    hit still reads every weight once.  On a CPU that is memory bandwidth (SmolLM2 in fp32 is
    about 540 MB of weights), so the best prefix-hit TTFT is this pass, not zero."""
    import torch.nn.functional as F

    weights = [getattr(layer, n) for layer in model.layers for n in ("qkv", "o_proj", "gate_up", "down")]
    weights.append(model.lm_head)
    rows = {w.shape[1]: torch.randn(1, w.shape[1], dtype=model.dtype, device=model.device) for w in weights}

    def one_pass():
        for w in weights:
            F.linear(rows[w.shape[1]], w)

    return min(timed(one_pass, model.device)[1] for _ in range(repeats))


def prefill_flops(model, lengths: list[int]) -> float:
    """Useful FLOPs of prefilling sequences of ``lengths`` tokens: every layer's matmuls on every
    token, causal attention (QK^T and PV over the keys at or before each query), the LM head on
    each sequence's last token.  Padding is never counted."""
    s = model.shape
    per_token = 2 * sum(i * o for i, o in _linear_shapes(model)) * s.num_layers
    attn = sum(4 * s.num_heads * s.head_dim * n * (n + 1) // 2 for n in lengths) * s.num_layers
    head = 2 * s.hidden_size * s.vocab_size * len(lengths)
    return per_token * sum(lengths) + attn + head


def prefill_efficiency(llm, n=16, seed=0, rounds=3, passes=3) -> dict:
    """Prefill FLOP/s on the throughput prompts (prefix cache off, one output token each) over
    the matmul peak measured here for the same shapes and dtype.

    The two sides alternate: each of ``rounds`` rounds times one prefill of the prompts, then
    ``passes`` passes of the peak (:func:`matmul_passes`), so that both halves of a round's ratio
    see the same minute of a shared machine: measured one after the other, a minute apart, the
    peak itself can move by a quarter (docs/BENCHMARKS.md).  The figures returned are those of the median round (by its ratio), with
    every round's beside them; each round also keeps its passes and its prefill over the median
    pass (the module docstring says why)."""
    eng = llm.engine
    prompts = random_prompts(eng.model.shape.vocab_size, n, 32, 512, seed)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    fresh = resident(llm.fork(enable_prefix_caching=False))  # its pages in before the clock starts
    fresh.generate(prompts[:2], one)
    flops = prefill_flops(eng.model, list(map(len, prompts)))
    step_tokens = min(sum(map(len, prompts)), eng.config.max_num_batched_tokens)
    per_round = []
    for _ in range(rounds):
        seconds = timed(lambda: completed(fresh.generate(prompts, one)), eng.device)[1]
        tried = matmul_passes(eng.model, step_tokens, passes)
        rate, peak = flops / seconds, max(tried)
        per_round.append({"prefill_flops_per_s": rate, "matmul_peak_flops_per_s": peak,
                          "prefill_over_peak": rate / peak, "prefill_s": seconds,
                          "matmul_passes_flops_per_s": tried, "prefill_over_median_pass": rate / statistics.median(tried)})
    median = sorted(per_round, key=lambda r: r["prefill_over_peak"])[(rounds - 1) // 2]
    return {**median, "rounds": per_round, "prefill_tokens": sum(map(len, prompts))}


def bench_prefill(model: str, device, dtypes: list[str], n=16, **engine) -> dict:
    """Prefill FLOP/s of ``n`` prompts against the matmul peak measured here, per dtype
    (:func:`prefill_efficiency`)."""
    out = {}
    for d in dtypes:
        out[d] = prefill_efficiency(LLM(model, device=device, dtype=d, **engine), n=n)
        release()
    return out


def format_prefill(by_dtype: dict, target: str = "target") -> list[str]:
    """The report's prefill lines: the median round's ratio and absolutes, then every round's
    prefill/peak GFLOP/s and the median round's passes with its prefill over the median pass."""
    lines = []
    for dtype, p in by_dtype.items():
        rounds = "  ".join(f"{r['prefill_flops_per_s'] / 1e9:.1f}/{r['matmul_peak_flops_per_s'] / 1e9:.1f}"
                           for r in p.get("rounds", []))
        lines.append(f"  prefill {dtype:<9} {p['prefill_flops_per_s'] / 1e9:8.1f} GFLOP/s   matmul peak "
                     f"{p['matmul_peak_flops_per_s'] / 1e9:8.1f} GFLOP/s   prefill/peak {p['prefill_over_peak']:.2f}   "
                     f"{target} >= {0.8 if dtype == 'float32' else 0.6}"
                     + (f"   [median of {len(p['rounds'])} alternating rounds: {rounds} GFLOP/s]" if rounds else ""))
        if "matmul_passes_flops_per_s" in p:
            passes = ", ".join(f"{v / 1e9:.1f}" for v in p["matmul_passes_flops_per_s"])
            lines.append(f"    that round's matmul passes {passes} GFLOP/s (peak = the best); "
                         f"prefill / median pass {p['prefill_over_median_pass']:.2f}")
    return lines
