"""``tiny-random``: the test model's recipe -- a byte-level tokenizer and a 2-layer random Llama.

Tests need a model that has the same *shape of problems* as the course model (grouped-query
attention, a ChatML chat template, eos handling, special tokens in user text) but none of the
download, and that builds in about a second.  Two choices make it useful rather than merely small:

* **A byte-level tokenizer with no merges**: byte ``b`` is token ``b + 3``, after the three
  special tokens SmolLM2 also has at ids 0-2.  Any UTF-8 text round-trips, and a test can
  predict token ids by hand.
* **Weights scaled so that greedy decoding depends on the context** (see :func:`build_tiny`): a
  model whose output ignores earlier tokens cannot catch a broken KV cache.

The recipe must be deterministic to the byte: ``minikv.models.hub`` saves it once into a shared
cache, and tests compare a fresh build against that cache.  Anything here that changes the saved
files must come with a new ``RECIPES["tiny-random"]`` version in :mod:`minikv.models.hub`, so
that stale caches are rebuilt instead of trusted.
"""
from __future__ import annotations

import zlib

# Both models speak ChatML and share the special-token layout, so engine code
# (stop on eos, chat formatting) behaves the same on the test model and the real one.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")   # ids 0, 1, 2
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_to_unicode() -> dict[int, str]:
    """The byte-level BPE trick: give each of the 256 bytes a *printable* character.

    Printable Latin-1 bytes stand for themselves; the rest (controls, space, ...)
    are shifted past U+0100. Tokenizers then only ever see visible characters, and
    any UTF-8 text -- emoji included -- round-trips with no unknown token.
    """
    keep = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    shifted = iter(range(256, 512))
    return {b: chr(b) if b in keep else chr(next(shifted)) for b in range(256)}


def build_tiny_tokenizer():
    """A 259-token byte-level tokenizer: ids 0-2 special, byte ``b`` is id ``b + 3``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for b, ch in byte_to_unicode().items():
        vocab[ch] = len(SPECIAL_TOKENS) + b
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))   # no merges: pure bytes
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                for t in SPECIAL_TOKENS])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<|endoftext|>",
                                  bos_token="<|im_start|>", eos_token="<|im_end|>",
                                  pad_token="<|im_end|>", model_max_length=2048,
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHATML_TEMPLATE
    return tok


def build_tiny():
    """The tiny-random ``(model, tokenizer)``: a random Llama whose greedy output is
    *informative* for tests.

    The default init (std 0.02) makes every logit nearly equal, so greedy decoding
    repeats one token and ignores the context: a broken KV cache would go unnoticed.
    Embeddings with std 1 and projections with std 0.25 (about 2/sqrt(hidden)) give
    logits with std ~8, clear top-1 margins, and next tokens that depend on earlier
    tokens -- which is exactly what attention over the KV cache must get right.
    Each tensor draws from its own generator seeded by its name, so the weights do
    not depend on how transformers orders or initializes parameters.
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
    tok = build_tiny_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            if "norm" in name:
                p.fill_(1.0)
            else:
                std = 1.0 if "embed_tokens" in name else 0.25
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    model.generation_config = GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    return model, tok
