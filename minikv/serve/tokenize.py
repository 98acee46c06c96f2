"""Tokenizing prompts on a thread of their own, before the engine ever sees them.

Tokenizing (and, for chat, rendering the template) costs CPU in proportion to the prompt's
length.  When the engine thread did it, a request that was going to be rejected anyway ("prompt
longer than the context") still took the engine thread away from everyone's decoding for as long
as its tokenization lasted, and a client sending such requests in a loop slowed every other
tenant's tokens many times over.  So the server tokenizes here instead:

* on **one worker thread** with **its own copy** of the tokenizer (tokenizer objects are not
  meant to be shared across threads, and the engine keeps its own);
* **round-robin across tenants**: each tenant has its own queue and the worker takes one prompt
  from each tenant in turn, so a tenant flooding the tokenizer with long prompts delays another
  tenant's prompt by at most two of its own (the one being encoded and one turn), however many
  it queued.  First-in first-out made a victim's first token wait behind every queued attacker
  prompt (measured: 140 ms -> 1.9 s with 16 attacker connections);
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
import threading
from collections import deque
from dataclasses import dataclass

from ..engine.chat import control_tokens, encode_text, render_chat


@dataclass(frozen=True)
class ChatPrompt:
    """A validated chat conversation (a tuple of ``{"role", "content"}`` dicts)."""

    messages: tuple


class PromptEncoder:
    """``await encoder.encode(prompt, tenant)`` -> token ids, computed off the event loop and off
    the engine thread, fair-share across tenants.  ``prompt`` is a str, a list of token ids
    (returned as is) or a :class:`ChatPrompt`.  Raises ValueError (-> HTTP 400) for a prompt that
    cannot be served."""

    def __init__(self, tokenizer, max_model_len: int):
        self._tok = copy.deepcopy(tokenizer)
        # We check the length ourselves (below); without this, transformers logs a warning for
        # every over-long prompt a client sends -- a client mistake in the server's log.
        self._tok.model_max_length = 1 << 62
        self._forbidden = control_tokens(self._tok)
        self.max_model_len = max_model_len
        self._queues: dict = {}                 # tenant -> deque of (prompt, loop, future)
        self._turns: deque = deque()            # tenants with work, in round-robin order
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name="minikv-tokenize", daemon=True)
        self._thread.start()

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, ChatPrompt):
            ids, _ = render_chat(self._tok, prompt.messages, self._forbidden)
        elif isinstance(prompt, str):
            ids = encode_text(self._tok, prompt)
        else:
            ids = list(prompt)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        return ids

    async def encode(self, prompt, tenant: str | None = None) -> list[int]:
        if isinstance(prompt, list):  # token ids: nothing to compute
            return self._encode(prompt)
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the tokenizer worker is closed")
            queue = self._queues.setdefault(tenant, deque())
            if not queue:
                self._turns.append(tenant)
            queue.append((prompt, loop, fut))
            self._cond.notify()
        return await fut

    def _next_job(self):
        """The next tenant's oldest prompt; the tenant goes to the back of the line."""
        with self._cond:
            while not self._turns and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            tenant = self._turns.popleft()
            queue = self._queues[tenant]
            job = queue.popleft()
            if queue:
                self._turns.append(tenant)
            else:
                del self._queues[tenant]
            return job

    def _work(self) -> None:
        while (job := self._next_job()) is not None:
            prompt, loop, fut = job
            if fut.cancelled():  # the client went away while it waited
                continue
            try:
                result, ok = self._encode(prompt), True
            except Exception as exc:  # noqa: BLE001 -- handed to the awaiting request
                result, ok = exc, False
            try:
                loop.call_soon_threadsafe(_settle, fut, ok, result)
            except RuntimeError:  # the request's event loop is closed
                pass

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()


def _settle(fut: asyncio.Future, ok: bool, result) -> None:
    if fut.done():
        return
    if ok:
        fut.set_result(result)
    else:
        fut.set_exception(result)
