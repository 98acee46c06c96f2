"""Strict parsing of a tier spec's options: every bad value is one ValueError naming it and the flag.

A spec is a URL (``host?mib=64``, ``redis://127.0.0.1:6390/0?budget_mib=64``), typed by operators
on a command line.  ``float("inf")``, ``1e30`` or a database that does not exist must stop the
server at start-up with one line, not start it (a cache that never works) or end in a traceback
(``int(inf)`` is an OverflowError, which no ``except ValueError`` catches).
"""
from __future__ import annotations

import math

FLAG = "kv_tiers (--kv-tier)"


def spec_error(spec: str, why: str) -> ValueError:
    return ValueError(f"{FLAG} {spec!r}: {why}")


def number_option(spec: str, query: dict, name: str, default: str, *, minimum: float, maximum: float,
                  integer: bool = False) -> float:
    """Option ``name`` of ``query`` (popped; ``default`` if absent) as a finite number in
    ``(minimum, maximum]`` (an int if ``integer``), else a ValueError naming it and ``spec``."""
    text = query.pop(name, default)
    kind = "a whole number" if integer else "a number"
    try:
        value = int(text) if integer else float(text)
    except ValueError:
        raise spec_error(spec, f"{name} must be {kind} in ({minimum:g}, {maximum:g}], got {text!r}") from None
    if not (math.isfinite(value) and minimum < value <= maximum):
        raise spec_error(spec, f"{name} must be {kind} in ({minimum:g}, {maximum:g}], got {text!r}")
    return value
