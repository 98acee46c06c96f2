"""Lazy re-exports (PEP 562), so that importing a light module never drags in a heavy one.

``minikv.audit`` must import without torch, ``minikv.serve`` without the engine, and a few
modules re-export names from modules that import them back (a cycle if done eagerly).  Each of
them declares ``name -> submodule`` and gets a module-level ``__getattr__`` from here.
"""
from __future__ import annotations

import importlib


def lazy_exports(package: str, exports: dict[str, str], namespace: dict):
    """A module ``__getattr__`` that imports ``exports[name]`` (relative to ``package``) on
    first use and caches the value in ``namespace`` (the module's ``globals()``)."""
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {namespace.get('__name__', package)!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value
    return __getattr__
