"""The TTFT scan: is a prefix hit faster than a miss, at which prompt lengths, and how sure?

``make gpu-check`` (``scripts/gpu_check.py``) runs it on the random SmolLM2-shaped model, with
``cache_isolation="shared"`` and prefix caching, in bf16 and fp32.  For each length ``L``, after a
warm-up, ``pairs`` alternating requests: a **hit** is the cached ``L``-token prefix plus a fresh
16-token tail, a **miss** a fresh ``L``-token prefix plus a fresh tail.  Each side's TTFT is the
engine's own (``RequestOutput.metrics.ttft_s``, as ``python -m minikv.bench`` reads it), and
:func:`hit_miss_stats` turns the two samples into medians, their ratio and the one-sided
Mann-Whitney p of "hits are faster" (rank-based like the audit's KS test in
``minikv.audit.stats``, whose AUC it reports too: 1.0 when every hit beats every miss).

Targets (set for an H200): hit/miss <= 0.8 at 256 tokens and <= 0.5 at 1,024, p < 1e-3 at
every length, and a 1,024-token miss within 3x of its FLOP floor measured in the same run (the
prefill's FLOPs, ``minikv.bench.prefill.prefill_flops``, at the best matmul pass of the model's shapes).
With 12 pairs, scipy's p (normal approximation past 8 per side) is 1.8e-5 when every hit beats
every miss, so p < 1e-3 asks for a clear separation, not a perfect one.
"""
from __future__ import annotations

import statistics
import warnings

from scipy import stats as _st

from ..audit.stats import _as_samples, roc_auc
from .base import completed, random_prompts
from .prefill import matmul_passes, prefill_flops

LENGTHS = (256, 1024, 4096, 7000)
PAIRS = 12
TAIL = 16
RATIO_TARGETS = {256: 0.8, 1024: 0.5}  # hit/miss at most this, where a length has one
P_TARGET = 1e-3
FLOOR_LENGTH, FLOOR_TARGET = 1024, 3.0  # a miss of this many tokens within 3x of its FLOP floor


def hit_miss_stats(hits, misses) -> dict:
    """Medians (ms), hit/miss, the one-sided Mann-Whitney p of "hit times are smaller" and the
    AUC, from two samples of seconds."""
    h, m = _as_samples(hits, "hit"), _as_samples(misses, "miss")
    p = float(_st.mannwhitneyu(h, m, alternative="less").pvalue)
    hit_ms, miss_ms = 1000 * statistics.median(h), 1000 * statistics.median(m)
    return {"hit_ms": hit_ms, "miss_ms": miss_ms, "ratio": hit_ms / miss_ms, "p": p,
            "auc": roc_auc(h, m), "n": (len(h), len(m))}


def verdict(length: int, row: dict) -> tuple[bool, str]:
    """Whether a row meets the targets for its length, and the targets it was held to."""
    want = [f"p < {P_TARGET:g}"]
    ok = row["p"] < P_TARGET
    if length in RATIO_TARGETS:
        want.append(f"hit/miss <= {RATIO_TARGETS[length]}")
        ok = ok and row["ratio"] <= RATIO_TARGETS[length]
    return ok, ", ".join(want)


def scan_length(llm, length: int, pairs: int, seed: int) -> dict:
    """One length's alternating pairs on ``llm`` (prefix caching on, the cache shared)."""
    from minikv import SamplingParams

    vocab = llm.engine.model.shape.vocab_size
    p1 = SamplingParams(max_tokens=1, temperature=0.0)
    prefix = random_prompts(vocab, 1, length, length, seed)[0]
    tails = random_prompts(vocab, 2 * pairs + 3, TAIL, TAIL, seed + 1)
    fresh = random_prompts(vocab, pairs + 1, length, length, seed + 2)  # never cached before their miss
    completed(llm.generate([prefix + tails[-1]], p1))  # caches the prefix
    completed(llm.generate([prefix + tails[-2]], p1))  # warm-up: one hit, one miss
    completed(llm.generate([fresh[-1] + tails[-3]], p1))
    hits, misses, least = [], [], length - llm.engine.block_size
    for i in range(pairs):
        hit = completed(llm.generate([prefix + tails[2 * i]], p1))[0]
        miss = completed(llm.generate([fresh[i] + tails[2 * i + 1]], p1))[0]
        if hit.num_cached_tokens < least or miss.num_cached_tokens != 0:
            raise RuntimeError(f"L={length}: a hit cached {hit.num_cached_tokens} tokens, a miss {miss.num_cached_tokens}")
        hits.append(hit.metrics.ttft_s)
        misses.append(miss.metrics.ttft_s)
    return {"length": length, **hit_miss_stats(hits, misses)}


def flop_floor_ms(model, length: int) -> float:
    """Milliseconds a prefill of ``length`` tokens would take at the best of three matmul passes
    over the model's own shapes (``minikv.bench.prefill.matmul_passes``): its FLOP floor on this device."""
    return 1000 * prefill_flops(model, [length]) / max(matmul_passes(model, length))


def forward_floors(config: dict, context: int, computed: int, bytes_per_param: int) -> dict:
    """The work one prefill step cannot avoid: ``computed`` new tokens after ``context`` cached ones
    (a miss has ``context=0``), for a Llama-style ``config`` (a checkpoint's config.json, as a dict).

    FLOPs: 2 per weight per new token in every layer's matmuls (q/k/v, o, gate/up, down); the LM head
    on the last token only (one row of logits); attention, ``QK^T`` and ``PV``, 4 per head dimension
    per query head per key, where new token ``j`` (1-based) sees ``context + j`` keys.  Bytes: every
    weight read once (an untied embedding's rows aside: a lookup reads only ``computed`` of them), and
    the K/V of every position once (the cached read, the new written).  Norms and RoPE are left out
    of the FLOPs (a few per element, next to the thousands per token of the matmuls)."""
    h, inter, layers = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv_heads, vocab = config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]
    d = config.get("head_dim") or h // heads
    tied = config.get("tie_word_embeddings", False)
    per_layer = h * (heads + 2 * kv_heads) * d + heads * d * h + 3 * h * inter  # qkv, o, gate+up, down
    norms = (2 * layers + 1) * h
    params = layers * per_layer + norms + vocab * h * (1 if tied else 2)
    keys = computed * context + computed * (computed + 1) // 2  # sum over the new tokens of the keys each sees
    flops = {"matmul": 2 * layers * per_layer * computed, "head": 2 * h * vocab,
             "attention": 4 * heads * d * layers * keys}
    read = {"weights": bytes_per_param * (layers * per_layer + norms + vocab * h),
            "kv": bytes_per_param * 2 * kv_heads * d * layers * (context + computed)}
    return {"params": params, "flops": sum(flops.values()), "flops_by_part": flops,
            "bytes": sum(read.values()), "bytes_by_part": read}


def floor_s(floors: dict, flop_per_s: float, byte_per_s: float) -> float:
    """Seconds ``floors`` (from :func:`forward_floors`) take at best on a device with those rates:
    the larger of its arithmetic at ``flop_per_s`` and its memory traffic at ``byte_per_s``."""
    return max(floors["flops"] / flop_per_s, floors["bytes"] / byte_per_s)


def run_scan(path: str, device: str, dtypes=("bfloat16", "float32"), lengths=LENGTHS, pairs=PAIRS,
             kv_cache_gb: float = 2.0, floor_length: int = FLOOR_LENGTH, attention_backend: str = "auto") -> dict:
    """Every dtype and length: ``{dtype: {"rows": [...], "floor": {...}}}``, on ``attention_backend``."""
    from minikv import LLM
    from minikv.engine import UnsafeSettingWarning

    out = {}
    for dtype in dtypes:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnsafeSettingWarning)  # "shared" is the point here
            llm = LLM(path, device=device, dtype=dtype, enable_prefix_caching=True, cache_isolation="shared",
                      attention_backend=attention_backend,
                      kv_cache_memory_gb=kv_cache_gb, max_num_batched_tokens=max(8192, max(lengths) + TAIL))
        rows = [scan_length(llm, n, pairs, seed=17 * i) for i, n in enumerate(lengths)]
        floor = None
        miss = next((r for r in rows if r["length"] == floor_length), None)
        if miss is not None:
            f = flop_floor_ms(llm.engine.model, floor_length + TAIL)
            floor = {"length": floor_length, "miss_ms": miss["miss_ms"], "floor_ms": f, "ratio": miss["miss_ms"] / f}
        g = getattr(llm.engine.backend, "prefill_graphs", None)  # on CUDA (fused, triton) every request above was a replay
        graphs = None if g is None else {"captures": g.captures, "replays": g.replays,
                                         "requests": len(lengths) * (2 * pairs + 3)}
        out[dtype] = {"rows": rows, "floor": floor, "prefill_graphs": graphs}
        del llm
    return out


def format_scan(scan: dict) -> list[str]:
    """The scan as a table (one row per length, both dtypes) and the floor lines; each
    dtype's cell ends in PASS or FAIL against that length's targets."""
    dtypes = list(scan)
    head = "| L | " + " | ".join(f"{_short(d)} hit / miss (ms) | {_short(d)} hit/miss | {_short(d)} p | {_short(d)} target"
                                   for d in dtypes) + " |"
    lines = [head, "|" + "---|" * (1 + 4 * len(dtypes))]
    for i, row0 in enumerate(scan[dtypes[0]]["rows"]):
        cells = [f"{row0['length']:,}"]
        for d in dtypes:
            r = scan[d]["rows"][i]
            ok, want = verdict(r["length"], r)
            cells += [f"{r['hit_ms']:.2f} / {r['miss_ms']:.2f}", f"{r['ratio']:.2f}", f"{r['p']:.2g}",
                      f"{'PASS' if ok else 'FAIL'} ({want})"]
        lines.append("| " + " | ".join(cells) + " |")
    for d in dtypes:
        f = scan[d]["floor"]
        if f is not None:
            ok = f["ratio"] <= FLOOR_TARGET
            lines.append(f"{_short(d)} {f['length']:,}-token miss {f['miss_ms']:.2f} ms vs FLOP floor {f['floor_ms']:.3f} ms: "
                         f"{f['ratio']:.1f}x ({'PASS' if ok else 'FAIL'}: target <= {FLOOR_TARGET:g}x)")
    for d in dtypes:
        g = scan[d].get("prefill_graphs")
        lines.append(f"{_short(d)} prefill steps: " + ("eager (no prefill graph runner: not CUDA's fused or triton backend)" if g is None
                     else f"{g['replays']} CUDA graph replays of {g['requests']} requests, {g['captures']} captures"))
    return lines


def verdicts(scan: dict) -> list[tuple[str, bool, str]]:
    """``(name, ok, detail)`` of every row and floor line, for gpu-check's summary."""
    out = []
    for d, s in scan.items():
        for r in s["rows"]:
            ok, want = verdict(r["length"], r)
            out.append((f"ttft scan {_short(d)} L={r['length']}", ok,
                        f"hit/miss {r['ratio']:.2f}, p {r['p']:.2g} (targets: {want})"))
        if s["floor"] is not None:
            f = s["floor"]
            out.append((f"ttft scan {_short(d)} {f['length']}-token miss vs FLOP floor", bool(f["ratio"] <= FLOOR_TARGET),
                        f"{f['ratio']:.1f}x (target <= {FLOOR_TARGET:g}x)"))
        if s.get("prefill_graphs") is not None:  # every hit and miss of the scan was one replay
            g = s["prefill_graphs"]
            out.append((f"ttft scan {_short(d)}: prefill steps replayed CUDA graphs", g["replays"] == g["requests"],
                        f"{g['replays']} replays of {g['requests']} requests, {g['captures']} captures"))
    return out


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float32": "fp32"}.get(dtype, dtype)
