"""The victims' server of lab L4 (lesson 04), run as a subprocess.

    python -m minikv.grading.lab_server_prior [--seeds 11,12,13]

One tiny-random engine with a **shared** prefix cache (blocks of 2 byte tokens, L1's layout) serves
one victim per seed: victim ``i`` sent ``prefix_of(i) + SECRET_i + SUFFIX``, its secret sampled
from the lab's bigram model (:func:`minikv.grading.labs_prior.draw_secret`).  Each victim gets its
own attacker key (its own tenant and cache quota), so requests are counted per victim.  On start the
server prints one JSON line, ``{"cards": [...]}``: one lab card per victim (URL, key, template,
``secret_len``, ``alphabet``, ``block_size``, ``quota_blocks`` and the model, ``prior``).  When its
stdin closes it prints ``{"runs": [...]}``: per victim the secret, the requests of its key, how many
answers came from that key's own entries (self-priming), the known prefix's cached length and the
deepest hit on the victim's blocks; from then on it serves nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import warnings

from . import labs_prior as lp
from .sealed import make_undumpable


def build_app(seeds: list[int]):
    """(app, cards, answer) for one victim per seed; the victims' requests have already run."""
    from ..engine.config import UnsafeSettingWarning
    from ..engine.sampling import SamplingParams
    from ..llm import LLM
    from ..serve import ServeLimits, create_app

    table = lp.prior()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        llm = LLM("tiny-random", device="cpu", dtype="float32", block_size=lp.BLOCK_SIZE, num_blocks=1024,
                  enable_prefix_caching=True, cache_isolation="shared", max_cached_blocks_per_tenant=lp.QUOTA,
                  seed=0)
    victims, keys, cards = [], {}, []
    for i, seed in enumerate(seeds):
        secret = lp.draw_secret(seed, table)
        victims.append((lp.prefix_of(i), secret, lp.prefix_of(i) + secret + lp.SUFFIX))
        llm.generate([victims[-1][2]], SamplingParams(max_tokens=1, temperature=0.0), tenant=f"victim-{i}")
        key = f"sk-lab4-{i}-{os.urandom(6).hex()}"
        keys[key] = i
        cards.append(dict(api_key=key, model="tiny", prefix=lp.prefix_of(i), suffix=lp.SUFFIX,
                          secret_len=lp.SECRET_LEN, alphabet=lp.ALPHABET, block_size=lp.BLOCK_SIZE,
                          quota_blocks=lp.QUOTA, prior=table))
    limits = ServeLimits(requests_per_s=None, max_concurrent=None, max_queued=None)
    app = create_app(llm, {k: f"mallory-{i}" for k, i in keys.items()}, model_name="tiny",
                     report_cached_tokens=True, limits=limits)
    state = [{"requests": 0, "self_primed": 0, "max_victim_cached": 0} for _ in seeds]

    def victim_cached(i: int, text: str) -> int:
        """What victim ``i``'s entries alone can give ``text`` (byte tokens: one per character)."""
        victim, n = victims[i][2], 0
        while n < min(len(text) - 1, len(victim)) and text[n] == victim[n]:
            n += 1
        return n // lp.BLOCK_SIZE * lp.BLOCK_SIZE

    @app.middleware("http")
    async def observe(request, call_next):
        from starlette.responses import Response
        run = keys.get(request.headers.get("authorization", "").removeprefix("Bearer ").strip())
        if not request.url.path.endswith("/completions") or run is None:
            return await call_next(request)
        raw = await request.body()  # starlette caches it: the app reads the same bytes
        try:
            prompt = json.loads(raw).get("prompt")
            text = prompt if isinstance(prompt, str) else ""
        except (ValueError, AttributeError):
            text = ""
        response = await call_next(request)
        st = state[run]
        st["requests"] += 1
        body = b"".join([chunk async for chunk in response.body_iterator])
        if response.status_code == 200 and text:
            cached = json.loads(body)["usage"]["prompt_tokens_details"]["cached_tokens"]
            mine = victim_cached(run, text)
            st["self_primed"] += cached > mine  # a hit beyond the victim's blocks: the attacker's own entry
            st["max_victim_cached"] = max(st["max_victim_cached"], min(cached, mine))
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(body, status_code=response.status_code, headers=headers)

    def answer() -> dict:
        return {"runs": [{**st, "secret": secret, "known_cached": len(prefix) // lp.BLOCK_SIZE * lp.BLOCK_SIZE}
                         for st, (prefix, secret, _) in zip(state, victims)]}
    return app, cards, answer


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m minikv.grading.lab_server_prior", description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default=None, help="one victim per seed (comma-separated); default: "
                    f"{lp.RUNS} victims with secrets from os.urandom, drawn here and never written anywhere")
    args = ap.parse_args(argv)
    make_undumpable()  # before the secrets exist: no other process of this user can read our memory
    from ..serve import BackgroundServer

    seeds = ([int(s) for s in args.seeds.split(",")] if args.seeds is not None
             else [int.from_bytes(os.urandom(8), "big") for _ in range(lp.RUNS)])
    app, cards, answer = build_app(seeds)
    with BackgroundServer(app) as srv:
        print(json.dumps({"cards": [{**c, "base_url": srv.base_url} for c in cards]}), flush=True)
        sys.stdin.read()  # the grader closes our stdin when the attacks are over
    print(json.dumps(answer()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
