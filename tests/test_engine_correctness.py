"""minikv must agree with transformers to the last token (greedy) and within 1e-3 in logits."""
from __future__ import annotations

import pytest
import torch

from minikv import LLM, SamplingParams
from tests.engine_helpers import compare_with_ties, hf_greedy, hf_logits

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "KV caches store the keys and values of",
    "1, 2, 3, 4, 5,",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def _check_model(name: str, max_new: int, **engine_kwargs):
    llm = LLM(name, dtype="float32", device="cpu", **engine_kwargs)
    tok = llm.get_tokenizer()
    prompt_ids = [tok(p).input_ids for p in PROMPTS]
    prompt_ids.append(tok(llm.apply_chat_template(CHAT), add_special_tokens=False).input_ids)
    outs = llm.generate(prompt_ids, SamplingParams(max_tokens=max_new, temperature=0.0))
    ties: list[str] = []
    for ids, out in zip(prompt_ids, outs):
        ref, ref_logits = hf_greedy(name, ids, max_new)
        got = out.outputs[0].token_ids
        compare_with_ties(got, ref, ref_logits, f"{name} {ids[:4]}", ties)
        # Logits at every position (prompt and generated), through minikv's paged prefill path.
        full = ids + got
        diff = (llm.engine.score(full) - hf_logits(name, full)).abs().max().item()
        assert diff <= 1e-3, f"{name}: max |logit diff| {diff:.2e} > 1e-3"
    for t in ties:
        print("TIE:", t)
    return llm, outs


def test_tiny_random_matches_transformers():
    _check_model("tiny-random", 24)


def test_tiny_random_decode_logits_match_transformers():
    """The decode path (batched paged attention) too: logits captured at every decode step."""
    llm = LLM("tiny-random", dtype="float32", device="cpu", block_size=4)
    ids = llm.get_tokenizer()(PROMPTS[2]).input_ids
    llm.engine.logit_trace = []
    out = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    got = out.outputs[0].token_ids
    ref = hf_logits("tiny-random", ids + got)
    steps = [t[out.request_id] for t in llm.engine.logit_trace]
    for k, logits in enumerate(steps):
        diff = (logits - ref[len(ids) - 1 + k]).abs().max().item()
        assert diff <= 1e-3, f"decode step {k}: max |logit diff| {diff:.2e}"


@pytest.mark.model
def test_smollm2_matches_transformers(smollm2_path):
    llm, outs = _check_model("smollm2-135m-instruct", 12)
    assert outs[-1].outputs[0].text.startswith("The capital of France is Paris")


@pytest.mark.model
def test_smollm2_chat_answer(smollm2_path):
    llm = LLM("smollm2-135m-instruct", dtype="float32", device="cpu")
    out = llm.chat(CHAT, SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert out.outputs[0].text == "The capital of France is Paris."
    assert out.outputs[0].finish_reason == "stop"


def test_no_transformers_forward_runs(monkeypatch):
    """The forward pass is minikv's own: make every transformers forward raise and generate."""
    import transformers.models.llama.modeling_llama as ml

    llm = LLM("tiny-random", dtype="float32", device="cpu")

    def boom(*a, **k):
        raise AssertionError("transformers forward was called")

    for name in dir(ml):
        cls = getattr(ml, name)
        if isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls.__module__ == ml.__name__:
            monkeypatch.setattr(cls, "forward", boom)
    out = llm.generate("hello there", SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 5
    with pytest.raises(AssertionError, match="transformers forward"):
        ml.LlamaRMSNorm(4)(torch.ones(4))
