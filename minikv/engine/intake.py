"""Request intake: every check a request passes at the door, before anything is allocated.

``LLMEngine.add_request`` calls :func:`check_request` first and queues the request only if it
passes.  Why all of it here, up front?  Once a request is in a step it shares that step's batch
with other tenants' requests; a value that slipped through (a bool as a token id, an id beyond the
vocabulary, a prompt larger than the whole pool) would fail *inside* the shared step.  Here it
fails alone, with a ``TypeError``/``ValueError`` naming the value, and the engine is left exactly
as it was: nothing queued, no block taken, no id in flight.

The order is cheapest first: types, then the id, then the sampling parameters, and only then the
prompt, which may need the tokenizer.
"""
from __future__ import annotations

from .chat import encode_text
from .checks import as_int, check_bool, show
from .sampling import SamplingParams


def encode_prompt(tokenizer, vocab_size: int, prompt) -> tuple[list[int], str | None]:
    """Token ids (validated against the vocabulary) and text of a str or token-id prompt.

    Token ids may be Python or NumPy integers (converted exactly with ``operator.index``);
    bools are refused: ``True`` is an int to Python but never a token anyone meant."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError("prompt is empty ('')")
        return encode_text(tokenizer, prompt), prompt
    if isinstance(prompt, (list, tuple)):
        # Plain ints (not bools: their type is bool) need no conversion: one pass over the types
        # instead of an ABC check per token, which would cost a long prompt a noticeable part of a
        # fast prefix hit.  Anything else goes through as_int, one by one.
        ids = list(prompt) if all(type(t) is int for t in prompt) else [
            as_int(f"prompt token {i}", t) for i, t in enumerate(prompt)]
        check_vocab("token id", ids, vocab_size)
        return ids, None
    raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__} ({show(prompt)})")


def check_vocab(what: str, ids: list[int], vocab_size: int) -> None:
    """A ValueError naming the first id outside ``[0, vocab_size)``, here rather than as a failed
    embedding lookup inside a step that other requests share."""
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"{what} {show(bad[0])} is outside the vocabulary [0, {vocab_size})")


def check_request(engine, request_id, prompt, params, tenant,
                  cache_private) -> tuple[list[int], str | None, SamplingParams]:
    """``(prompt ids, prompt text, params)`` of a request ``engine`` may queue, or the error
    that refuses it (``params=None`` means the defaults)."""
    if tenant is not None and not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str or None, got {type(tenant).__name__}")
    check_bool("cache_private", cache_private)
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__} ({show(request_id)})")
    if request_id in engine.requests:
        raise ValueError(f"request_id {request_id!r} is not a new id: that request is still running")
    params = params if params is not None else SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
    check_vocab("stop_token_ids entry", params.stop_token_ids, engine.model.shape.vocab_size)
    check_vocab("logit_bias token id", list(params.logit_bias or ()), engine.model.shape.vocab_size)
    ids, text = engine.encode_prompt(prompt)
    if not ids:
        raise ValueError("prompt is empty (no tokens)")
    if len(ids) >= engine.max_model_len:
        raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {engine.max_model_len}")
    pool_tokens = engine.num_blocks * engine.block_size
    if len(ids) + 1 > pool_tokens:  # + 1: the first output token needs a slot too
        raise ValueError(f"prompt has {len(ids)} tokens; the whole pool holds {pool_tokens}")
    return ids, text, params
