"""The fast paths, one step away from the engine: each one a ``model_runner.Backend``.

The engine (``minikv/engine/``) holds one backend and calls its ``forward``; it never imports
this package.  ``minikv.LLM`` (the composition root) hands it :func:`make_backend`, which picks
the backend that ``attention_backend`` names (``registry.py``), and on the CPU the pool memory
and allocator settings of ``host_memory.py``.  What is where:

* ``fused.py`` -- the fused backends' ``forward``: a plan per step (``fused_plan.py``, and
  ``fused_hit.py`` for prefix hits), lean layers (``attention_fused.py``), packed matmuls
  (``matmuls.py``), CUDA graphs (``cuda_graphs.py``, ``prefill_graphs.py``);
* ``cpu_kernels.py`` -- minikv's C++ CPU kernels (``kernels/*.cpp``, built by ``kernel_build.py``);
* ``paged_triton.py`` -- the Triton paged-attention kernel (``paged_triton_kernel.py``).
"""
from __future__ import annotations

from .registry import BACKENDS, FUSED, resolve_backend

__all__ = ["BACKENDS", "FUSED", "make_backend", "resolve_backend"]


def make_backend(engine):
    """The backend ``engine.config.attention_backend`` names on ``engine``'s device, model and
    dtype (``registry.resolve_backend`` refuses one that cannot run there).  Called by the engine
    before it allocates its pool; the backend's ``bind`` runs once the pool exists."""
    from ..engine.kv_pool import DEVICE_MEMORY
    from ..engine.model_runner import ReferenceBackend
    from .fused import FusedBackend
    from .host_memory import HOST_MEMORY, keep_freed_memory

    name = resolve_backend(engine.config.attention_backend, engine.device.type, engine.model.shape.head_dim,
                           str(engine.dtype).removeprefix("torch."))
    memory = DEVICE_MEMORY
    if engine.device.type == "cpu":  # big per-layer temporaries: reuse freed pages; the pool on pages of its own
        keep_freed_memory()
        memory = HOST_MEMORY
    return ReferenceBackend(memory) if name == "reference" else FusedBackend(name, memory)
