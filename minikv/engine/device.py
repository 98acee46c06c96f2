"""Where an engine runs: device names checked cheaply, then resolved against this machine.

Two steps, on purpose.  :func:`check_device` runs while an :class:`~minikv.engine.config.EngineConfig`
is built: it only asks whether torch can parse the name and whether minikv runs on that kind of
device, so a typo (``"cdua"``) fails at once, on any machine.  :func:`resolve_device` runs when an
engine is built: it asks whether *this* machine has the device, and fails before any weights load
rather than after.  Building a config never imports torch up front (``import torch`` costs seconds);
both helpers recognise torch objects by their type names until they really need torch.
"""
from __future__ import annotations

import os
from typing import Any

from .checks import show

DEVICE_TYPES = ("cpu", "cuda", "mps")


def check_device(value: Any) -> str:
    """A device name torch parses, of a type minikv runs on: cpu, cuda, cuda:N or mps.
    (Whether that device exists on this machine is checked by :func:`resolve_device`.)"""
    if not isinstance(value, str) and type(value).__name__ != "device":
        raise TypeError(f"device must be a str such as 'cpu' or 'cuda:0', got {type(value).__name__} ({show(value)})")
    import torch  # here, not at the top: building a config must not cost a torch import

    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError, TypeError):
        dev = None
    if dev is None or dev.type not in DEVICE_TYPES:
        raise ValueError(f"device={show(value)} is not valid; use 'cpu', 'cuda', 'cuda:N' or 'mps'")
    return str(dev)


def resolve_device(name: str | None):
    """The ``torch.device`` an engine runs on (CUDA when available if ``name`` is None), or a
    ValueError if the named device is not present here -- raised before any weights load."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(check_device(name))
    if dev.type == "cuda" and (not torch.cuda.is_available() or (dev.index or 0) >= torch.cuda.device_count()):
        raise ValueError(f"device={name!r}: no such CUDA device here "
                         f"({torch.cuda.device_count() if torch.cuda.is_available() else 0} available)")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={name!r}: MPS is not available on this machine")
    return dev


def is_torch_dtype(value: Any) -> bool:
    """Whether ``value`` is a ``torch.dtype``, asked without importing torch."""
    return type(value).__name__ == "dtype" and type(value).__module__ == "torch"


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one, which a
    container or ``taskset`` narrows; else every core), at least 1: how many compilers or
    graders to run at once."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)
