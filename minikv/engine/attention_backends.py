"""Which attention path runs the model: the registry of attention backends (no torch import).

minikv has two implementations of the same forward pass, chosen by
``EngineConfig.attention_backend`` (``--attention-backend``):

* ``"reference"`` -- ``attention.paged_attention``: the explicit gather.  Every layer loops over
  the prefills, gathers each decoding sequence's blocks into a padded tensor and builds its
  mask.  It is the code the course reads, and it is the only path with the test-only seams of
  ``seams.py`` (a decode mask, a KV-read observer): an engine with one installed runs it.
* ``"fused"`` -- ``attention_fused``: the same arithmetic with the per-step work hoisted out
  of the layers.  Slot indices, gather indices, masks and RoPE tables are built once per step
  (:class:`~minikv.engine.attention_fused.FusedPlan`); prefill, prefix-hit prefill and decode
  each run as one batched attention call per layer; residual adds ride on ``addmm``.  Pure
  PyTorch, no compilation, on every device.
* ``"auto"`` -- ``"fused"`` on every device (measured on the 2-core CPU, see README "Benchmark":
  fewer ops per decode step and no slower prefill).  It never compiles anything: on the CPU
  ``flex_attention`` works only through ``torch.compile`` (about 27 s for the first compile and
  about 2x slower than SDPA at 1,024 tokens, measured for issue 11), so SDPA it is.

The names live here, free of torch, so ``config`` and the CLI can list them; the implementations
are registered under the same names in ``model_runner.FORWARDS`` (a test checks the two agree).
"""
from __future__ import annotations

BACKENDS = {
    "reference": "explicit per-layer gather and masks (what the lessons read)",
    "fused": "per-step metadata, batched SDPA per layer, no per-layer casts",
}
ATTENTION_BACKENDS = (*BACKENDS, "auto")


def resolve_backend(name: str, device_type: str) -> str:
    """The concrete backend ``name`` means on a device of type ``device_type`` (``"cpu"``, ``"cuda"``)."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend={name!r} is not one of {', '.join(ATTENTION_BACKENDS)}")
    if name != "auto":
        return name
    # CPU and CUDA alike.  On CUDA, the fused backend's decode-only steps replay CUDA graphs
    # (cuda_graphs.py) unless enforce_eager; steps with a prefill run eagerly everywhere.
    return "fused"
