"""The operator's side of the gateway: the upstream's tokens, a keyed trail, the detector.

The gateway is the one place that sees every tenant's traffic *before* the engines do, so it
is where an operator can watch for probing even when the engines are someone else's code.
Three pieces, each borrowed from the rest of minikv rather than rebuilt:

* **The upstream's tokens** (:class:`PromptTokens`).  Fingerprints must cut prompts into
  exactly the blocks the upstream caches, so they use the upstream model's tokenizer (and
  chat template) and the upstream's block size -- 128 tokens on vLLM's CPU build, 16 by
  default on minikv.  A different tokenizer would cut different blocks and the detector would
  see groups that do not exist, or miss the ones that do.
* **The trail** is :class:`minikv.audit.trail.AuditTrail`: one ``summary`` record per request
  with the tenant, counts, and *keyed* fingerprints of each block-aligned prefix
  (``HMAC(operator key, ...)``), never prompt text or token ids.  The operator key is derived
  from the gateway secret with :func:`minikv.security.keys.derive_operator_key`, so somebody
  who reads the log cannot hash a guessed prompt and look for it.
* **The detector** is :func:`minikv.audit.detector.detect`, the same as ``minikv audit
  detect``: run it over the gateway's file, or ask the live gateway (``GET /admin/findings``,
  operator key) to run it over its recent records.  A gateway cannot see cross-tenant cache
  hits inside an engine (those need the engine's own trail), but the probing pattern -- one
  tenant enumerating continuations of one prefix -- is visible from here.
"""
from __future__ import annotations

import itertools
from collections import deque
from pathlib import Path

from ..audit.detector import detect
from ..audit.trail import AuditTrail
from ..security.keys import derive_operator_key


class PromptTokens:
    """Token ids of a request's prompt as the upstream will see them."""

    def __init__(self, model_dir: str | Path):
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def completion(self, prompt) -> list[int]:
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if not isinstance(prompt, str):
            raise ValueError("'prompt' must be a string, a list of token ids, or a list with one string")
        return list(self.tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def chat(self, messages) -> list[int]:
        if not isinstance(messages, list) or not messages:
            raise ValueError("'messages' must be a non-empty list")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("content"), (str, list)):
                raise ValueError(f"messages[{i}] must be an object with string content")
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return [int(t) for t in (ids["input_ids"] if hasattr(ids, "keys") else ids)]   # BatchEncoding or list

    def of_body(self, body: dict, chat: bool) -> list[int]:
        return self.chat(body.get("messages")) if chat else self.completion(body.get("prompt"))


class _Seq:
    """What :meth:`AuditTrail.prefix_fingerprints` and a summary record need of a request."""

    def __init__(self, request_id: str, tenant: str, token_ids: list[int]):
        self.request_id, self.tenant, self.prompt_token_ids = request_id, tenant, token_ids
        self.num_prompt_tokens = len(token_ids)


class GatewayTrail:
    """One ``summary`` record per request, on disk (``path``) and in a bounded memory window."""

    def __init__(self, secret: bytes, block_size: int, path: str | Path | None = None,
                 window: int = 10_000, threshold: int = 8):
        self.block_size, self.threshold = block_size, threshold
        self.trail = AuditTrail(path, derive_operator_key(secret), block_size, engine="gateway")
        self.recent: deque = deque(maxlen=window)
        self._ids = itertools.count()

    def record(self, tenant: str, token_ids: list[int], *, upstream: int, status: int,
               cached_tokens: int | None) -> None:
        fps, tail = self.trail.prefix_fingerprints(token_ids)
        rec = dict(request_id=f"gw-{next(self._ids)}", tenant=tenant, num_prompt_tokens=len(token_ids),
                   prefix_fps=fps, tail_fp=tail, upstream=upstream, status=status,
                   cached_tokens=cached_tokens, cross_tenant_hits=[])
        self.trail.record("summary", **rec)
        self.recent.append({"event": "summary", **rec})

    def findings(self) -> list:
        """The detector over the recent window (probing; no cross-tenant hits are visible here)."""
        return detect(list(self.recent), threshold=self.threshold, block_size=self.block_size)

    def close(self) -> None:
        self.trail.close()
