"""Does the upstream honour the salt?  The gateway's start-up check, a *paired* probe.

Putting a salt into every request protects nobody if the upstream ignores it: an engine
started without prefix caching, an old vLLM without ``cache_salt``, a proxy in between that
drops unknown fields, an offload tier that forgets the salt (LMCache's SGLang path did, its
issue #4825).  So before serving anyone, the gateway asks the upstream itself:

1. send a fresh prompt with salt A (prime), then the same prompt with salt A again;
2. send it with salt B.

The upstream honours the salt when the repeat with A **hits** and the request with B does
**not**.  Both halves are needed -- that is what "paired" means: "B did not hit" alone is
also what an upstream with caching switched off says, and there a salt isolates nothing
because nothing is shared in the first place; the check would pass while telling us nothing.

How "hit" is observed: ``usage.prompt_tokens_details.cached_tokens`` where the upstream
reports it (vLLM with ``--enable-prompt-tokens-details``, ``minikv serve
--report-cached-tokens``); otherwise timing, over several fresh prompts: a hit skips the
prefill, so the repeat with A must be clearly faster than the request with B in most trials.

Prompts are random token ids (the OpenAI API accepts a list of ids), never sent before, so no
earlier traffic can fake a hit.  The same counts also reveal the upstream's KV block size:
a repeated prompt of ``n`` tokens hits ``floor(n / B) * B`` of them (n - 1 is no multiple of
16 here), and two lengths, 473 and 489 tokens, tell 16, 32, 64, 128 and 256 apart.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

PROBE_LENGTHS = (473, 489)
BLOCK_SIZES = (16, 32, 64, 128, 256)
TOKEN_RANGE = (32, 250)   # byte-level ids: in every vocabulary here (tiny-random has 259), no specials


class UnverifiedUpstream(RuntimeError):
    """The upstream failed the probe (or could not be asked): the gateway refuses to start."""


@dataclass
class ProbeResult:
    upstream: str
    method: str                     # "cached_tokens" or "timing"
    same_salt_hit: bool
    other_salt_hit: bool
    block_size: int | None
    details: dict = field(default_factory=dict)

    @property
    def verified(self) -> bool:
        return self.same_salt_hit and not self.other_salt_hit

    def describe(self) -> str:
        verdict = "honours the salt" if self.verified else "does NOT isolate by salt" \
            if self.other_salt_hit else "shows no cache hits at all (caching off?)"
        return (f"{self.upstream}: {verdict} (by {self.method}; same salt hit={self.same_salt_hit}, "
                f"other salt hit={self.other_salt_hit}, block size={self.block_size}; {self.details})")


def infer_block_size(counts: dict[int, int]) -> int | None:
    """The one block size B with ``cached == floor(n / B) * B`` for every (n, cached), or None."""
    fits = [b for b in BLOCK_SIZES if all(c == (n // b) * b for n, c in counts.items())]
    return fits[0] if len(fits) == 1 else None


class Prober:
    """Sends the probe requests to one upstream (salt in the body, and as a header if asked)."""

    def __init__(self, upstream: str, model: str, upstream_key: str | None = None,
                 salt_header: bool = False, timeout: float = 120.0, seed: int | None = None):
        self.base, self.model, self.salt_header = upstream.rstrip("/"), model, salt_header
        self.headers = {"Authorization": f"Bearer {upstream_key}"} if upstream_key else {}
        self.http = httpx.Client(timeout=timeout)
        self.rng = random.Random(seed)

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(*TOKEN_RANGE) for _ in range(n)]

    def send(self, ids: list[int], salt: str) -> tuple[int | None, float]:
        """(cached_tokens or None, seconds) of one request with ``salt``."""
        headers = dict(self.headers, **({"X-Cache-Salt": salt} if self.salt_header else {}))
        body = {"model": self.model, "prompt": ids, "max_tokens": 1, "temperature": 0, "cache_salt": salt}
        t0 = time.perf_counter()
        try:
            r = self.http.post(f"{self.base}/completions", json=body, headers=headers)
        except httpx.HTTPError as exc:
            raise UnverifiedUpstream(f"cannot reach {self.base}: {type(exc).__name__}: {exc}") from None
        dt = time.perf_counter() - t0
        if r.status_code != 200:
            raise UnverifiedUpstream(f"{self.base}/completions answered the probe with HTTP "
                                     f"{r.status_code}: {r.text[:200]}")
        cached = ((r.json().get("usage") or {}).get("prompt_tokens_details") or {}).get("cached_tokens")
        return (cached if isinstance(cached, int) else None), dt

    def close(self) -> None:
        self.http.close()


def probe_upstream(upstream: str, model: str, upstream_key: str | None = None, *, salt_header: bool = False,
                   timing_trials: int = 7, seed: int | None = None, timeout: float = 120.0) -> ProbeResult:
    """Run the paired probe against ``upstream`` (an API root ending in /v1); see the module doc."""
    p = Prober(upstream, model, upstream_key, salt_header, timeout, seed)
    salt_a, salt_b = (f"probe-{p.rng.getrandbits(128):032x}" for _ in range(2))
    try:
        ids = p.fresh(PROBE_LENGTHS[0])
        p.send(ids, salt_a)
        same, _ = p.send(ids, salt_a)
        other, _ = p.send(ids, salt_b)
        if same is not None and other is not None:
            ids2 = p.fresh(PROBE_LENGTHS[1])
            p.send(ids2, salt_a)
            same2, _ = p.send(ids2, salt_a)
            block = infer_block_size({PROBE_LENGTHS[0]: same, PROBE_LENGTHS[1]: same2})
            return ProbeResult(upstream, "cached_tokens", same > 0, other > 0, block,
                               {"cached_same_salt": same, "cached_other_salt": other})
        # No cached_tokens: time fresh prompts, repeat (A) against other salt (B), paired per trial.
        faster, ratios = 0, []
        for _ in range(timing_trials):
            ids = p.fresh(PROBE_LENGTHS[0])
            p.send(ids, salt_a)
            _, t_same = p.send(ids, salt_a)
            _, t_other = p.send(ids, salt_b)
            faster += t_same < t_other
            ratios.append(t_other / max(t_same, 1e-9))
        ratio = statistics.median(ratios)
        same_hit = faster >= timing_trials - 1 and ratio > 1.3
        # If the repeat is fast, B is a miss exactly when it is slow (the pairing above); if the
        # repeat is not fast, nothing was observable and other_salt_hit stays unknown -> False.
        return ProbeResult(upstream, "timing", same_hit, False, None,
                           {"trials": timing_trials, "repeat_faster": faster, "median_ratio": round(ratio, 2)})
    finally:
        p.close()


def check_public_prefix(upstream: str, model: str, prefix_ids: list[int], block_size: int,
                        upstream_key: str | None = None, salt_header: bool = False) -> int:
    """Cached tokens that a *different* salt gets from a public prefix another salt primed.

    A minikv upstream started with ``--shared-prefix TEXT`` shares the whole blocks of that
    prefix across tenants (and salts); vLLM 0.32 cannot, because it mixes the salt into block
    0.  Returns the count (>= one block when the upstream shares it)."""
    p = Prober(upstream, model, upstream_key, salt_header)
    try:
        p.send(prefix_ids + p.fresh(block_size + 3), "public-probe-a")
        cached, _ = p.send(prefix_ids + p.fresh(block_size + 3), "public-probe-b")
        return cached or 0
    finally:
        p.close()
