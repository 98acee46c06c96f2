"""Input checks shared by every door into the engine (torch-free, so config can use them).

Each helper turns a value into the exact Python type the engine works with, or raises a
``TypeError``/``ValueError`` whose message names the argument and shows the value.  Why so
strict?  The engine runs many tenants' requests in one batch: a value that slips through here
(NaN, ``10**400``, a bool where a count belongs) fails later *inside* a shared step, where it
can take other people's requests down with it.
"""
from __future__ import annotations

import math
import numbers
import operator

# The seeds ``torch.Generator.manual_seed`` accepts (a C ``long long`` or ``unsigned long long``;
# negative seeds wrap modulo 2**64).  Checked at the door so a bad seed fails there, with its
# name, and not later as torch's "Overflow when unpacking long long" inside a step.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1

def show(value, width: int = 60) -> str:
    """``repr(value)`` cut to ``width`` characters, for error messages.  A client can send a
    5,000-digit integer, and Python refuses to print ints over 4,300 digits at all."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        sign = "a negative" if value < 0 else "an"
        return f"<{sign} int of about {int(value.bit_length() * 0.30103)} digits>"
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def as_int(name: str, value, *, minimum: int | None = None) -> int:
    """``value`` as a Python int, or a TypeError/ValueError naming ``name`` and the value.

    bool is rejected (``True`` is an int to Python, never a count or an id to a person).
    NumPy integers are accepted on purpose: ids and counts often come out of arrays, and
    ``operator.index`` converts them exactly (it refuses floats, so ``2.0`` is still an error).
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({show(value)})")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {show(value)}")
    return value


def check_bool(name: str, value) -> bool:
    """``value`` itself if it is a bool, else a TypeError naming ``name`` and the value (``1`` or
    ``"yes"`` are not flags: a switch that silently means something else is how a defense ends
    up off)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__} ({show(value)})")
    return value


def as_real(name: str, value) -> float:
    """``value`` as a finite float, or an error naming ``name``.  ``float(10**400)`` overflows
    and NaN/inf compare False with every bound, so both are checked explicitly."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} ({show(value)})")
    try:
        f = float(value)
    except OverflowError:
        raise ValueError(f"{name} is too large to be a float: {show(value)}") from None
    if not math.isfinite(f):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return f


def as_seed(name: str, value) -> int:
    """A seed torch can take: an int (not bool) in ``[-2**63, 2**64 - 1]``."""
    value = as_int(name, value)
    if not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"{name} must be in [-2**63, 2**64 - 1] (what torch.Generator accepts), "
                         f"got {show(value)}")
    return value


def positive_int(name: str, value) -> int:
    """``value`` as an int > 0, or an error naming ``name``."""
    value = as_int(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {show(value)}")
    return value


def check_choice(name: str, value, choices: tuple) -> None:
    """A ValueError naming ``name``, the value and the choices, unless ``value`` is one of them."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}={show(value)} is not valid; choose one of {', '.join(map(repr, choices))}")
