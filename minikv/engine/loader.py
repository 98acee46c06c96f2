"""Load a Llama-family checkpoint: transformers reads the files, minikv takes the weights.

We let transformers parse configs, safetensors and tokenizers (there is nothing to learn from
re-implementing file formats), then copy the tensors into minikv's own :class:`LlamaModel`
and drop the transformers module.  From here on, no transformers ``forward`` ever runs.
"""
from __future__ import annotations

import torch

from .model import Layer, LlamaModel, ModelShape

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def eos_token_ids(hf_config, tokenizer) -> set[int]:
    """Every end-of-sequence id the checkpoint declares (config and tokenizer may differ,
    and either may list several)."""
    ids = set()
    for src in (hf_config.eos_token_id, tokenizer.eos_token_id):
        ids.update(src if isinstance(src, (list, tuple)) else [src] if src is not None else [])
    return ids


def load_model(path, dtype: torch.dtype, device: torch.device):
    """Returns ``(LlamaModel, tokenizer, hf_config)`` for the checkpoint directory ``path``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-tensor bar on every engine start is noise

    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {config.model_type!r} at {path} is not a Llama-family model; "
                         f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = from_hf(hf, device)
    del hf
    return model, tokenizer, config


def from_hf(hf, device: torch.device) -> LlamaModel:
    """Build minikv's model from a transformers ``*ForCausalLM`` (weights only)."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    shape = ModelShape(c.num_hidden_layers, c.hidden_size, c.num_attention_heads,
                       c.num_key_value_heads, head_dim, c.vocab_size, c.rms_norm_eps,
                       c.max_position_embeddings)
    sd = {k: v.detach().to(device) for k, v in hf.state_dict().items()}

    def cat(names: list[str]) -> torch.Tensor | None:
        parts = [sd.get(n) for n in names]
        return None if any(p is None for p in parts) else torch.cat(parts, dim=0).contiguous()

    layers = []
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        layers.append(Layer({
            "input_norm": sd[p + "input_layernorm.weight"],
            "post_norm": sd[p + "post_attention_layernorm.weight"],
            "qkv": cat([a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"]),
            "qkv_bias": cat([a + "q_proj.bias", a + "k_proj.bias", a + "v_proj.bias"]),
            "o_proj": sd[a + "o_proj.weight"], "o_bias": sd.get(a + "o_proj.bias"),
            "gate_up": cat([m + "gate_proj.weight", m + "up_proj.weight"]),
            "gate_up_bias": cat([m + "gate_proj.bias", m + "up_proj.bias"]),
            "down": sd[m + "down_proj.weight"], "down_bias": sd.get(m + "down_proj.bias"),
        }))
    embed = sd["model.embed_tokens.weight"]
    lm_head = sd.get("lm_head.weight", embed)  # tied embeddings share one matrix
    rotary = hf.model.rotary_emb  # inv_freq already encodes any rope_scaling recipe
    return LlamaModel(shape, embed, layers, sd["model.norm.weight"], lm_head,
                      rotary.inv_freq.detach().to(device), float(getattr(rotary, "attention_scaling", 1.0)))
