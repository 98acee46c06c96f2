"""Where minikv's models come from: see :mod:`minikv.models.hub`.

The names below are loaded lazily (PEP 562): importing ``minikv.models`` stays cheap,
and ``python -m minikv.models.hub`` does not import ``hub`` twice.
"""

__all__ = ["KNOWN_MODELS", "minikv_home", "resolve_model"]


def __getattr__(name: str):
    from minikv.models import hub
    if name == "KNOWN_MODELS":
        return tuple(sorted(hub.RECIPES))
    if name in ("minikv_home", "resolve_model"):
        return getattr(hub, name)
    raise AttributeError(f"module 'minikv.models' has no attribute {name!r}")
