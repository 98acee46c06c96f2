"""Where minikv keeps what it builds: converted models, compiled kernels, downloaded data.

``$MINIKV_HOME``, default ``~/.cache/minikv``; read on every call so tests can point it
elsewhere.  Torch-free and import-free, so every layer (engine, models, audit) may use it.
"""
from __future__ import annotations

import os
from pathlib import Path


def minikv_home() -> Path:
    """Root of minikv's cache."""
    home = os.environ.get("MINIKV_HOME") or Path.home() / ".cache" / "minikv"
    return Path(home).expanduser().absolute()
