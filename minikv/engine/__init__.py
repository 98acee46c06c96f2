"""The engine core: paged KV pool, block manager, continuous-batching scheduler, model.

Names are imported lazily so that torch-free modules here (``block_manager``, ``snapshot``,
``sequence``) can be used without loading torch.  The front door ``LLM`` is not here: it composes
the engine with the model hub and the audit trail, which the engine never imports (``minikv.llm``).
"""
from .._lazy import lazy_exports

_EXPORTS = {
    "EngineConfig": "config", "UnsafeSettingWarning": "config", "LLMEngine": "engine",
    "CompletionOutput": "outputs", "RequestMetrics": "outputs", "RequestOutput": "outputs",
    "SamplingParams": "sampling",
}
__all__ = list(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
