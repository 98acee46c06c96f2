"""The data format of sealed grading: what crosses the pipe between a grader and a learner's child.

Only *data* crosses: ``None``, bools, numbers, strings, bytes, tuples, lists, dicts, sets, enums,
dataclasses (as their fields), numpy arrays and torch tensors (as dtype, shape and raw bytes).
Anything else -- a function, an engine, a request -- stays in the process that owns it and
crosses as a *handle*: a number the other side can only ask about (a public attribute, a call),
never touch.  Decoding never runs code named by the sender: an enum or a dataclass is rebuilt
as the real class only when the receiver lists it in ``known`` (the grader lists
``SamplingParams``); otherwise it arrives as a ``SimpleNamespace`` of its fields.

This module imports nothing from minikv: the child runs it from its source text
(:mod:`._sealed_child`), before any learner code, without importing the graders.
"""
from __future__ import annotations

import base64
import dataclasses
import enum
import json
import types

#: how many nested containers a message may hold (a deeper one is refused, not recursed into)
MAX_DEPTH = 64


class WireError(ValueError):
    """A message that is not valid sealed-grading data."""


def _qual(obj) -> str:
    t = type(obj)
    return f"{t.__module__}:{t.__qualname__}"


def encode(obj, handle, depth: int = 0):
    """``obj`` as JSON-able data; ``handle(obj) -> int`` names what is not data."""
    if depth > MAX_DEPTH:
        raise WireError(f"data nested deeper than {MAX_DEPTH} levels")
    d = depth + 1
    if obj is None or isinstance(obj, (bool, int, float, str)) and not isinstance(obj, enum.Enum):
        return obj
    if isinstance(obj, enum.Enum):
        return {"__enum": [_qual(obj), encode(obj.value, handle, d)]}
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return {"__b": base64.b64encode(bytes(obj)).decode()}
    if isinstance(obj, tuple):
        return {"__t": [encode(x, handle, d) for x in obj]}
    if isinstance(obj, list):
        return [encode(x, handle, d) for x in obj]
    if isinstance(obj, (set, frozenset)):
        return {"__s": [encode(x, handle, d) for x in obj]}
    if isinstance(obj, dict):
        return {"__d": [[encode(k, handle, d), encode(v, handle, d)] for k, v in obj.items()]}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {"__dc": [_qual(obj), {f.name: encode(getattr(obj, f.name), handle, d)
                                       for f in dataclasses.fields(obj)}]}
    kind = type(obj).__module__.split(".")[0]
    if kind == "numpy" and hasattr(obj, "item") and getattr(obj, "shape", None) == ():
        return obj.item()
    if kind in ("numpy", "torch") and hasattr(obj, "shape") and hasattr(obj, "dtype"):
        import numpy as np

        arr = obj.detach().cpu().numpy() if kind == "torch" else np.asarray(obj)
        arr = np.ascontiguousarray(arr)
        return {"__arr": [kind, str(arr.dtype), list(arr.shape), base64.b64encode(arr.tobytes()).decode()]}
    return {"__h": handle(obj)}


def decode(data, resolve, known: dict | None = None, depth: int = 0):
    """The inverse of :func:`encode`; ``resolve(int) -> object`` turns a handle into a proxy."""
    if depth > MAX_DEPTH:
        raise WireError(f"data nested deeper than {MAX_DEPTH} levels")
    d = depth + 1
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    if isinstance(data, list):
        return [decode(x, resolve, known, d) for x in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise WireError(f"not sealed-grading data: {str(data)[:80]}")
    (tag, v), = data.items()
    known = known or {}
    if tag == "__b":
        return base64.b64decode(v)
    if tag == "__t":
        return tuple(decode(x, resolve, known, d) for x in v)
    if tag == "__s":
        return {decode(x, resolve, known, d) for x in v}
    if tag == "__d":
        return {decode(k, resolve, known, d): decode(x, resolve, known, d) for k, x in v}
    if tag == "__enum":
        value = decode(v[1], resolve, known, d)
        return known[v[0]](value) if v[0] in known else value
    if tag == "__dc":
        fields = {str(k): decode(x, resolve, known, d) for k, x in v[1].items()}
        return known[v[0]](**fields) if v[0] in known else types.SimpleNamespace(**fields)
    if tag == "__arr":
        import numpy as np

        kind, dtype, shape, raw = v
        if dtype == "object":
            raise WireError("object arrays are not data")
        arr = np.frombuffer(base64.b64decode(raw), dtype=np.dtype(dtype)).reshape(shape).copy()
        if kind == "torch":
            import torch

            return torch.from_numpy(arr)
        return arr
    if tag == "__h":
        return resolve(int(v))
    raise WireError(f"unknown tag {tag!r}")


def dumps(message: dict) -> bytes:
    return (json.dumps(message, allow_nan=True) + "\n").encode()


def loads(line: bytes) -> dict:
    try:
        message = json.loads(line)
    except ValueError as exc:
        raise WireError(f"a message that is not JSON: {line[:80]!r}") from exc
    if not isinstance(message, dict) or "op" not in message:
        raise WireError(f"a message without an op: {line[:80]!r}")
    return message
