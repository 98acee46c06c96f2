"""Which forward pass an engine runs: the registry of attention backends (no torch import).

minikv has one forward pass written three ways, chosen by ``EngineConfig.attention_backend``
(``--attention-backend``) and built by :func:`minikv.backends.make_backend`:

* ``"reference"`` -- the engine's own ``model_runner.ReferenceBackend``: the explicit gather of
  ``attention.gather_attention``.  Every layer loops over the prefills, gathers each decoding
  sequence's blocks into a padded tensor and builds its mask.  It is the code the course reads,
  and the only path with the test-only seams of ``seams.py`` (a decode mask, a KV-read observer):
  an engine with one installed runs it.
* ``"fused"`` -- ``fused.FusedBackend``: the same arithmetic with the per-step work hoisted out
  of the layers.  Slot indices, gather indices, masks and RoPE tables are built once per step
  (:class:`~minikv.backends.fused_plan.FusedPlan`); prefill, prefix-hit prefill and decode
  each run as one batched attention call per layer; residual adds ride on ``addmm``.  Pure
  PyTorch, no compilation, on every device.
* ``"cpu_kernels"`` -- ``"fused"``, except that decodes, prefix hits and fresh prefills attend
  through minikv's C++ CPU kernels (``cpu_kernels.py``), which follow each sequence's block table
  and read K and V where they lie in the pool: no gathered copy, no padding to the longest
  context, no mask; RMSNorm, RoPE, SwiGLU and the few-row matmul are C++ ops too.  CPU only; the
  kernels are compiled once at set-up (``make model``), never by a request.  Its old name,
  ``"paged"``, is refused with a message naming the new one.
* ``"triton"`` -- ``"fused"``, except that prefix hits, and the decodes that share their steps,
  attend through minikv's Triton kernel (``paged_triton.py``, ``paged_triton_kernel.py``), which
  reads K and V where they lie in the pool through each block table, as ``"cpu_kernels"`` does
  on the CPU.  CUDA only, where torch's build ships Triton; decode-only steps replay the fused
  backend's CUDA graphs (unless ``enforce_eager``: then they too go to the kernel), and a step
  prefilling one sequence alone replays a prefill graph whose hits call the kernel
  (``prefill_graphs.py``).  Fresh prefills keep SDPA.  Never picked by ``"auto"``: no GPU has
  measured it yet.
* ``"auto"`` -- ``"cpu_kernels"`` on a CPU where set-up built the kernels, ``"fused"``
  everywhere else (docs/BENCHMARKS.md has the measurements).  It never compiles anything: on
  the CPU ``flex_attention`` works only through ``torch.compile`` (a long first compile, and
  slower than SDPA at 1,024 tokens), so SDPA or the prebuilt kernels it is; a machine without a
  compiler simply runs ``"fused"``.

The names live here, free of torch, so ``config`` and the CLI can list them.
"""
from __future__ import annotations

from ..engine.config import ATTENTION_BACKENDS, RENAMED_BACKENDS as RENAMED

BACKENDS = {
    "reference": "explicit per-layer gather and masks (what the lessons read)",
    "fused": "per-step metadata, batched SDPA per layer, no per-layer casts",
    "cpu_kernels": "fused, with minikv's C++ CPU kernels: decodes and prefix hits read in place from the pool, fresh prefills in one call",
    "triton": "fused, with minikv's Triton kernel on CUDA: prefix hits and decodes read in place from the pool",
}
FUSED = ("fused", "cpu_kernels", "triton")  # the backends that run attention_fused.fused_forward


def resolve_backend(name: str, device_type: str, head_dim: int | None = None, dtype: str | None = None) -> str:
    """The concrete backend ``name`` means on a device of type ``device_type`` (``"cpu"``,
    ``"cuda"``) for a model of ``head_dim`` in ``dtype`` (``"float32"``...; ``None``: not checked)."""
    if name in RENAMED:
        raise ValueError(f"attention_backend={name!r} is now called {RENAMED[name]!r}")
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if name == "cpu_kernels":
        if device_type != "cpu":
            raise ValueError(f"attention_backend='cpu_kernels' is minikv's CPU kernels; on {device_type!r} use 'fused' or 'auto'")
        why = _kernel_unsupported(head_dim, dtype)
        if why:
            raise ValueError(f"attention_backend='cpu_kernels': {why}; use 'fused' or 'auto'")
        if not _kernel_built():
            raise RuntimeError("attention_backend='cpu_kernels' needs its kernels built once: `make model` or "
                               "`python -m minikv.backends.cpu_kernels` (a C++ compiler is required); 'fused' needs none")
        return name
    if name == "triton":
        if device_type != "cuda":
            raise ValueError(f"attention_backend='triton' is minikv's Triton kernel for CUDA; on {device_type!r} "
                             "use 'fused' or 'auto'")
        if head_dim is not None and (head_dim < 16 or head_dim & (head_dim - 1)):
            raise ValueError(f"attention_backend='triton': head_dim {head_dim} is not a power of two >= 16; "
                             "use 'fused' or 'auto'")
        if not _triton_importable():
            raise RuntimeError("attention_backend='triton' needs Triton, which torch's CUDA builds ship; "
                               "this torch has none: use 'fused' or 'auto'")
        return name
    if name != "auto":
        return name
    # On CUDA, the fused backend's decode-only steps and steps prefilling one sequence alone replay
    # CUDA graphs (cuda_graphs.py, prefill_graphs.py) unless enforce_eager; other steps run eagerly.
    if device_type == "cpu" and not _kernel_unsupported(head_dim, dtype) and _kernel_built():
        return "cpu_kernels"
    return "fused"


# What the C++ attention kernels are instantiated for (kernels/cpu_vec.h, ``HeadDims``: the decode and
# prefill kernels share the list).
KERNEL_HEAD_DIMS = (16, 32, 64, 128, 256)
KERNEL_DTYPES = ("float32", "bfloat16")


def _kernel_unsupported(head_dim, dtype) -> str | None:
    if head_dim is not None and head_dim not in KERNEL_HEAD_DIMS:
        return f"head_dim {head_dim} is not one of {KERNEL_HEAD_DIMS}"
    if dtype is not None and dtype not in KERNEL_DTYPES:
        return f"dtype {dtype!r} is not one of {KERNEL_DTYPES}"
    return None


def _triton_importable() -> bool:
    import importlib.util  # finds the package without importing it

    return importlib.util.find_spec("triton") is not None


def _kernel_built() -> bool:
    from .cpu_kernels import available  # imports torch: only when an engine is being built

    return available()
