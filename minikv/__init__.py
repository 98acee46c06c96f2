"""minikv: a compact, readable inference engine for learning KV-cache security.

    from minikv import LLM, SamplingParams
    llm = LLM("smollm2-135m-instruct")
    print(llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text)

The engine (and torch) is imported lazily, on first use of one of these names, so that the
torch-free parts (``minikv.security``, ``minikv.audit``, ``minikv.viz``) import quickly alone.
"""
__version__ = "0.1.0"
__all__ = ["LLM", "LLMEngine", "EngineConfig", "SamplingParams", "RequestOutput", "CompletionOutput",
           "RequestMetrics", "UnsafeSettingWarning", "__version__"]


def __getattr__(name):
    if name == "LLM":  # the front door composes engine, model hub and audit trail (minikv/llm.py)
        from .llm import LLM
        return LLM
    if name in __all__:
        from . import engine
        return getattr(engine, name)
    raise AttributeError(f"module 'minikv' has no attribute {name!r}")
