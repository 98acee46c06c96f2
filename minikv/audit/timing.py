"""Timing audit of any OpenAI-compatible endpoint, following Gu et al. (ICML 2025), Section 3.

The question: if another customer (the "victim") sent a prompt, can I (the "attacker") tell,
from response times alone, that the server cached it?  If yes, the provider shares its prompt
cache across the two keys, and the attacker can test guesses about other customers' prompts.

Protocol (one audit = ``n_samples`` hit trials + ``n_samples`` miss trials):

1. **hit trial**: the victim key sends a fresh random prompt ``victim_requests`` times (priming),
   then the attacker key sends a prompt whose first ``prefix_fraction`` of words equal the
   victim's (1.0 = the same prompt) and times it.  Only the attacker's request is a sample.
2. **miss trial**: the attacker sends a fresh random prompt nobody has sent before.
3. Hit and miss trials are **shuffled** together, so slow drifts in server load (time of day,
   other traffic) hit both arms alike instead of masquerading as a cache effect.
4. Every request asks for ``max_tokens=1`` at temperature 0: the latency is then dominated by the
   prefill, which is exactly what a prefix cache skips, and decoding noise is minimal.
5. Client time = ``time.perf_counter()`` around the whole HTTP round trip, as in the paper: an
   attacker sees nothing else.  Verdict: one-sided KS at alpha = 1e-8 plus ROC AUC
   (``minikv.audit.stats``).

Without ``victim_key`` the attacker primes its own prompts: that only tests *per-user* caching
(a cache exists and is observable), not sharing.

``prime_url`` sends every priming request to *another* instance, while the probes and misses time
``base_url``: that audits a fleet sharing a KV tier (``minikv serve --kv-tier redis://...``).  With
a victim key, a detection means the victim's blocks, cached through the other instance, speed up
the attacker here (LMCache #4825's salt-drop); without one it is the same-tenant control, which
must be positive for a negative cross-tenant verdict to mean anything.

Prompts are random sequences of common English words; in GPT-2/Llama-style BPE vocabularies each
is about one token.  A byte-level tokenizer spends several tokens per word, so the warm-up request
(``WARMUP_WORDS`` words) calibrates: when the server reports ``usage.prompt_tokens`` the word count
is scaled to land near ``prompt_tokens`` tokens (a chat template's few extra tokens make prompts
slightly shorter than asked; harmless).  Without ``usage`` one word = one token.  The trial
order is reproducible from ``seed``, but the words are salted per run (``prompt_salt``): a rerun
that re-sent the same "miss" prompts would find them cached from the previous run.  Gu et al.
used 5000-token prompts and 250 samples per arm; the defaults (512 tokens, 25 per arm) fit a CPU
server and still clear the 15-per-arm floor below which no verdict is possible.

The prompt words, pacing and the timed HTTP client live in :mod:`minikv.audit.timing_client`.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from .stats import GU_ALPHA, AuditResult, audit_samples, min_samples_for
from .timing_client import Client, Pacer, TimingAuditError, random_words

WARMUP_WORDS = 64


@dataclass(frozen=True)
class TimingPlan:
    """What an audit would send (``dry_run``): nothing is sent to build this."""

    base_url: str
    endpoint: str
    n_samples: int
    victim_requests: int
    prompt_tokens: int
    n_requests: int
    approx_prompt_tokens: int
    separate_victim: bool
    prime_url: str | None = None

    def describe(self) -> str:
        who = "a separate victim key" if self.separate_victim else "the attacker key itself (per-user test)"
        where = f" (primes to {self.prime_url})" if self.prime_url else ""
        return (f"dry run: would send {self.n_requests} requests (~{self.approx_prompt_tokens:,} prompt "
                f"tokens, max_tokens=1 each) to {self.base_url} ({self.endpoint}){where}; "
                f"{self.n_samples} hit + {self.n_samples} miss trials, priming by {who}")


def plan_timing_audit(base_url: str, n_samples: int = 25, prompt_tokens: int = 512,
                      victim_requests: int = 1, endpoint: str = "completions",
                      victim_key: str | None = None, model: str | None = None,
                      prime_url: str | None = None) -> TimingPlan:
    """Count requests and prompt tokens: one warm-up, then per hit trial ``victim_requests`` primes
    plus the probe, per miss trial one request (+1 GET /models when the model must be discovered)."""
    n_req = 1 + n_samples * (victim_requests + 1) + n_samples + (model is None)
    tokens = WARMUP_WORDS + n_samples * (victim_requests + 1) * prompt_tokens + n_samples * prompt_tokens
    return TimingPlan(base_url, endpoint, n_samples, victim_requests, prompt_tokens, n_req, tokens,
                      victim_key is not None, prime_url)


def _separate(api_key: str, victim_key: str | None) -> bool:
    """A victim key equal to the attacker's tests per-user caching, not sharing."""
    return victim_key is not None and victim_key != api_key


@dataclass
class TimingReport:
    """Samples, statistics and verdict of one timing audit.  API keys are never stored."""

    base_url: str
    model: str
    endpoint: str
    separate_victim: bool
    n_samples: int
    prompt_tokens: int
    prefix_fraction: float
    victim_requests: int
    seed: int
    prompt_salt: str
    words_per_prompt: int  # after calibration against the server's token count
    hit_times: list[float]
    miss_times: list[float]
    result: AuditResult
    failures: int = 0
    elapsed_s: float = 0.0
    n_requests: int = 0
    notes: list[str] = field(default_factory=list)
    prime_url: str | None = None  # where the priming went, when not to base_url

    @property
    def detected(self) -> bool:
        return self.result.detected

    @property
    def verdict(self) -> str:
        r = self.result
        nums = f"p={r.p_value:.3g}, AUC={r.auc:.3f}"
        where = f" across instances (primed via {self.prime_url})" if self.prime_url else ""
        if self.separate_victim:
            if r.detected:
                return f"CACHE SHARING DETECTED between attacker and victim{where} ({nums})"
            return f"no evidence of sharing between attacker and victim{where} ({nums}; not a proof of isolation)"
        if r.detected:
            return (f"PROMPT CACHING DETECTED for the attacker's own prompts{where} "
                    f"(per-user; no victim key tested) ({nums})")
        return f"no evidence of prompt caching, even for the attacker's own prompts{where} ({nums})"

    def to_dict(self) -> dict:
        d = asdict(self)  # recurses into the AuditResult
        d["verdict"] = self.verdict
        d["detected"] = self.detected
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def save_plot(self, path: str | os.PathLike) -> None:
        """Histogram + ECDF of hit vs miss latencies, verdict in the title (Agg, no pyplot state)."""
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        import numpy as np

        hit = np.asarray(self.hit_times) * 1e3
        miss = np.asarray(self.miss_times) * 1e3
        fig = Figure(figsize=(10, 4.2))
        FigureCanvasAgg(fig)
        ax1, ax2 = fig.subplots(1, 2)
        bins = np.linspace(min(hit.min(), miss.min()), max(hit.max(), miss.max()), 30)
        ax1.hist(miss, bins=bins, alpha=0.6, label=f"miss (n={miss.size})", color="tab:red")
        ax1.hist(hit, bins=bins, alpha=0.6, label=f"hit candidate (n={hit.size})", color="tab:blue")
        ax1.set_xlabel("client time (ms)")
        ax1.set_ylabel("requests")
        ax1.legend()
        for arr, lab, col in ((hit, "hit candidate", "tab:blue"), (miss, "miss", "tab:red")):
            xs = np.sort(arr)
            ax2.step(xs, np.arange(1, xs.size + 1) / xs.size, where="post", label=lab, color=col)
        ax2.set_xlabel("client time (ms)")
        ax2.set_ylabel("ECDF")
        ax2.set_title(f"KS statistic {self.result.ks_stat:.2f} (max vertical gap)", fontsize=9)
        ax2.legend()
        fig.suptitle(f"{self.model} @ {self.base_url}\n{self.verdict}", fontsize=9)
        fig.tight_layout()
        fig.savefig(path, dpi=110)


def run_timing_audit(base_url: str, api_key: str, victim_key: str | None = None,
                     model: str | None = None, n_samples: int = 25, prompt_tokens: int = 512,
                     prefix_fraction: float = 1.0, endpoint: str = "completions",
                     rate_limit: float | None = None, seed: int = 0, progress: bool = True,
                     victim_requests: int = 1, alpha: float = GU_ALPHA, dry_run: bool = False,
                     prompt_salt: str | None = None, timeout: float = 120.0,
                     max_failures: int | None = None, prime_url: str | None = None) -> TimingReport | TimingPlan:
    """Run the audit (see module docstring).  ``dry_run=True`` returns a TimingPlan, sends nothing.

    ``base_url`` is the OpenAI-style root that ends in ``/v1``.  Transient failures (5xx, 429,
    network) drop that trial; more than ``max_failures`` (default 10% of trials) abort with
    TimingAuditError, as does any other 4xx (bad key, unknown model) at once.
    ``prime_url``: send the priming requests to this other instance (see the module docstring).
    """
    if n_samples < 1 or prompt_tokens < 1 or victim_requests < 1:
        raise ValueError("n_samples, prompt_tokens and victim_requests must all be >= 1")
    if not (0.0 < prefix_fraction <= 1.0):
        raise ValueError(f"prefix_fraction must be in (0, 1], got {prefix_fraction}")
    if prime_url is not None and not str(prime_url).startswith(("http://", "https://")):
        raise ValueError(f"prime_url must be an http(s) API root ending in /v1, got {prime_url!r}")
    plan = plan_timing_audit(base_url, n_samples, prompt_tokens, victim_requests, endpoint,
                             victim_key if _separate(api_key, victim_key) else None, model, prime_url)
    if dry_run:
        return plan
    notes = []
    if n_samples < min_samples_for(alpha):
        notes.append(f"{n_samples} samples per arm cannot reach p < {alpha:g} even with perfect "
                     f"separation (need >= {min_samples_for(alpha)}); the verdict is necessarily negative")
    salt = prompt_salt if prompt_salt is not None else os.urandom(8).hex()
    order = ["hit"] * n_samples + ["miss"] * n_samples
    random.Random(seed).shuffle(order)
    words_rng = random.Random(f"{seed}:{salt}")
    max_failures = max(1, len(order) // 10) if max_failures is None else max_failures
    client = Client(base_url, endpoint, model, Pacer(rate_limit), timeout, max_failures)
    primer = Client(prime_url, endpoint, model, client.pacer, timeout, max_failures) if prime_url else client
    victim = victim_key if victim_key is not None else api_key
    hits: list[float] = []
    misses: list[float] = []
    t_start = time.perf_counter()
    try:
        if client.model is None:
            client.model = client.discover_model(api_key)
        primer.model = client.model  # one fleet, one model
        # Warm-up: opens the keep-alive connection so no trial pays the TCP/TLS handshake,
        # and tells us how many tokens the server's tokenizer makes of our words.
        client.timed(api_key, " ".join(random_words(words_rng, WARMUP_WORDS)), strict=True)
        per_word = (client.last_prompt_tokens or WARMUP_WORDS) / WARMUP_WORDS
        n_words = max(1, round(prompt_tokens / max(per_word, 1e-3)))
        n_shared = max(1, round(prefix_fraction * n_words))
        trials = order
        if progress:
            from tqdm import tqdm
            trials = tqdm(order, desc="timing audit", unit="trial", file=sys.stderr)
        for kind in trials:
            words = random_words(words_rng, n_words)
            if kind == "miss":
                dt = client.timed(api_key, " ".join(words))
                if dt is not None:
                    misses.append(dt)
                continue
            for _ in range(victim_requests):
                primer.timed(victim, " ".join(words))
            probe = words[:n_shared] + random_words(words_rng, n_words - n_shared)
            dt = client.timed(api_key, " ".join(probe))
            if dt is not None:
                hits.append(dt)
    finally:
        client.http.close()
        primer.http.close()
    if not hits or not misses:
        raise TimingAuditError("no successful hit or miss samples; nothing to analyse")
    return TimingReport(
        base_url=base_url, model=client.model, endpoint=endpoint, separate_victim=_separate(api_key, victim_key),
        n_samples=n_samples, prompt_tokens=prompt_tokens, prefix_fraction=prefix_fraction,
        victim_requests=victim_requests, seed=seed, prompt_salt=salt, words_per_prompt=n_words, hit_times=hits, miss_times=misses,
        result=audit_samples(hits, misses, alpha=alpha),
        failures=sum(c.failures for c in {client, primer}),
        elapsed_s=time.perf_counter() - t_start, n_requests=sum(c.sent for c in {client, primer}),
        notes=notes, prime_url=prime_url,
    )
