"""The victim's server for the attack labs (lessons 04 and 09), run as a subprocess.

    python -m minikv.grading.lab_server --mode count|ttft [--clock virtual|real] [--seed N] [--rounds R]

It builds a tiny-random engine with a **shared** prefix cache (the misconfiguration lesson 04
attacks), lets a victim send ``prefix + secret + suffix`` once, and serves the real minikv
OpenAI-compatible app (:func:`minikv.serve.create_app`) on loopback to one attacker key.  On
start it prints one JSON line, the *lab card*: URL, key, the template around the secret, the
secret's length and alphabet, the block size and the attacker's cache quota.  It prints the
answer (the secret and how many requests the attacker sent) only when its stdin closes; from
then on it serves nothing.  The secret comes from ``os.urandom`` unless ``--seed`` is given.  A graded
run serves several secrets in turn (``--rounds``, :func:`main`).

Two observables, one per lab:

* ``count``: ``usage.prompt_tokens_details.cached_tokens`` -- the exact count oracle;
* ``ttft``: the count is removed and ``usage.ttft_ms`` is added.  With ``--clock virtual`` (what
  graders use) it comes from :class:`VirtualClock`: a fixed cost per *computed* prompt token plus
  seeded noise, so a grade never depends on how busy the machine is.  ``--clock real`` measures
  the request on the server's ``perf_counter`` instead (shown in the lesson, never graded).

**Self-priming is real here.**  The cache is shared, so every probe stores its own blocks, and a
second probe of a wrong candidate hits the attacker's *own* entry.  The server gives every tenant
a quota of cached blocks (``quota_blocks`` on the card, the engine's
``max_cached_blocks_per_tenant``): a tenant that stores more recycles its own oldest entries first,
so an attacker's old probes age out after ``quota_blocks`` newer ones, while the victim's blocks
(under the victim's own quota) stay.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import numpy as np
from .sealed import make_undumpable

ATTACKER_KEY = "sk-lab-attacker"
PREFIX, SUFFIX = "Vault PIN: ", ". Keep it safe."
ALPHABET, SECRET_LEN, BLOCK_SIZE, QUOTA = "0123456789", 4, 2, 24


@dataclass
class VirtualClock:
    """TTFT as a function of work, not of the machine: ``base + per_token * computed`` plus
    Gaussian noise and, with probability ``spike_p``, a spike (a busy neighbour in the batch).

    A hit on one 2-token block saves 0.5 ms; with 0.15 ms of noise one pair of samples is
    misordered ~1% of the time, so among 100 candidates a single sample each picks a wrong one
    about half the time (0.99**99 = 0.37 right), and spikes make medians of few samples unsafe:
    an attacker needs repeats -- and repeats are exactly what self-priming poisons."""

    base_ms: float = 20.0
    per_token_ms: float = 0.25
    noise_ms: float = 0.15
    spike_p: float = 0.05
    spike_ms: float = 4.0
    seed: int = 0

    def __post_init__(self):
        self._rng = np.random.default_rng(self.seed)

    def ttft_ms(self, computed_tokens: int) -> float:
        t = self.base_ms + self.per_token_ms * computed_tokens + self._rng.normal(0, self.noise_ms)
        if self._rng.random() < self.spike_p:
            t += self._rng.exponential(self.spike_ms)
        return round(max(t, 0.1), 4)


def _mid_block(text: str, victim: str, seen: dict) -> bool:
    """Whether a probe looks like a character-by-character guess, not a block test.

    The block a probe tests is the one holding its first difference from the victim (a trailing
    filler that starts a new block does not count).  A block test covers that block whole and goes
    on past it, and tests each candidate block once; a character-by-character guesser stops inside
    the block, or re-tests one candidate block at the same length with another last character.
    ``seen`` maps each tested candidate (the text up to its block's end) to the first probe that
    tested it."""
    d = 0
    while d < min(len(text), len(victim)) and text[d] == victim[d]:
        d += 1
    n = len(text)
    t = n - 2 if d >= n - 1 and (n - 1) % BLOCK_SIZE == 0 else min(d, n - 1)
    end = (t // BLOCK_SIZE + 1) * BLOCK_SIZE
    if n % BLOCK_SIZE == 0:
        return False  # ends on a block boundary: counted as such (ends_on_block)
    if n <= end:
        return True
    first = seen.setdefault(text[:end], text)
    return first != text and len(first) == n


def draw_secret(rng: np.random.Generator, alphabet: str = ALPHABET, n: int = SECRET_LEN) -> str:
    return "".join(alphabet[i] for i in rng.integers(0, len(alphabet), n))


def build_app(mode: str, clock: str, seed: int, api_key: str = ATTACKER_KEY):
    """(app, card, answer) for one lab; the victim's request has already run.  Only requests
    with ``api_key`` are served and counted: a graded server draws its own key (:func:`main`),
    so another submission's code, which can find the port, can neither probe it nor add to
    the count its grade reads."""
    from ..engine.config import UnsafeSettingWarning
    from ..llm import LLM
    from ..engine.sampling import SamplingParams
    from ..serve import ServeLimits, create_app

    rng = np.random.default_rng(seed)
    secret = draw_secret(rng)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        llm = LLM("tiny-random", device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_blocks=1024,
                  enable_prefix_caching=True, cache_isolation="shared", max_cached_blocks_per_tenant=QUOTA,
                  seed=0)
    llm.generate([PREFIX + secret + SUFFIX], SamplingParams(max_tokens=1, temperature=0.0), tenant="victim")
    limits = ServeLimits(requests_per_s=None, max_concurrent=None, max_queued=None)
    app = create_app(llm, {api_key: "mallory"}, model_name="tiny", report_cached_tokens=True, limits=limits)
    vclock = VirtualClock(seed=seed + 1)
    victim = PREFIX + secret + SUFFIX
    tested: dict = {}  # candidate block -> the first probe that tested it
    state = {"requests": 0, "self_primed": 0, "max_victim_cached": 0, "ends_on_block": 0, "mid_block": 0}

    def victim_cached(text: str) -> int:
        """What the victim's entries alone can give ``text`` (byte tokens: one per character)."""
        n = 0
        while n < min(len(text) - 1, len(victim)) and text[n] == victim[n]:
            n += 1
        return n // BLOCK_SIZE * BLOCK_SIZE

    @app.middleware("http")
    async def observe(request, call_next):
        from starlette.responses import Response
        t0, text = time.perf_counter(), ""
        if request.url.path.endswith("/completions"):
            raw = await request.body()  # starlette caches it: the app reads the same bytes
            try:
                prompt = json.loads(raw).get("prompt")
                text = prompt if isinstance(prompt, str) else ""
            except (ValueError, AttributeError):
                pass
        response = await call_next(request)
        if not request.url.path.endswith("/completions") or response.status_code == 401:
            return response  # a request without this lab's key is no probe of this attacker's
        state["requests"] += 1
        body = b"".join([chunk async for chunk in response.body_iterator])
        if response.status_code == 200:
            data = json.loads(body)
            u = data["usage"]
            cached = u["prompt_tokens_details"]["cached_tokens"]
            # a hit beyond what the victim's blocks explain came from the attacker's own entries
            state["self_primed"] += cached > victim_cached(text)
            state["ends_on_block"] += len(text) % BLOCK_SIZE == 0  # its last block can never be a hit
            state["mid_block"] += _mid_block(text, victim, tested)
            state["max_victim_cached"] = max(state["max_victim_cached"], min(cached, victim_cached(text)))
        if mode == "ttft" and response.status_code == 200:
            del u["prompt_tokens_details"]
            u["ttft_ms"] = (vclock.ttft_ms(u["prompt_tokens"] - cached) if clock == "virtual"
                            else round((time.perf_counter() - t0) * 1e3, 4))
            body = json.dumps(data).encode()
        headers = {k: v for k, v in response.headers.items() if k.lower() != "content-length"}
        return Response(body, status_code=response.status_code, headers=headers)

    card = dict(mode=mode, clock=clock, api_key=api_key, model="tiny", prefix=PREFIX, suffix=SUFFIX,
                secret_len=SECRET_LEN, alphabet=ALPHABET, block_size=BLOCK_SIZE, quota_blocks=QUOTA)
    if mode == "ttft" and clock == "virtual":
        card["virtual_clock"] = {k: v for k, v in asdict(vclock).items() if k != "seed"}
    known = len(PREFIX) // BLOCK_SIZE * BLOCK_SIZE
    return app, card, (lambda: {"secret": secret, "requests": state["requests"], "known_cached": known,
                                "self_primed": state["self_primed"],
                                "max_victim_cached": state["max_victim_cached"],
                                "ends_on_block": state["ends_on_block"], "mid_block": state["mid_block"]})


def main(argv: list[str] | None = None) -> int:
    """Serve ``--rounds`` labs one after another, each a fresh engine, victim and secret.

    The protocol on the pipes: a card (one JSON line) per round on stdout; the grader writes
    ``next`` on stdin when the attack on it is over, and we print that round's answer key and the
    next round's card; when stdin closes we print the current round's answer key and exit.  One
    process for every round saves a graded run the ~5 s each fresh interpreter costs (torch, the
    app), and keeps the secrets' only source inside it: a graded run passes no ``--seed``, because
    a command line is readable by every process of the machine (``/proc/<pid>/cmdline``), the
    learner's included, and a seed there would be the secret."""
    ap = argparse.ArgumentParser(prog="python -m minikv.grading.lab_server", description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=("count", "ttft"), default="count")
    ap.add_argument("--clock", choices=("virtual", "real"), default="virtual")
    ap.add_argument("--seed", type=int, default=None, help="fixed secret (lessons); default: fresh from os.urandom")
    ap.add_argument("--rounds", type=int, default=1, help="labs served one after another (default 1)")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    make_undumpable()  # before the secret exists: no other process of this user can read our memory
    from ..serve import BackgroundServer

    for i in range(args.rounds):
        seed = args.seed + i if args.seed is not None else int.from_bytes(os.urandom(8), "big")
        key = ATTACKER_KEY if args.seed is not None else f"sk-lab-{os.urandom(16).hex()}"  # graded: its own
        app, card, answer = build_app(args.mode, args.clock, seed, key)
        with BackgroundServer(app) as srv:
            print(json.dumps({**card, "base_url": srv.base_url, "round": i + 1, "rounds": args.rounds}), flush=True)
            done = sys.stdin.readline().strip() != "next"  # stdin closed (or anything but "next"): the last round
        print(json.dumps(answer()), flush=True)
        if done:
            break
    return 0


if __name__ == "__main__":
    sys.exit(main())
