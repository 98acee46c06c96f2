"""Fair share under abuse: how much one tenant's flood of rejected requests slows another's tokens.

    python -m minikv.bench --only fairness [--model smollm2-135m-instruct]

A server is shared: one engine thread, one tokenizer thread, one event loop, one GIL.  A tenant
does not need to be *served* to take those from the others; being *refused* costs the server
something too (read the body, parse it, check it, perhaps tokenize it): before the server's
cheap checks and rate limit, four connections of requests that all got a 400 multiplied a
victim's median gap between streamed tokens many times over (docs/BENCHMARKS.md).  This
benchmark replays that attack against the server as it is now and reports what the victim sees.

What runs
    * the server under test: ``create_app(LLM(model), keys, limits=ServeLimits(...))`` in a
      :class:`~minikv.serve.background.BackgroundServer` (uvicorn in a thread of *this* process);
    * the victim: one tenant streaming one completion of ``victim_tokens`` tokens
      (``ignore_eos``, temperature 0) over SSE, in a process of its own;
    * the attacker: a second tenant with its own key, ``n`` connections (threads of one other
      process), each sending in a tight loop a body the server rejects anyway, ignoring
      Retry-After.  Two kinds, measured separately because different defences stop them:

      - ``oversize``: a chat body just under ``max_body_bytes`` (1 MiB by default) whose content
        is over ``max_prompt_chars``: read, parsed, refused (400) before any tokenization.  Cheap
        per request, so the attacker can send many: the per-tenant *rate limit* bounds it.
      - ``overlong``: a completion prompt just under ``max_prompt_chars`` but far longer than the
        context: refused (400) only after it has been *tokenized*, off the engine thread but in
        the server's process.  Each costs the server far more CPU than an ``oversize`` one.

Clients run in processes of their own (:mod:`minikv.bench.clients`) so that their Python work does
not take the GIL of the server's process: the server's process is what is measured.

What is measured
    The *gap* between consecutive SSE chunks that carry text, as the victim's process receives
    them (``time.perf_counter``): the inter-token latency a user watching the stream feels.  A
    chunk is one decode step of the victim, except when the server holds back an incomplete
    UTF-8 character (then two tokens arrive as one chunk).  Median and p99 of the gaps, in ms and
    as a ratio to the no-attacker baseline measured in the same run, on the same server; plus the
    attacker's request count and the statuses it got back, the victim's time to first token (its
    prompt waits for the one tokenizer thread like everybody's), and the server process's CPU
    time over the row's wall time (200% = two cores busy; the victim's decoding is in it too).

Both the default :class:`ServeLimits` and the same limits with the per-tenant rate limit off
(``requests_per_s=None``) are measured, so the reader sees what the rate limit contributes on top
of the cheap checks (Content-Length, prompt size caps) and off-engine-thread tokenization.

Caveat: on a machine with few cores the attacker's process and the server's compete for CPU;
whatever CPU the attacker's client burns is CPU the server does not get.  The report prints the
number of cores next to the figures.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from collections import Counter

from .clients import Clients, percentile

VICTIM_KEY, ATTACKER_KEY = "sk-bench-victim", "sk-bench-attacker"
KEYS = {VICTIM_KEY: "victim", ATTACKER_KEY: "attacker"}
VICTIM_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
TARGET = "median and p99 gap ratio <= 2.0 with 4 abusive connections"


# ---------------------------------------------------------------------------------- clients
def attack_bodies(max_body_bytes: int, max_prompt_chars: int) -> dict[str, tuple[str, bytes]]:
    """The rejected-anyway requests, by kind, as ``(path, body)``: see the module doc."""
    frame = len(json.dumps({"messages": [{"role": "user", "content": ""}], "max_tokens": 16}))
    oversize = {"messages": [{"role": "user", "content": "a " * ((max_body_bytes - frame - 64) // 2)}],
                "max_tokens": 16}
    words = "lorem ipsum dolor sit amet consectetur adipiscing elit " * (max_prompt_chars // 50 + 1)
    overlong = {"prompt": words[:max_prompt_chars - 8], "max_tokens": 16}
    return {"oversize": ("/chat/completions", json.dumps(oversize).encode()),
            "overlong": ("/completions", json.dumps(overlong).encode())}


def _attack(base_url: str, request: tuple[str, bytes], conns: int, ready, stop) -> dict:
    """``conns`` threads posting ``request`` (path, body) in a loop until ``stop`` is set;
    ``ready`` is set once every connection has had its first answer."""
    import threading

    import httpx

    counts: Counter = Counter()
    lock, started = threading.Lock(), threading.Semaphore(0)
    headers = {"Authorization": f"Bearer {ATTACKER_KEY}", "Content-Type": "application/json"}

    def loop() -> None:
        path, body = request
        first = True
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while not stop.is_set():
                try:
                    outcome = str(client.post(path, content=body, headers=headers).status_code)
                except httpx.HTTPError as exc:  # counted, not raised: the attack goes on
                    outcome = type(exc).__name__
                with lock:
                    counts[outcome] += 1
                if first:
                    first = False
                    started.release()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(conns)]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for _ in threads:
        started.acquire()
    ready.set()
    for t in threads:
        t.join()
    return {"statuses": dict(counts), "seconds": time.perf_counter() - t0}


def _victim(base_url: str, tokens: int) -> dict:
    """Stream one completion; the arrival times (s from sending) of its chunks that carry text."""
    import httpx

    body = {"prompt": VICTIM_PROMPT, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {VICTIM_KEY}"}
    times, error = [], None
    t0 = time.perf_counter()
    with httpx.Client(base_url=base_url, timeout=None) as client:
        with client.stream("POST", "/completions", json=body, headers=headers) as resp:
            if resp.status_code != 200:
                error = f"HTTP {resp.status_code}: {resp.read()[:200]!r}"
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                obj = json.loads(line[6:])
                if "error" in obj:
                    error = obj["error"].get("message")
                elif obj.get("choices") and obj["choices"][0].get("text"):
                    times.append(time.perf_counter() - t0)
    return {"times": times, "error": error}


# ---------------------------------------------------------------------------------- figures
def summarize(runs: list[list[float]]) -> dict:
    """Gap statistics over the victim's streams ``runs`` (arrival times in s; gaps pooled)."""
    gaps = [(b - a) * 1000 for ts in runs for a, b in zip(ts, ts[1:])]
    if not gaps:
        raise RuntimeError("the victim received fewer than two text chunks")
    return {"median_ms": statistics.median(gaps), "p99_ms": percentile(gaps, 99), "max_ms": max(gaps),
            "gaps": len(gaps), "ttft_ms": statistics.median(ts[0] for ts in runs) * 1000,
            "total_s": statistics.median(ts[-1] for ts in runs)}


def measure(llm, limits, clients: Clients, attackers=(1, 4, 16), kinds=("oversize", "overlong"),
            victim_tokens: int = 120, rounds: int = 1) -> list[dict]:
    """One server around ``llm`` with ``limits``: the victim alone (``conns`` 0), then against each
    attack kind and connection count.  ``rounds`` repeats the sweep, baseline included (gaps
    pooled), so that slow drift of the machine's load spreads over every row alike."""
    from ..serve import BackgroundServer, create_app

    requests = attack_bodies(limits.max_body_bytes, limits.prompt_chars(llm.engine.max_model_len))
    plan = [("none", 0)] + [(kind, n) for kind in kinds for n in attackers if n]
    times: dict = {key: [] for key in plan}
    attacks: dict = {key: [] for key in plan}
    cpu: dict = {key: [0.0, 0.0] for key in plan}  # the server process's CPU seconds, wall seconds
    with BackgroundServer(create_app(llm, KEYS, limits=limits)) as srv:
        clients.victim(srv.base_url, 4)  # warm-up: first request, first SSE stream
        for _ in range(rounds):
            for kind, n in plan:
                c0, w0 = time.process_time(), time.perf_counter()
                if n:
                    res = clients.under_attack((srv.base_url, requests[kind], n), (srv.base_url, victim_tokens),
                                               f"{kind} x{n}", ready_s=300)
                    attacks[kind, n].append(res["attacker"])
                else:
                    res = clients.victim(srv.base_url, victim_tokens)
                times[kind, n].append(res["times"])
                cpu[kind, n][0] += time.process_time() - c0
                cpu[kind, n][1] += time.perf_counter() - w0
    rows = []
    for kind, n in plan:
        row = {"attack": kind, "conns": n, **summarize(times[kind, n]),
               "server_cpu_pct": 100 * cpu[kind, n][0] / cpu[kind, n][1]}
        if n:
            statuses: Counter = Counter()
            for a in attacks[kind, n]:
                statuses.update(a["statuses"])
            row["attacker_requests"] = sum(statuses.values())
            row["attacker_statuses"] = dict(sorted(statuses.items()))
            row["attacker_requests_per_s"] = row["attacker_requests"] / sum(a["seconds"] for a in attacks[kind, n])
        rows.append(row)
    for row in rows:  # rows[0] is the baseline
        row["median_ratio"] = row["median_ms"] / rows[0]["median_ms"]
        row["p99_ratio"] = row["p99_ms"] / rows[0]["p99_ms"]
    return rows


def bench_fairness(llm, attackers=(1, 4, 16), kinds=("oversize", "overlong"), victim_tokens: int = 120,
                   rounds: int = 1) -> dict:
    """The fairness section of ``python -m minikv.bench``: default limits, then rate limit off."""
    from dataclasses import asdict, replace

    from ..serve import ServeLimits

    t0 = time.perf_counter()
    configs = {"default limits": ServeLimits(), "rate limit off": replace(ServeLimits(), requests_per_s=None)}
    with Clients(_victim, _attack) as clients:
        rows = [{"limits": label, **row} for label, lim in configs.items()
                for row in measure(llm, lim, clients, attackers, kinds, victim_tokens, rounds)]
    return {"rows": rows, "limits": {k: asdict(v) for k, v in configs.items()}, "victim_tokens": victim_tokens,
            "rounds": rounds, "cpu_count": os.cpu_count(), "seconds": time.perf_counter() - t0, "target": TARGET}


def format_fairness(res: dict) -> list[str]:
    lines = [f"  fairness: one victim stream of {res['victim_tokens']} tokens vs N attacker connections "
             f"({res['rounds']} round(s), {res['seconds']:.0f} s)",
             f"    NOTE: {res['cpu_count']} CPU cores, shared by the server, the victim's and the attacker's processes",
             f"    {'limits':<15} {'attack':<9} {'conns':>5} {'median ms':>9} {'p99 ms':>8} {'x median':>8} "
             f"{'x p99':>6} {'TTFT ms':>8} {'srv CPU':>7}  {'attacker reqs':>14}  statuses"]
    for r in res["rows"]:
        statuses = " ".join(f"{k}:{v}" for k, v in r.get("attacker_statuses", {}).items())
        reqs = f"{r['attacker_requests']} ({r['attacker_requests_per_s']:.0f}/s)" if r["conns"] else ""
        lines.append(f"    {r['limits']:<15} {r['attack']:<9} {r['conns']:>5} {r['median_ms']:>9.1f} "
                     f"{r['p99_ms']:>8.1f} {r['median_ratio']:>8.2f} {r['p99_ratio']:>6.2f} {r['ttft_ms']:>8.0f}"
                     f" {r['server_cpu_pct']:>6.0f}%"
                     f"  {reqs:>14}  {statuses}")
    lines.append(f"    target: {res['target']}")
    return lines
