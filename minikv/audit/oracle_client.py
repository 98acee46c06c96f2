"""The outside view of one server's cache: an HTTP client for the attack labs (lessons 04, 09).

:class:`OracleClient` holds a base URL and an API key -- exactly what a real attacker has --
and sends ``/v1/completions`` requests with ``max_tokens=1``.  It has no path to the server's
engine, pool or block manager: those live in another process (``minikv.grading.lab_server``).

The lab card (``client.card``) tells you what an attacker would know about the victim's
prompt: ``prefix`` and ``suffix`` around the secret, ``secret_len`` characters drawn from
``alphabet``, the server's ``block_size`` and the per-tenant ``quota_blocks`` of cached blocks.
The lab model's tokenizer is byte-level: one ASCII character is one token.
"""
from __future__ import annotations

import httpx


class OracleClient:
    """``cached_tokens(text)`` (lab a) or ``ttft_ms(text)`` (lab b) for one prompt; counts requests."""

    def __init__(self, card: dict, timeout: float = 60.0):
        self.card = dict(card)
        self.requests = 0
        self._http = httpx.Client(base_url=card["base_url"], timeout=timeout,
                                  headers={"Authorization": f"Bearer {card['api_key']}"})

    def _usage(self, text: str) -> dict:
        if not isinstance(text, str) or not text:
            raise ValueError(f"a probe must be a non-empty str, got {text!r}")
        r = self._http.post("/completions", json={"model": self.card.get("model", "tiny"), "prompt": text,
                                                  "max_tokens": 1, "temperature": 0})
        self.requests += 1
        r.raise_for_status()
        return r.json()["usage"]

    def cached_tokens(self, text: str) -> int:
        """How many leading tokens of ``text`` the server took from its prefix cache."""
        u = self._usage(text)
        if "prompt_tokens_details" not in u:
            raise RuntimeError("this server does not report cached_tokens (a timing lab): use ttft_ms")
        return int(u["prompt_tokens_details"]["cached_tokens"])

    def ttft_ms(self, text: str) -> float:
        """Time to first token of ``text`` in milliseconds, as the server's clock saw it."""
        u = self._usage(text)
        if "ttft_ms" not in u:
            raise RuntimeError("this server reports no ttft_ms (a count lab): use cached_tokens")
        return float(u["ttft_ms"])

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
