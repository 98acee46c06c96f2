"""Availability under abuse: one tenant floods, another's latency is measured, by attacker mode.

    python -m minikv.bench --only fairness [--fairness-modes all] [--fairness-seconds 20]

What runs
    * the server under test: ``create_app(LLM(model, max_num_batched_tokens=...), keys,
      limits=ServeLimits(), gateway_keys=...)`` -- ``minikv serve``'s defaults, its step budget
      included -- in a :class:`~minikv.serve.BackgroundServer` (uvicorn in a thread of this process);
      for the ``gateway`` modes, ``minikv gateway`` in front of it (another thread), passing each
      request's tenant through (``X-Minikv-Tenant``);
    * the victim: a process of its own sending, one after the other, fresh prompts of about 40
      tokens (random words: no prefix hit helps) with ``max_tokens`` 8, and timing each whole
      request from sending to the last byte;
    * the attacker: one API key, a process of its own, ``n`` threads looping one of the modes
      below until the victim is done.  It ignores every refusal and goes on.

Modes (the red-team table of the availability report; ``--fairness-scale`` multiplies the counts)
    ``max_tokens_1``    n connections looping short completions of ``max_tokens`` 1;
    ``long_prompts``    16 connections looping ~5,000-word prompts (``max_tokens`` 8);
    ``long_streams``    16 streams of ``max_tokens`` 1024, looping;
    ``hangups``         32 loops of: open a stream, read 2 events, hang up;
    ``gateway``         16 streams of ``max_tokens`` 512, through the gateway (the victim too).

Each mode is compared with the victim alone on the same path (direct or gateway), measured in
the same run: p50 and p99 of the victim's request latency, as ratios, with the absolutes beside
them.  Clients run in processes of their own (:mod:`minikv.bench.clients`), off the server's GIL;
on a machine with few cores they still take its CPU, which the report notes with the core count.
"""
from __future__ import annotations

import os
import random
import statistics
import sys
import time
from collections import Counter

from .clients import Clients, percentile

VICTIM_KEY, ATTACKER_KEY, GATEWAY_KEY = "sk-bench-victim", "sk-bench-attacker", "sk-bench-gateway"
KEYS = {VICTIM_KEY: "victim", ATTACKER_KEY: "attacker"}
TARGET = {"p50": 2.0, "p99": 3.0}  # victim latency under abuse / alone
WORDS = ("river stone lantern orchard signal copper meadow harbor violet engine quiet marble "
         "falcon winter garden thunder pepper canyon ribbon silver").split()


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def mode_request(mode: str, rng: random.Random) -> tuple[dict, int | None]:
    """The attacker's next body for ``mode``, and how many SSE events to read before hanging up
    (None: read the whole answer)."""
    if mode == "max_tokens_1":
        return {"prompt": _words(rng, 30), "max_tokens": 1, "stream": True}, None
    if mode == "long_prompts":
        return {"prompt": _words(rng, 5000), "max_tokens": 8, "stream": True}, None  # streamed: a hang-up aborts it
    if mode == "long_streams":
        return {"prompt": _words(rng, 30), "max_tokens": 1024, "ignore_eos": True, "stream": True}, None
    if mode == "hangups":
        return {"prompt": _words(rng, 30), "max_tokens": 256, "ignore_eos": True, "stream": True}, 2
    if mode == "gateway":
        return {"prompt": _words(rng, 30), "max_tokens": 512, "ignore_eos": True, "stream": True}, None
    raise ValueError(f"unknown fairness mode {mode!r}")


WARMUP_S = 3.0  # the attack runs this long before the victim starts
IDLE_TIMEOUT_S = 900.0  # after a mode, the server must drain the attacker's requests within this
CONNS = {"max_tokens_1": 64, "hangups": 32, "long_streams": 16, "gateway": 16, "long_prompts": 16}
MODES = tuple(CONNS)


def _attack(base_url: str, mode: str, conns: int, ready, stop) -> dict:
    import threading

    import httpx

    counts: Counter = Counter()
    lock, done = threading.Lock(), threading.Event()  # this attack's own stop: a straggler of it never
    headers = {"Authorization": f"Bearer {ATTACKER_KEY}"}  # sees the next attack's cleared flag

    clients = []

    def loop(i: int) -> None:
        rng = random.Random(i)
        with httpx.Client(base_url=base_url, timeout=600) as client:
            clients.append(client)
            while not done.is_set():
                body, hang_up_after = mode_request(mode, rng)
                try:
                    with client.stream("POST", "/completions", json=body, headers=headers) as resp:
                        outcome, events = str(resp.status_code), 0
                        for line in resp.iter_lines():
                            events += line.startswith("data: ")
                            if done.is_set() or (hang_up_after is not None and events >= hang_up_after):
                                break  # leaving the block closes the connection: a hang-up
                except httpx.HTTPError as exc:
                    outcome = type(exc).__name__
                with lock:
                    counts[outcome] += 1

    threads = [threading.Thread(target=loop, args=(i,), daemon=True) for i in range(conns)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(WARMUP_S)  # the first requests are in the server: the attack is on
    ready.set()
    stop.wait()
    done.set()
    for client in clients:  # hang up on what is still in flight: the server aborts it
        try:
            client.close()
        except Exception:  # noqa: BLE001 -- a client busy in another thread may refuse; its daemon thread ends with us
            pass
    for t in threads:  # one still waiting for a long answer is left behind (a daemon), not waited for
        t.join(timeout=5)
    return {"statuses": dict(counts), "seconds": time.perf_counter() - t0}


def _victim(base_url: str, seconds: float, min_requests: int, seed: int) -> dict:
    """Fresh ~40-token prompts, ``max_tokens`` 8, one after another for ``seconds`` (and at least
    ``min_requests``); each request's latency in s."""
    import httpx

    rng, lat, errors = random.Random(seed), [], Counter()
    headers = {"Authorization": f"Bearer {VICTIM_KEY}"}
    t_end = time.perf_counter() + seconds
    with httpx.Client(base_url=base_url, timeout=900) as client:
        while time.perf_counter() < t_end or len(lat) < min_requests:
            body = {"prompt": f"{rng.getrandbits(64):x} " + _words(rng, 30), "max_tokens": 8,
                    "ignore_eos": True, "temperature": 0}
            t0 = time.perf_counter()
            resp = client.post("/completions", json=body, headers=headers)
            if resp.status_code != 200:
                errors[str(resp.status_code)] += 1
                continue
            lat.append(time.perf_counter() - t0)
    return {"latencies": lat, "errors": dict(errors)}


def bench_availability(llm, modes=MODES, seconds: float = 20.0, min_requests: int = 5, scale: float = 1.0) -> dict:
    """Victim latency alone and under each attacker mode (see the module doc)."""
    from ..gateway.lab import start_gateway
    from ..serve import BackgroundServer, ServeLimits, create_app

    t0 = time.perf_counter()
    app = create_app(llm, KEYS, limits=ServeLimits(), gateway_keys={GATEWAY_KEY: "gateway"})
    rows, clients = [], Clients(_victim, _attack)
    try:
        with BackgroundServer(app) as srv:
            gw = start_gateway([srv.base_url], {VICTIM_KEY: "victim", ATTACKER_KEY: "attacker"},
                               upstream_key=GATEWAY_KEY, tenant_upstreams=(srv.base_url,), max_tokens_cap=1024)
            try:
                clients.victim(srv.base_url, 0, 2, 99)  # warm-up (seed 99)
                base = {}
                for path, url in (("direct", srv.base_url), ("gateway", gw.base_url)):
                    if path == "gateway" and "gateway" not in modes:
                        continue
                    base[path] = clients.victim(url, seconds, min_requests, 1)["latencies"]
                    rows.append(_row("none", path, 0, base[path], base[path], None))
                    _progress(rows[-1], t0)
                for seed, mode in enumerate(modes, start=2):
                    path = "gateway" if mode == "gateway" else "direct"
                    url = gw.base_url if mode == "gateway" else srv.base_url
                    conns = max(1, round(CONNS[mode] * scale))
                    res = clients.under_attack((url, mode, conns), (url, seconds, min_requests, seed), mode)
                    rows.append(_row(mode, path, conns, res["latencies"], base[path], res))
                    _progress(rows[-1], t0)
                    _wait_idle(llm.engine, mode)  # no row measures the last one's leftovers
            finally:
                gw.stop()
    finally:
        clients.close()
    return {"rows": rows, "seconds": time.perf_counter() - t0, "cpu_count": os.cpu_count(),
            "budget": llm.engine.config.max_num_batched_tokens, "target": TARGET,
            "contended_budget": llm.engine.scheduler.contended_budget,
            "load": os.getloadavg()}


def _progress(row: dict, t0: float) -> None:
    """Each row to stderr as it is measured: a run cut short keeps what it measured."""
    print(f"  [{time.perf_counter() - t0:.0f} s, load {os.getloadavg()[0]:.1f}] {_format_row(row)}",
          file=sys.stderr, flush=True)


def _wait_idle(engine, mode: str) -> None:
    t_end = time.perf_counter() + IDLE_TIMEOUT_S
    while engine.has_unfinished_requests():
        if time.perf_counter() > t_end:
            raise RuntimeError(f"{mode}: the server still had requests {IDLE_TIMEOUT_S:.0f} s after the attack")
        time.sleep(0.2)


def _row(mode, path, conns, lat, base, res) -> dict:
    ms = [x * 1000 for x in lat]
    bms = [x * 1000 for x in base]
    row = {"mode": mode, "path": path, "conns": conns, "requests": len(ms),
           "p50_ms": statistics.median(ms), "p99_ms": percentile(ms, 99),
           "p50_ratio": statistics.median(ms) / statistics.median(bms),
           "p99_ratio": percentile(ms, 99) / percentile(bms, 99)}
    row["met"] = row["p50_ratio"] <= TARGET["p50"] and row["p99_ratio"] <= TARGET["p99"]
    if res is not None:
        row["victim_errors"] = res["errors"]
        row["attacker_statuses"] = res["attacker"]["statuses"]
    return row


def _format_row(r: dict) -> str:
    st = " ".join(f"{k}:{v}" for k, v in sorted(r.get("attacker_statuses", {}).items()))
    return (f"{r['mode']:<13} {r['path']:<8} {r['conns']:>5} {r['requests']:>5} {r['p50_ms']:>8.0f} "
            f"{r['p99_ms']:>8.0f} {r['p50_ratio']:>6.2f} {r['p99_ratio']:>6.2f}  {'yes' if r['met'] else 'NO ':<4} {st}")


def format_availability(res: dict) -> list[str]:
    lines = [f"  availability: victim requests of ~40 tokens, max_tokens 8, alone vs under each attacker mode "
             f"(step budget {res['budget']} tokens, {res.get('contended_budget') or res['budget']} while "
             f"tenants compete, {res['seconds']:.0f} s, load {res['load'][0]:.1f} on "
             f"{res['cpu_count']} cores)",
             f"    {'mode':<13} {'path':<8} {'conns':>5} {'reqs':>5} {'p50 ms':>8} {'p99 ms':>8} {'x p50':>6} "
             f"{'x p99':>6}  met  attacker statuses"]
    lines += [f"    {_format_row(r)}" for r in res["rows"]]
    lines.append(f"    target: victim p50 <= {TARGET['p50']}x and p99 <= {TARGET['p99']}x of alone, every mode")
    return lines
