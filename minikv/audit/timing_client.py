"""The timing audit's client side: random prompts, request pacing, and one timed request.

What :func:`~minikv.audit.timing.run_timing_audit` measures is only as good as these pieces:

* **Prompts** are random runs of short common words, drawn from a per-run salted generator, so
  no prompt of an audit was ever sent before (a rerun would otherwise find its "miss" prompts
  cached by the previous run) and none collides with another by chance.
* **Pacing** (:class:`Pacer`) spaces request *starts*, never their ends: the audit respects a
  provider's rate limit without the sleep landing inside a measured interval.
* **Timing** (:class:`Client`) is ``time.perf_counter()`` around the whole HTTP round trip on a
  kept-alive connection -- all an attacker sees, measured the way Gu et al. measured it.  A
  transient failure (5xx, 429, network) drops a trial; a client error (bad key, unknown model)
  stops the audit at once, because every later request would fail the same way.
"""
from __future__ import annotations

import math
import random
import time
from typing import Callable

import httpx

# Short common words; with a leading space each is a single token in GPT-2/Llama-style BPEs.
# 123 words make 123**16 (~3e33) different 16-word runs: random prompts never collide by chance.
_WORDS = (
    "the of and to in is was for on are with as be at by this have from or one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she "
    "many some so these would other into has more her two like him see time could no make than first "
    "been its who now people my made over did down only way find use may water long little very after "
    "words called just where most know get through back much before go good new write our used me man "
    "too any day same right look think also around another came come work three word must because does"
).split()


def random_words(rng: random.Random, n: int) -> list[str]:
    return [rng.choice(_WORDS) for _ in range(n)]


class TimingAuditError(RuntimeError):
    """The endpoint refused or failed too many requests for a meaningful audit."""


class Pacer:
    """Keeps request *starts* at least ``1/rate`` seconds apart (None = unlimited)."""

    def __init__(self, rate: float | None, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep):
        if rate is not None and rate <= 0:
            raise ValueError(f"rate_limit must be positive, got {rate}")
        self.interval = 0.0 if rate is None else 1.0 / rate
        self.clock, self.sleep, self.next_t = clock, sleep, -math.inf

    def wait(self) -> None:
        now = self.clock()
        if now < self.next_t:
            self.sleep(self.next_t - now)
            now = self.next_t
        self.next_t = now + self.interval


class Client:
    """Sends one completion request per call and returns its client-side latency in seconds."""

    def __init__(self, base_url: str, endpoint: str, model: str | None, pacer: Pacer,
                 timeout: float, max_failures: int):
        if endpoint not in ("completions", "chat"):
            raise ValueError(f"endpoint must be 'completions' or 'chat', got {endpoint!r}")
        self.base = base_url.rstrip("/")
        self.endpoint, self.model, self.pacer = endpoint, model, pacer
        self.http = httpx.Client(timeout=timeout)
        self.failures, self.max_failures, self.sent = 0, max_failures, 0
        self.last_prompt_tokens: int | None = None  # usage.prompt_tokens of the last success

    def discover_model(self, key: str) -> str:
        self.pacer.wait()
        self.sent += 1
        try:
            r = self.http.get(f"{self.base}/models", headers={"Authorization": f"Bearer {key}"})
            return r.raise_for_status().json()["data"][0]["id"]
        except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
            raise TimingAuditError(f"cannot list models at {self.base}/models ({exc}); pass --model") from None

    def timed(self, key: str, prompt: str, strict: bool = False) -> float | None:
        """Latency of one request, or None for a transient failure (5xx, 429, network).

        ``strict`` (the warm-up) turns every failure into TimingAuditError: an endpoint that
        cannot answer the very first request is misconfigured, not flaky.
        """
        if self.endpoint == "chat":
            url, body = f"{self.base}/chat/completions", {"messages": [{"role": "user", "content": prompt}]}
        else:
            url, body = f"{self.base}/completions", {"prompt": prompt}
        body.update(model=self.model, max_tokens=1, temperature=0)
        self.pacer.wait()
        self.sent += 1
        try:
            t0 = time.perf_counter()
            r = self.http.post(url, json=body, headers={"Authorization": f"Bearer {key}"})
            dt = time.perf_counter() - t0
        except httpx.TransportError as exc:
            if strict:
                raise TimingAuditError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
            return self._fail(f"{type(exc).__name__}: {exc}")
        if (strict and r.status_code != 200) or (400 <= r.status_code < 500 and r.status_code != 429):
            raise TimingAuditError(f"POST {url} -> HTTP {r.status_code}: {r.text[:300]}")
        if r.status_code != 200:
            return self._fail(f"HTTP {r.status_code}")
        try:
            self.last_prompt_tokens = int(r.json()["usage"]["prompt_tokens"])
        except (ValueError, KeyError, TypeError):
            self.last_prompt_tokens = None
        return dt

    def _fail(self, why: str) -> None:
        self.failures += 1
        if self.failures > self.max_failures:
            raise TimingAuditError(f"{self.failures} failed requests (last: {why}); aborting the audit")
        return None
