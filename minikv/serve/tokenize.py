"""Tokenizing prompts on a thread of their own, before the engine ever sees them.

Tokenizing (and, for chat, rendering the template) costs CPU in proportion to the prompt's
length.  When the engine thread did it, a request that was going to be rejected anyway ("prompt
longer than the context") still took the engine thread away from everyone's decoding for as long
as its tokenization lasted, and a client sending such requests in a loop slowed every other
tenant's tokens by 10-50x (issue 14).  So the server tokenizes here instead:

* on **one worker thread** with **its own copy** of the tokenizer (tokenizer objects are not
  meant to be shared across threads, and the engine keeps its own);
* after the cheap checks (:mod:`minikv.serve.limits`, :mod:`minikv.serve.protocol`), so what
  reaches this thread is already bounded in size and rate per tenant;
* and rejects a prompt that cannot fit the context *here*, so the engine thread only receives
  token ids that it will actually run.

The engine still validates what it receives (ids in the vocabulary, length): this is a second,
cheaper gate, not a replacement for the first.
"""
from __future__ import annotations

import asyncio
import copy
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..engine.chat import control_tokens, render_chat


@dataclass(frozen=True)
class ChatPrompt:
    """A validated chat conversation (a tuple of ``{"role", "content"}`` dicts)."""

    messages: tuple


class PromptEncoder:
    """``await encoder.encode(prompt)`` -> token ids, computed off the event loop and off the
    engine thread.  ``prompt`` is a str, a list of token ids (returned as is) or a
    :class:`ChatPrompt`.  Raises ValueError (-> HTTP 400) for a prompt that cannot be served."""

    def __init__(self, tokenizer, max_model_len: int):
        self._tok = copy.deepcopy(tokenizer)
        self._forbidden = control_tokens(self._tok)
        self.max_model_len = max_model_len
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="minikv-tokenize")

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, ChatPrompt):
            ids, _ = render_chat(self._tok, prompt.messages, self._forbidden)
        elif isinstance(prompt, str):
            ids = list(self._tok(prompt).input_ids)  # as LLMEngine.encode_prompt does
        else:
            ids = list(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        return ids

    async def encode(self, prompt) -> list[int]:
        if isinstance(prompt, list):  # token ids: nothing to compute
            return self._encode(prompt)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, prompt)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
