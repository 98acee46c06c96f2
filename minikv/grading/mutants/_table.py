"""The shape of a mutant table: ``(name, implementation, what is wrong)``.

The third item is the implementation's own docstring, so the explanation a lesson prints and
the code it explains can never drift apart.
"""
from __future__ import annotations


def entries(*named) -> list[tuple[str, object, str]]:
    """``entries(("name", impl), ...)`` -> ``[("name", impl, impl.__doc__), ...]``."""
    return [(name, impl, impl.__doc__) for name, impl in named]
