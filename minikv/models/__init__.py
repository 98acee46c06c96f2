"""Where minikv's models come from: see :mod:`minikv.models.hub`.

The names below are loaded lazily (PEP 562 ``__getattr__``): importing
``minikv.models`` stays cheap, and ``python -m minikv.models.hub`` does not find
``hub`` already imported by its own package (which makes runpy warn).
"""
import importlib

__all__ = ["KNOWN_MODELS", "minikv_home", "resolve_model"]


def __getattr__(name: str):
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    hub = importlib.import_module(f"{__name__}.hub")   # not `from . import hub`: that
    if name == "KNOWN_MODELS":                         # would call __getattr__ again
        return tuple(sorted(hub.RECIPES))
    return getattr(hub, name)
