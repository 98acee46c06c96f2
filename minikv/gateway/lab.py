"""Lesson 11's bench: a real vLLM (or a stand-in), a gateway in front, the attack, the cost.

Everything here talks plain HTTP to an OpenAI-compatible endpoint, so it runs unchanged
against vLLM straight, vLLM through ``minikv gateway``, or ``minikv serve``.

* :func:`find_upstream` -- the vLLM that ``make test`` / ``scripts/vllm_server.py start``
  left running (``out/vllm/server.json``), or, when there is none, ``minikv serve
  --trust-client-salt`` in this process as a stand-in.  The stand-in maps *every* API key to
  one tenant, which is what vLLM does (it has no tenants: all requests share one cache unless
  their salts differ).
* :func:`start_gateway` / :func:`minikv_upstream` -- the gateway, and ``minikv serve
  --trust-client-salt`` (optionally with a public ``--shared-prefix``), each in a thread.
* :func:`vault_attack` -- lesson 04's count oracle over HTTP: the victim's prompt holds a
  4-digit code; the attacker sends the same template with each candidate code and reads
  ``cached_tokens``.  The template puts the code inside the first KV block, so only the true
  code can hit that block (and the ones after it).
* :func:`hit_rate` -- the share of prompt tokens served from cache for a workload of tenants
  that share one system prompt: what per-tenant salting costs, and what a public prefix buys back.
"""
from __future__ import annotations

import json
import random
import secrets
from dataclasses import dataclass
from pathlib import Path

import httpx

from .probe import probe_upstream

STATE = Path(__file__).resolve().parents[2] / "out" / "vllm" / "server.json"
MODEL = "smollm2-135m-instruct"
FILLER = ("The quarterly report covers revenue, staffing, the new office lease and the audit of "
          "supplier contracts. ")


@dataclass
class Upstream:
    base_url: str
    kind: str              # "vllm" or "minikv (stand-in)"
    block_size: int
    server: object = None  # the in-process stand-in, to stop at the end

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop()


def find_upstream() -> Upstream:
    """The running vLLM, or ``minikv serve --trust-client-salt`` in this process (see module doc)."""
    try:
        url = json.loads(STATE.read_text())["base_url"]
        if httpx.get(url.removesuffix("/v1") + "/health", timeout=5).status_code == 200:
            return Upstream(url, "vllm", probe_upstream(url, MODEL, seed=0).block_size)
    except (OSError, ValueError, KeyError, httpx.HTTPError):
        pass
    names = ("victim", "victim-2", "attacker", "attacker-2", "gateway", "t0", "t1", "t2", "t3")
    srv = minikv_upstream({f"sk-{name}": "everyone" for name in names})
    return Upstream(srv.base_url, "minikv (stand-in)", probe_upstream(srv.base_url, MODEL, "sk-gateway",
                                                                      seed=0).block_size, srv)


def minikv_upstream(keys: dict, shared_prefixes: tuple = ()):
    """``minikv serve --trust-client-salt --report-cached-tokens`` on the course model, in a thread."""
    from ..llm import LLM
    from ..serve.app import create_app
    from ..serve.background import BackgroundServer

    llm = LLM(MODEL, enable_prefix_caching=True, shared_prefixes=tuple(shared_prefixes))
    app = create_app(llm, keys, model_name=MODEL, report_cached_tokens=True, trust_client_salt=True)
    return BackgroundServer(app).start()


def start_gateway(upstreams, keys: dict, *, model_dir=None, block_size: int = 16, trail_path=None,
                  limits=None, upstream_key: str | None = None, operator_keys: dict | None = None, **config):
    """``minikv gateway`` in a thread (no start-up probe: call :func:`probe_upstream` yourself).
    The returned server carries ``secret`` and ``trail`` for inspection."""
    from ..serve.auth import ApiKeys
    from ..serve.background import BackgroundServer
    from ..serve.limits import ServeLimits
    from .app import GatewayConfig, create_gateway_app
    from .oversight import GatewayTrail, PromptTokens
    from .salt import GatewayKeys

    secret = secrets.token_bytes(32)
    tokens = PromptTokens(model_dir) if model_dir is not None else None
    trail = GatewayTrail(secret, block_size, trail_path) if tokens is not None else None
    cfg = GatewayConfig(upstreams=tuple(upstreams), secret=secret, upstream_key=upstream_key,
                        limits=limits or ServeLimits(), prefix_tokens=block_size, **config)
    ops = ApiKeys(operator_keys) if operator_keys else None
    app = create_gateway_app(cfg, GatewayKeys(ApiKeys(keys), cfg.salt_scope), operator_keys=ops, tokens=tokens,
                             trail=trail)
    srv = BackgroundServer(app).start()
    srv.secret, srv.trail = secret, trail
    return srv


def post(base_url: str, key: str, prompt: str, max_tokens: int = 1) -> dict:
    r = httpx.post(f"{base_url}/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r.raise_for_status()
    return r.json()["usage"]


def cached(usage: dict) -> int:
    return (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def vault_prompt(code: str, nonce: str, block_size: int) -> str:
    """The code sits in the first tokens (block 0 at any block size), then a per-run nonce and
    about three blocks of filler: only the true code can hit block 0, and a hit is >= 1 block."""
    return f"Vault code {code}. [{nonce}] " + FILLER * (1 + 3 * block_size // len(FILLER.split()))


def vault_attack(base_url: str, victim_key: str, attacker_key: str, block_size: int, candidates: int = 10,
                 seed: int = 0) -> dict:
    """The victim stores its prompt; the attacker probes ``candidates`` codes once each."""
    rng = random.Random(seed)
    nonce = secrets.token_hex(4)          # fresh per run: nothing cached earlier can hit
    codes = [f"{n:04d}" for n in rng.sample(range(10_000), candidates)]
    secret = codes[rng.randrange(candidates)]
    post(base_url, victim_key, vault_prompt(secret, nonce, block_size))
    counts = {c: cached(post(base_url, attacker_key, vault_prompt(c, nonce, block_size))) for c in codes}
    best = max(counts, key=counts.get)
    return {"secret": secret, "guess": best if counts[best] > 0 else None, "counts": counts, "nonce": nonce}


def hit_rate(base_url: str, keys: list[str], system_prompt: str, rounds: int = 3, seed: int = 0) -> float:
    """Cached / prompt tokens over ``rounds`` requests per key: system prompt + a fresh question."""
    rng, total, hit = random.Random(seed), 0, 0
    nonce = secrets.token_hex(4)
    for r in range(rounds):
        for key in keys:
            usage = post(base_url, key, f"{system_prompt}\nQuestion {nonce}-{r}-{rng.random():.6f}: "
                                        "what does the report say about the lease?")
            total, hit = total + usage["prompt_tokens"], hit + cached(usage)
    return hit / total
