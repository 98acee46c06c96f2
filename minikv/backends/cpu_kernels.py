"""minikv's C++ kernels for the CPU (the ``cpu_kernels`` backend): build them once, load them, call them.

The fused backend in pure PyTorch reads the KV pool by *copying* every decoding sequence's
blocks into a padded tensor (one ``index_select`` per layer) and handing the copy to SDPA.  A
decode step of a small model is memory-bound, so that copy and SDPA's second read of it are a
large share of the step.  Production engines do not copy: vLLM's
PagedAttention kernels (and its CPU ``cpu_attention_with_kv_cache``) follow each sequence's
block table inside the kernel.  ``kernels/paged_attention.cpp`` is minikv's version of that for
the CPU, about two hundred lines of C++: one task per (sequence, KV head), an online softmax over
32 keys at a time, fp32 accumulation; read it, it is written to be read.  Beside it,
``kernels/pointwise.cpp`` has the two row-wise ops that PyTorch dispatches as several:
RMSNorm (five ops, four temporaries) and SwiGLU's ``silu(gate) * up`` (two), each one pass here;
``kernels/prefill_attention.cpp`` has causal attention for every fresh prefill of a step in one
call (the keys of a KV head packed once for its ``rep`` query heads, tiles of queries times blocks
of keys, faster than SDPA one sequence at a time); and ``kernels/skinny_linear.cpp`` has a matmul for the few rows of a decode step or a prefix hit
(1-48 rows, fp32, AVX-512), where the matmul libraries leave most of the CPU idle.

Every ``kernels/*.cpp`` is compiled into one library, so the ``cpu_kernels`` backend has all of them or
none.  ``kernel_build.py`` builds it, once, at set-up (``make model`` runs this module), into a
cache keyed by the sources, torch, the compiler and the CPU.  :func:`available` only *loads* a
build that already exists; it never compiles.  So the ``auto`` backend means ``paged`` where
set-up built the kernel and ``fused`` where it could not (no compiler): no request, lesson or
test ever waits on a compiler it did not ask for.

Registered with ``TORCH_LIBRARY`` as ``torch.ops.minikv.paged_decode``: a dispatcher op like
ATen's own, so the profiler counts it as one op.
"""
from __future__ import annotations

import functools
import os
import sys
import threading
import time
from pathlib import Path

from . import kernel_build

_lock = threading.Lock()
_loaded: Path | None = None


def available() -> bool:
    """Whether the kernel is loaded, loading an existing build if there is one.  Never compiles."""
    global _loaded
    if _loaded is not None:
        return True
    try:
        path = kernel_build.library_path()
    except OSError:
        return False
    if path is None or not path.exists():
        return False
    import torch

    with _lock:
        if _loaded is None:
            torch.ops.load_library(str(path))
            _loaded = path
            try:  # in use: prune() keeps it (a read-only cache is fine: it is simply not marked)
                os.utime(path)
            except OSError:
                pass
    return True


def paged_decode(q, blocks, tables, ctx, scale: float):
    """Attention of one query token per sequence over its context, read in place from the pool.

    ``q`` [S, q_heads, D] (last dim contiguous), ``blocks`` one layer of the pool
    ([num_blocks, block_size, 2, kv_heads, D], ``KVPool.kv_blocks[layer]``), ``tables`` [S, W]
    int64 block tables, ``ctx`` [S] int64 context lengths.  Returns [S, q_heads * D]."""
    import torch

    return torch.ops.minikv.paged_decode(q, blocks, tables, ctx, scale)


def prefill_attention(q, k, v, seqs, scale: float, out=None):
    """Causal attention of every fresh prefill of a step, each over its own new keys, in one call
    (``kernels/prefill_attention.cpp``).

    ``q`` [T, q_heads, D], ``k``/``v`` [T, kv_heads, D] (last dims contiguous: views of the step's
    qkv), ``seqs`` [S, 2] int64: (first row, length) of each sequence.  Writes those rows of
    ``out`` ([T, q_heads * D], made here if None; other rows untouched) and returns it."""
    import torch

    if out is None:
        out = q.new_empty(q.shape[0], q.shape[1] * q.shape[2])
    return torch.ops.minikv.prefill_attention_(out, q, k, v, seqs, scale)


def paged_prefill(qkv, blocks, seqs, tables, scale: float, q_heads: int, out):
    """Causal attention of several new tokens per sequence over its whole context, K and V read
    in place from one layer of the pool through each block table (``kernels/paged_prefill.cpp``):
    prefix hits, and decodes batched with them.

    ``qkv`` [T, >= q_heads * D] (the qkv matmul's output, roped: its first ``q_heads`` heads are
    the queries), ``blocks`` ``KVPool.kv_blocks[layer]``, ``seqs`` [S, 3] int64 (first row, new
    tokens, context length), ``tables`` [S, W] int64 (either may be flat).  The step's new K/V must be in the pool
    already.  Writes those rows of ``out`` ([T, q_heads * D], contiguous) and returns it."""
    import torch

    return torch.ops.minikv.paged_prefill_(out, qkv, blocks, seqs, tables, scale, q_heads)


def rope_store_(qkv, cos_table, sin_table, positions, kv_slots, slots):
    """RoPE on the q and k heads of ``qkv`` ([T, heads_total * D], the qkv matmul's output, in
    place), then each row's K and V stored at its pool slot (``kv_slots``: ``KVPool.kv_slots[layer]``,
    ``slots`` [T] int64): the view, RoPE, split and ``index_copy_`` of a layer in one op, with
    :func:`rope_`'s arithmetic.  ``cos_table``/``sin_table``: [positions, D]
    (``fused_plan.rope_tables``), read at each row's ``positions`` [T].  Returns ``qkv``."""
    import torch

    return torch.ops.minikv.rope_store_(qkv, cos_table, sin_table, positions, kv_slots, slots)


def rms_norm(x, weight, eps: float):
    """RMSNorm of the rows of ``x`` ([rows, n], last dim contiguous) by ``weight`` [n]: one pass,
    fp32 arithmetic, transformers' rounding order (``kernels/pointwise.cpp``)."""
    import torch

    return torch.ops.minikv.rms_norm(x, weight, eps)


def silu_mul(gate_up):
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` ([rows, 2 * n]): one pass, [rows, n]."""
    import torch

    return torch.ops.minikv.silu_mul(gate_up)


def rope_(qkv, cos, sin, heads: int):
    """Rotary embedding of the first ``heads`` heads of ``qkv`` ([T, heads_total, D], fp32 or bf16), in
    place: ``x * cos + roll(x, D/2) * sin`` with ``sin`` carrying rotate-half's sign, bit for bit
    ATen's four ops (``kernels/pointwise.cpp``); ``cos``/``sin`` are [T, 1, D]."""
    import torch

    return torch.ops.minikv.rope_(qkv, cos, sin, heads)


@functools.lru_cache(maxsize=1)
def skinny_supported() -> bool:
    """Whether the loaded library has the few-row matmul (it needs AVX-512; load it first).
    Cached: the answer is fixed when the library is compiled, and ``matmuls`` asks on every step
    (uncached, it was a dispatcher op, run twice per decode step)."""
    import torch

    return bool(torch.ops.minikv.skinny_linear_supported())


@functools.lru_cache(maxsize=1)
def skinny_bf16_supported() -> bool:
    """Whether the loaded library has the bf16 few-row matmul (AVX512-BF16's ``vdpbf16ps``)."""
    import torch

    return bool(torch.ops.minikv.skinny_linear_bf16_supported())


def skinny_pack(w):
    """``w`` ([N, K] fp32 or bf16, ``nn.Linear``'s layout) in the few-row matmul's panels of 32
    columns (bf16: k in pairs, ``kernels/skinny_linear.cpp``)."""
    import torch

    return torch.ops.minikv.skinny_pack(w)


def skinny_linear(x, packed, n: int, out=None):
    """``x @ w.T`` for ``packed = skinny_pack(w)`` with ``n = w.shape[0]``; with ``out``
    ([rows, n], contiguous) the product is *added* to ``out`` in place (a residual add inside
    the matmul) and ``out`` returned."""
    import torch

    if out is None:
        return torch.ops.minikv.skinny_linear(x, packed, n)
    return torch.ops.minikv.skinny_linear_add_(out, x, packed)


def head_dims() -> tuple[int, ...]:
    """The head dims the loaded library's decode kernel is instantiated for (load it first)."""
    import torch

    return tuple(torch.ops.minikv.paged_decode_head_dims())


def main(argv: list[str]) -> int:
    """``python -m minikv.backends.cpu_kernels [--force]``: build the kernel (set-up runs this)."""
    start = time.perf_counter()
    try:
        path = kernel_build.build(force="--force" in argv)
    except RuntimeError as e:
        print(f"[kernels] not built: {e}", file=sys.stderr)
        print("[kernels] minikv works without it: attention_backend='auto' runs 'fused'", file=sys.stderr)
        return 0 if "--strict" not in argv else 1
    available()
    names = ', '.join(p.name for p in kernel_build.SOURCES)
    print(f"[kernels] minikv CPU kernels ({names}): {path} ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
