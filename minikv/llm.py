"""``LLM``: the offline, batch API -- the same names and shapes as vLLM's.

    llm = LLM("smollm2-135m-instruct", enable_prefix_caching=True)
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=8, temperature=0.0), tenant="alice")
    outs[0].outputs[0].text, outs[0].num_cached_tokens

``generate`` queues every prompt and steps the engine until they are all finished; the engine
batches them continuously.  ``llm.engine`` is the step-by-step API for lessons and servers.

This module is the *composition root*: the engine (``minikv.engine``) is handed its weights and
its audit trail and its KV tiers, and never imports where they come from.  :func:`build_engine` is the one place
that resolves a model name to a checkpoint (``minikv.models.hub``), loads it
(``minikv.engine.loader``) and gives the engine a way to open its trail (:func:`open_trail`,
``minikv.audit.trail``).  See "Layers" in docs/ARCHITECTURE.md.
"""
from __future__ import annotations

import numbers
import os
import weakref

import numpy as np

from .audit.trail import AuditTrail
from .backends import make_backend
from .engine.chat import render_chat
from .engine.config import EngineConfig, resolve_device
from .engine.engine import LLMEngine
from .engine.loader import load_model, resolve_dtype
from .engine.outputs import RequestOutput
from .engine.sampling import SamplingParams
from .models.hub import resolve_model
from .sharing import attach_sharing
from .tiers import attach_tiers, parse_tiers


def open_trail(config: EngineConfig, operator_key: bytes) -> AuditTrail | None:
    """The engine's audit trail (``config.audit_log``, ``config.audit_level``), or None."""
    if config.audit_log is None:
        return None
    return AuditTrail(config.audit_log, operator_key, config.block_size, level=config.audit_level)


# Weights already in memory, by (checkpoint files, dtype, device).  Weak: a model is dropped when
# its last engine is, so the cache never keeps anything alive by itself.
_LOADED: "weakref.WeakValueDictionary[tuple, object]" = weakref.WeakValueDictionary()
_LOADED_WITH: "weakref.WeakKeyDictionary[object, tuple]" = weakref.WeakKeyDictionary()  # model -> (tokenizer, hf_config)


def _checkpoint_key(path, dtype, device) -> tuple:
    """What makes two loads the same: the checkpoint's files (name, size, mtime), dtype, device.
    A checkpoint rewritten in place (a test's tiny model, a re-conversion) is a new key."""
    path = os.path.realpath(path)
    stats = ((e.name, e.stat()) for e in os.scandir(path) if e.is_file()) if os.path.isdir(path) else ()
    files = tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))
    return path, files, str(dtype), str(device)


def shared_weights(path, dtype, device) -> tuple:
    """``(model, tokenizer, hf_config)`` for a checkpoint, loaded once per process while any engine
    holds it.  A lesson that builds seven engines of SmolLM2 side by side holds one copy of its
    weights (0.5 GB in fp32, plus the packed copies the fused backend makes), not seven: the
    same sharing as :meth:`LLM.fork`, for engines built by name.  Weights are never written
    after loading, so sharing them is safe; each engine still has its own pool, keys and trail."""
    key = _checkpoint_key(path, dtype, device)
    model = _LOADED.get(key)
    if model is not None:
        return model, *_LOADED_WITH[model]
    model, tokenizer, hf_config = load_model(path, dtype, device)
    _LOADED_WITH[model] = (tokenizer, hf_config)
    _LOADED[key] = model
    return model, tokenizer, hf_config


def clear_weights_cache() -> None:
    """Forget which weights are loaded: the next engine built by name loads its own copy (live
    engines keep theirs).  For tests and comparisons that need weights no other engine has touched
    (the fast backends keep packed copies per model object: ``minikv.backends.model_state``)."""
    _LOADED.clear()


def build_engine(config: EngineConfig) -> LLMEngine:
    """An :class:`LLMEngine` for ``config``: model name -> checkpoint -> weights, plus the trail
    and the KV tiers (``minikv.tiers``, attached below its block manager)."""
    device = resolve_device(config.device)  # a missing device fails here, before the weights load
    parse_tiers(config.kv_tiers)  # likewise a bad tier spec (checked, not connected)
    weights = shared_weights(resolve_model(config.model), resolve_dtype(config.dtype, device), device)
    return LLMEngine(config, weights=weights, open_trail=open_trail, make_backend=make_backend,
                     attach=(attach_tiers, attach_sharing))


def _as_prompt_list(prompts) -> list:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        # A flat list of numbers is *one* prompt of token ids.  Floats, bools and NumPy scalars
        # count here too, so that the engine's check names the bad id (not each "prompt").
        if prompts and all(isinstance(t, (numbers.Number, np.bool_)) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise TypeError(f"prompts must be a str, a list of str or a list of token-id lists, got {type(prompts).__name__}")


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries for {n} prompts")
        return list(value)
    return [value] * n


class LLM:
    """A model plus a KV-cache engine.  Keyword arguments are :class:`EngineConfig` fields."""

    def __init__(self, model: str = "smollm2-135m-instruct", **kwargs):
        self.engine = build_engine(EngineConfig(model=model, **kwargs))

    def fork(self, **overrides) -> "LLM":
        """Another LLM with its own KV pool and settings that shares this one's weights (no
        reload): cheap side-by-side comparisons of cache policies in a lesson."""
        new = LLM.__new__(LLM)
        new.engine = self.engine.fork(**overrides)
        return new

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list | None = None,
                 tenant: str | None | list = None, cache_private: bool | list = False) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in the order of ``prompts``.

        ``tenant`` is a tenant name (str), None for the anonymous tenant, or one per prompt.
        ``cache_private`` (a bool, or one per prompt): the tenant's mark keeping a prompt's cached
        blocks in its own domain under every policy (``Engine.add_request``).
        """
        prompts = _as_prompt_list(prompts)
        params = _per_prompt(sampling_params if sampling_params is not None else SamplingParams(),
                             len(prompts), "sampling_params")
        tenants = _per_prompt(tenant, len(prompts), "tenant")
        for t in tenants:
            if t is not None and not isinstance(t, str):
                raise TypeError(f"tenant must be a str or None, got {type(t).__name__}")
        private = _per_prompt(cache_private, len(prompts), "cache_private")
        ids: list[str] = []
        try:
            for p, sp, t, cp in zip(prompts, params, tenants, private):
                rid = self.engine.new_request_id()
                self.engine.add_request(rid, p, sp, tenant=t, cache_private=cp)
                ids.append(rid)
        except Exception:
            for rid in ids:  # all or nothing: a bad prompt must not leave orphans running
                self.engine.abort_request(rid)
            raise
        return self._run(ids)

    def _run(self, ids: list[str]) -> list[RequestOutput]:
        pending, done = set(ids), {}
        while pending:
            for out in self.engine.step():
                if out.finished and out.request_id in pending:
                    done[out.request_id] = out
                    pending.discard(out.request_id)
        return [done[r] for r in ids]

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat(self, messages, sampling_params: SamplingParams | None = None,
             tenant: str | None | list = None, cache_private: bool | list = False) -> list[RequestOutput]:
        """Chat completion: ``messages`` is one conversation (list of {role, content} dicts) or
        a list of them.  :func:`~minikv.engine.chat.render_chat` applies the chat template and
        tokenizes it, refusing (ValueError) a control token such as ``<|im_start|>`` inside a
        message's content: that would let the message forge a turn of another role."""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        rendered = [render_chat(self.engine.tokenizer, c) for c in convs]
        outs = self.generate([ids for ids, _ in rendered], sampling_params, tenant, cache_private)
        for out, (_, text) in zip(outs, rendered):
            out.prompt = text
        return outs
