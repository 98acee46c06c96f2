"""The engine core: paged KV pool, block manager, continuous-batching scheduler, model.

Names are imported lazily so that torch-free modules here (``block_manager``, ``snapshot``,
``sequence``) can be used without loading torch.
"""
_EXPORTS = {
    "EngineConfig": "config", "UnsafeSettingWarning": "config", "LLMEngine": "engine", "LLM": "llm",
    "CompletionOutput": "outputs", "RequestMetrics": "outputs", "RequestOutput": "outputs",
    "SamplingParams": "sampling",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib
        return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module 'minikv.engine' has no attribute {name!r}")
