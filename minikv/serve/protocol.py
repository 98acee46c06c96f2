"""The OpenAI wire format, server side: error bodies and request validation.

Everything here is plain Python over the request body -- no FastAPI import, no engine -- so the
rules of what a request may contain can be read (and tested) on their own.  Two rules matter
for security and robustness:

* **Validate everything before anything is allocated.**  A request with a bad field becomes an
  :class:`APIError` (HTTP 400, OpenAI-shaped) here, before the engine sees it, so one malformed
  request never disturbs the batch the others are running in.
* **Refuse what is not implemented** (``n > 1``, ``best_of``, ``logprobs``, ``echo``,
  ``suffix``, batched prompts, and any field not in :data:`COMPLETION_FIELDS` /
  :data:`CHAT_FIELDS`, such as ``tools`` or ``response_format``) instead of silently ignoring
  it: a client that asked for something must not be handed a response that only looks like it.

Fields that would let a client choose its cache domain (``cache_salt``, ``tenant``, ``user``)
are simply never read: the tenant comes from the API key (:mod:`minikv.serve.auth`).
"""
from __future__ import annotations

import json
import math
from typing import Any

from ..engine.chat import CHAT_ROLES


class APIError(Exception):
    """An error the client caused (or must hear about): the app answers it with HTTP ``status``
    and the OpenAI body ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """The OpenAI error object (also sent as an SSE event when a stream fails midway)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class ClientGone(Exception):
    """The client hung up while we were reading its body: nothing to answer, nothing to log
    beyond one info line (it is not a server error)."""


def _reject_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _bounded_int(text: str) -> int:
    # Python refuses to parse ints of more than 4,300 digits (a CPU-exhaustion guard) with a
    # bare ValueError; no field of ours needs more than 20 digits, so say so clearly.
    if len(text.lstrip("-")) > 20:
        raise ValueError(f"integer with {len(text.lstrip('-'))} digits is too large")
    return int(text)


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400 parses to inf
        raise ValueError(f"number {text[:32]} is out of range")
    return value


def parse_json(raw: bytes) -> dict:
    """Parse a request body strictly: standard JSON only (no ``NaN``/``Infinity`` literals,
    which Python's ``json`` accepts by default), bounded integers, finite floats, an object
    at the top.  Every problem is an :class:`APIError` 400, never an exception a handler
    would turn into a 500."""
    try:
        body = json.loads(raw, parse_constant=_reject_constant, parse_int=_bounded_int,
                          parse_float=_finite_float)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
        raise APIError(400, "the request body is not valid JSON", code="invalid_json") from None
    except ValueError as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object", code="invalid_json")
    return body


def check_content_length(request, max_body_bytes: int) -> None:
    """Refuse a declared body over ``max_body_bytes`` (413) before reading any of it."""
    length = request.headers.get("content-length")
    if length is None:
        return
    if not length.isdigit() or len(length) > 20:
        raise APIError(400, f"invalid Content-Length header {length[:24]!r}")
    if int(length) > max_body_bytes:
        raise APIError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large")


async def read_json(request, max_body_bytes: int) -> dict:
    """The request body as a JSON object, refusing more than ``max_body_bytes`` (HTTP 413).

    The limit is checked twice: against ``Content-Length`` before reading anything, and while
    reading, for chunked bodies (and clients whose header lies).  Without it, one request could
    make the server buffer an arbitrarily large body in memory.
    """
    from starlette.requests import ClientDisconnect

    check_content_length(request, max_body_bytes)
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_body_bytes:
                raise APIError(413, f"request body exceeds {max_body_bytes} bytes", code="request_too_large")
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return parse_json(b"".join(chunks))


_MISSING = object()

_SHARED_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
                  "ignore_eos", "stream", "stream_options", "n", "logprobs", "top_logprobs",
                  "presence_penalty", "frequency_penalty", "logit_bias", "user", "cache_salt")
#: Every field a request may carry; ``user`` is accepted and ignored (it names no one the server
#: trusts), ``cache_salt`` is read only under ``--trust-client-salt`` (:mod:`.client_salt`).
COMPLETION_FIELDS = frozenset(_SHARED_FIELDS + ("prompt", "best_of", "echo", "suffix"))
CHAT_FIELDS = frozenset(_SHARED_FIELDS + ("messages", "max_completion_tokens"))


def check_known_fields(body: dict, chat: bool) -> None:
    """Refuse (400, naming it) the first field this server does not implement."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in known:
            raise APIError(400, f"'{name[:64]}' is not supported by this server; remove it from the request",
                           param=name[:64], code="unsupported_parameter")


def _logit_bias(body: dict) -> dict[int, float] | None:
    """``logit_bias`` off the wire: JSON keys are strings, so {"50256": -100} -> {50256: -100.0};
    ranges and the vocabulary are checked by ``SamplingParams`` and the engine."""
    bias = _field(body, "logit_bias", (dict,), None, "an object of token id -> bias")
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10):
            raise APIError(400, f"logit_bias key {key[:24]!r} is not a token id", param="logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise APIError(400, f"logit_bias[{key}] must be a number, got {type(value).__name__}",
                           param="logit_bias", code="invalid_type")
        out[int(key)] = float(value)
    return out


def _field(body: dict, name: str, kinds: tuple, default: Any = None, what: str = "") -> Any:
    value = body.get(name, _MISSING)
    if value is _MISSING or value is None:
        return default
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        raise APIError(400, f"'{name}' must be {what or ' or '.join(k.__name__ for k in kinds)}, "
                            f"got {type(value).__name__}", param=name, code="invalid_type")
    return value


def _sampling_params(body: dict, default_max_tokens: int, max_model_len: int, chat: bool):
    from ..engine.sampling import SamplingParams

    n = _field(body, "n", (int,), 1, "an integer")
    if n != 1:
        raise APIError(400, f"n={n} is not supported; minikv returns one choice per request", param="n")
    best_of = _field(body, "best_of", (int,), 1, "an integer")
    if best_of != 1:
        raise APIError(400, "best_of is not supported", param="best_of")
    if body.get("logprobs") not in (None, False) or body.get("top_logprobs") not in (None, 0):
        raise APIError(400, "logprobs are not supported", param="logprobs")
    if not chat and _field(body, "echo", (bool,), False):
        raise APIError(400, "echo is not supported", param="echo")
    if not chat and body.get("suffix") not in (None, ""):
        raise APIError(400, "suffix is not supported", param="suffix")
    max_tokens = _field(body, "max_tokens", (int,), None, "an integer")
    if chat and max_tokens is None:
        max_tokens = _field(body, "max_completion_tokens", (int,), None, "an integer")
    if max_tokens is None:
        max_tokens = default_max_tokens
    elif max_tokens <= 0:
        raise APIError(400, f"max_tokens must be > 0, got {max_tokens}", param="max_tokens")
    elif max_tokens >= max_model_len:
        raise APIError(400, f"max_tokens={max_tokens} exceeds the model's context ({max_model_len} tokens)",
                       param="max_tokens")
    # Numbers are checked here *and* again by SamplingParams: the HTTP door answers in the
    # client's terms (param names, a 400), the engine door protects Python callers too.
    temperature = _field(body, "temperature", (int, float), 1.0, "a number")
    if not 0 <= temperature < math.inf:
        raise APIError(400, f"temperature must be a finite number >= 0, got {temperature!r}", param="temperature")
    top_p = _field(body, "top_p", (int, float), 1.0, "a number")
    if not 0 < top_p <= 1:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p!r}", param="top_p")
    top_k = _field(body, "top_k", (int,), 0, "an integer")
    if top_k < -1:
        raise APIError(400, f"top_k must be >= -1 (0 or -1 disables it), got {top_k}", param="top_k")
    seed = _field(body, "seed", (int,), None, "an integer")
    if seed is not None and not -2**63 <= seed < 2**63:
        raise APIError(400, f"seed must be a 64-bit signed integer, got {seed}", param="seed")
    stop = body.get("stop")
    if stop is not None and not (isinstance(stop, str) or (isinstance(stop, list)
                                                          and all(isinstance(s, str) for s in stop))):
        raise APIError(400, "'stop' must be a string or a list of strings", param="stop", code="invalid_type")
    if isinstance(stop, list) and len(stop) > 16:
        raise APIError(400, "at most 16 stop strings are supported", param="stop")
    if any(len(s) > 256 for s in ([stop] if isinstance(stop, str) else stop or [])):
        raise APIError(400, "a stop string may be at most 256 characters", param="stop")
    ignore_eos = _field(body, "ignore_eos", (bool,), False, "a boolean")
    stop_ids = _field(body, "stop_token_ids", (list,), None, "a list of token ids")
    penalties = {name: float(_field(body, name, (int, float), 0.0, "a number"))
                 for name in ("presence_penalty", "frequency_penalty")}
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=float(temperature), top_p=float(top_p),
                              top_k=top_k, seed=seed, stop=stop or None, ignore_eos=ignore_eos,
                              stop_token_ids=stop_ids, logit_bias=_logit_bias(body), **penalties)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from None


def _too_long(what: str, n: int, cap: int, param: str) -> APIError:
    return APIError(400, f"{what} has {n} characters; this server accepts at most {cap} "
                         "(--max-prompt-chars)", param=param, code="prompt_too_long")


def _completion_prompt(body: dict, max_chars: int = 1 << 62):
    """The prompt of a completion request, capped at ``max_chars`` characters (or token ids)
    *before* anything tokenizes it: tokenizing is the first expensive step."""
    prompt = body.get("prompt", _MISSING)
    if prompt is _MISSING or prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt", code="missing_required_parameter")
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        if len(prompt) > max_chars:
            raise _too_long("'prompt'", len(prompt), max_chars, "prompt")
        return prompt
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "'prompt' is empty", param="prompt")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if len(prompt) > max_chars:
                raise _too_long("'prompt' (token ids)", len(prompt), max_chars, "prompt")
            return list(prompt)
        if len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            return _completion_prompt({"prompt": prompt[0]}, max_chars)
        if all(isinstance(p, (str, list)) for p in prompt):
            raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    raise APIError(400, "'prompt' must be a string, a list of token ids, or a list with one string",
                   param="prompt", code="invalid_type")


def _chat_messages(body: dict, max_chars: int = 1 << 62, max_messages: int = 1 << 62) -> tuple:
    """The messages of a chat request, capped at ``max_messages`` messages and ``max_chars``
    characters of content in all; control tokens inside content are refused later, by
    :func:`minikv.engine.chat.render_chat`, which knows the tokenizer's special tokens."""
    messages = body.get("messages", _MISSING)
    if messages is _MISSING or messages is None:
        raise APIError(400, "'messages' is required", param="messages", code="missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages", code="invalid_type")
    if len(messages) > max_messages:
        raise APIError(400, f"'messages' has {len(messages)} messages; this server accepts at most "
                            f"{max_messages} (--max-messages)", param="messages")
    out, total = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object", param=f"messages[{i}]", code="invalid_type")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise APIError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}",
                           param=f"messages[{i}].role")
        if isinstance(content, list):  # content parts: only text is supported
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts are supported",
                               param=f"messages[{i}].content")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(400, f"messages[{i}].content must be a string", param=f"messages[{i}].content",
                           code="invalid_type")
        total += len(content)
        if total > max_chars:
            raise _too_long("'messages' content", total, max_chars, "messages")
        out.append({"role": "system" if role == "developer" else role, "content": content})
    if not any(m["content"] for m in out):
        raise APIError(400, "'messages' contain no text", param="messages")
    return tuple(out)
