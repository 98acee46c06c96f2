"""Per-tenant limits: one tenant must not be able to starve the others.

The engine is one shared resource: one batch, one KV pool, one engine thread, one tokenizer
thread, one event loop.  A tenant that floods it -- even with requests that are rejected anyway
-- slows every other tenant's tokens: a few connections sending oversized bodies in a loop,
each answered with a 400, are enough to stretch another tenant's gaps between streamed tokens
many times over (docs/BENCHMARKS.md has the measurement).

So every request passes the checks below, *cheapest first*, and is refused as early as possible:

1. **request rate** (a token bucket per tenant: ``requests_per_s`` sustained, ``burst`` at once),
   checked right after the API key, *before the body is read*;
2. **concurrency**: at most ``max_concurrent`` requests of a tenant are being served at once,
   and at most ``max_queued`` more wait for a slot -- also before the body is read, so one
   tenant can never have more than ``max_concurrent + max_queued`` bodies in memory;
3. **decode budget**: the ``max_tokens`` of a tenant's admitted requests add up to at most
   ``max_tokens_in_flight``, which bounds how much decoding (and KV cache) one tenant can hold.

Over a limit is HTTP 429 with ``Retry-After`` (seconds), the status clients already back off on.
A request that could *never* fit (``max_tokens`` above the whole budget) is a 400 instead:
retrying it would be pointless.

What this does not do: an attacker with many accounts gets many budgets.  Per-tenant limits
bound what one identity can do; only a global admission policy (and the fair-share scheduler in
:mod:`minikv.engine.scheduler`) bound what many can.

Everything here runs on the event loop thread, so it needs no locks.
"""
from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, field
from typing import Callable


@dataclass(frozen=True)
class ServeLimits:
    """Limits of one server.  ``None`` turns a per-tenant limit off.

    Per tenant
        requests_per_s / burst: token-bucket request rate.
        max_concurrent: requests served at once (the rest wait, up to ``max_queued``).
        max_queued: requests waiting for a slot (0: none wait, a busy tenant gets 429 at once).
        max_tokens_in_flight: sum of ``max_tokens`` over the tenant's admitted requests.
    Per request (checked in :mod:`minikv.serve.protocol`, before tokenization)
        max_body_bytes: request body size (413 above it).
        max_prompt_chars: characters of a prompt, or of all messages of a chat together
            (None: 16 characters per token of the model's context).
        max_messages: messages in one chat request.
    """

    requests_per_s: float | None = 50.0
    burst: int = 100
    max_concurrent: int | None = 16
    max_queued: int | None = 64
    max_tokens_in_flight: int | None = 65536
    max_body_bytes: int = 1 << 20
    max_prompt_chars: int | None = None
    max_messages: int = 256

    def __post_init__(self) -> None:
        for name in ("requests_per_s", "max_concurrent", "max_queued", "max_tokens_in_flight"):
            value = getattr(self, name)
            if value is not None:
                _check_number(name, value, allow_float=name == "requests_per_s", allow_zero=name == "max_queued")
        for name in ("burst", "max_body_bytes", "max_messages"):
            _check_number(name, getattr(self, name), allow_float=False)
        if self.max_prompt_chars is not None:
            _check_number("max_prompt_chars", self.max_prompt_chars, allow_float=False)

    def prompt_chars(self, max_model_len: int) -> int:
        """The prompt cap in force for a model with this context: ``max_prompt_chars``, or 16
        characters per context token (a prompt that fits has fewer tokens than the context, and
        even code full of long whitespace runs averages well under 16 characters per token)."""
        return self.max_prompt_chars or 16 * max_model_len


def _check_number(name: str, value, allow_float: bool, allow_zero: bool = False) -> None:
    kinds = (int, float) if allow_float else (int,)
    if isinstance(value, bool) or not isinstance(value, kinds):
        raise TypeError(f"{name} must be {'a number' if allow_float else 'an int'}, got {value!r}")
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be finite and {'>=' if allow_zero else '>'} 0, got {value!r}")


class TooManyRequests(Exception):
    """Over a per-tenant limit: HTTP 429 with ``Retry-After: retry_after`` (whole seconds)."""

    def __init__(self, message: str, retry_after: float, limit: str):
        super().__init__(message)
        self.retry_after = max(1, math.ceil(retry_after))
        self.limit = limit


@dataclass
class _Tenant:
    tokens: float
    updated: float
    active: int = 0
    queued: int = 0
    tokens_in_flight: int = 0
    slot_freed: asyncio.Event = field(default_factory=asyncio.Event)


class TenantLimiter:
    """The state behind :class:`ServeLimits`, one record per tenant seen."""

    def __init__(self, limits: ServeLimits, clock=time.monotonic):
        self.limits, self._clock = limits, clock
        self._tenants: dict[str, _Tenant] = {}

    def _get(self, tenant: str) -> _Tenant:
        st = self._tenants.get(tenant)
        if st is None:
            st = self._tenants[tenant] = _Tenant(tokens=float(self.limits.burst), updated=self._clock())
        return st

    def check_rate(self, tenant: str) -> None:
        """Take one token from the tenant's bucket, or raise :class:`TooManyRequests`."""
        rate = self.limits.requests_per_s
        if rate is None:
            return
        st, now = self._get(tenant), self._clock()
        st.tokens = min(float(self.limits.burst), st.tokens + (now - st.updated) * rate)
        st.updated = now
        if st.tokens < 1.0:
            raise TooManyRequests(f"tenant request rate above {rate:g}/s", (1.0 - st.tokens) / rate, "rate")
        st.tokens -= 1.0

    async def acquire(self, tenant: str) -> "Lease":
        """Wait for one of the tenant's ``max_concurrent`` slots (or refuse if ``max_queued``
        requests already wait).  Release the returned lease when the request ends."""
        lim, st = self.limits, self._get(tenant)
        if lim.max_concurrent is not None and st.active >= lim.max_concurrent:
            if lim.max_queued is not None and st.queued >= lim.max_queued:
                raise TooManyRequests(f"tenant has {st.active} requests running and {st.queued} queued "
                                      f"(limits {lim.max_concurrent} and {lim.max_queued})", 1.0, "queue")
            st.queued += 1
            try:
                while st.active >= lim.max_concurrent:
                    st.slot_freed.clear()
                    await st.slot_freed.wait()
            finally:
                st.queued -= 1
        st.active += 1
        return Lease(self, tenant)

    def _reserve_tokens(self, tenant: str, n: int) -> None:
        budget = self.limits.max_tokens_in_flight
        if budget is None:
            return
        if n > budget:
            raise ValueError(f"max_tokens={n} is above this server's per-tenant budget of {budget} tokens")
        st = self._get(tenant)
        if st.tokens_in_flight + n > budget:
            raise TooManyRequests(f"tenant has {st.tokens_in_flight} max_tokens in flight; "
                                  f"{n} more would exceed its budget of {budget}", 1.0, "tokens")
        st.tokens_in_flight += n

    def snapshot(self, tenant: str) -> dict:
        st = self._get(tenant)
        return {"active": st.active, "queued": st.queued, "tokens_in_flight": st.tokens_in_flight}


class Lease:
    """One admitted request's slot (and, after :meth:`reserve`, its share of the decode budget)."""

    def __init__(self, limiter: TenantLimiter, tenant: str):
        self._limiter, self.tenant = limiter, tenant
        self._tokens = 0
        self._released = self._handed_off = False

    def reserve(self, max_tokens: int) -> None:
        """Count ``max_tokens`` against the tenant's budget (ValueError / TooManyRequests)."""
        self._limiter._reserve_tokens(self.tenant, max_tokens)
        if self._limiter.limits.max_tokens_in_flight is not None:
            self._tokens = max_tokens

    def hand_off(self) -> Callable[[], None]:
        """Pass the duty to release on to whatever outlives the handler (a streaming response,
        which ends after the handler returned): returns :meth:`release`, for its ``on_close``."""
        self._handed_off = True
        return self.release

    def close(self) -> None:
        """The handler is done: release the slot, unless it was handed off."""
        if not self._handed_off:
            self.release()

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        st = self._limiter._get(self.tenant)
        st.active -= 1
        st.tokens_in_flight -= self._tokens
        st.slot_freed.set()
