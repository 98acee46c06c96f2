"""Timing audit client against an in-process fake OpenAI-compatible server (loopback only).

The fake simulates a prefix cache by sleeping: 2 ms on a hit, 30 ms on a miss, keyed either
globally (shared cache) or per API key (isolated).  It tests the client protocol and verdict
logic; the real minikv server is audited elsewhere.
"""
import asyncio
import json
import socket
import threading
import time

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi import FastAPI, Request  # noqa: E402

from minikv.audit.cli import add_audit_parser  # noqa: E402
from minikv.audit.timing import TimingPlan, TimingReport, plan_timing_audit, run_timing_audit  # noqa: E402
from minikv.audit.timing_client import Pacer, TimingAuditError  # noqa: E402

# Per arm.  The floor for alpha = 1e-8 is 15; at 30, up to 7 hits delayed past every miss (CPU
# contention on a busy 2-core CI box) still give p < 1e-8.  Negatives need no margin: 16.
N, N_NEG = 30, 16
PREFIX_WORDS = 40  # the fake caches the first 40 words (its "block-aligned prefix")
ATTACKER, VICTIM = "sk-att-5e1f", "sk-vic-77c2"


class FakeAPI:
    def __init__(self):
        self.mode = "global"  # or "per_tenant"
        self.fail_every = 0  # > 0: every k-th POST answers 503 (a flaky endpoint)
        self.tokens_per_word = 1  # what usage.prompt_tokens reports (3 ~ a byte-level tokenizer)
        self.cache: set = set()
        self.log: list = []  # (time, key, path)
        self.prompt_words: list = []  # the words of each POSTed prompt
        app = FastAPI()

        async def handle(request: Request, prompt: str):
            key = request.headers.get("authorization", "")
            self.log.append((time.monotonic(), key, request.url.path))
            self.prompt_words.append(prompt.split())
            if key not in (f"Bearer {ATTACKER}", f"Bearer {VICTIM}"):
                return fastapi.responses.JSONResponse({"error": "bad key"}, status_code=401)
            if self.fail_every and len(self.posts()) % self.fail_every == 0:
                return fastapi.responses.JSONResponse({"error": "overloaded"}, status_code=503)
            entry = (None if self.mode == "global" else key, tuple(prompt.split()[:PREFIX_WORDS]))
            hit = entry in self.cache
            self.cache.add(entry)
            await asyncio.sleep(0.002 if hit else 0.030)
            return {"id": "x", "object": "text_completion", "model": "fake",
                    "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                    "usage": {"prompt_tokens": self.tokens_per_word * len(prompt.split()),
                              "completion_tokens": 1}}

        @app.post("/v1/completions")
        async def completions(request: Request):
            return await handle(request, (await request.json())["prompt"])

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            return await handle(request, (await request.json())["messages"][-1]["content"])

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

        self.sock = socket.socket()
        # Accepted sockets inherit this.  Without it the server's separate header/body writes wait
        # for the client's delayed ACK (~40 ms on Linux keep-alive), drowning the 20 ms signal.
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}/v1"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def start(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.server.started, "fake server did not start"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()

    def posts(self):
        return [e for e in self.log if e[2] != "/v1/models"]


@pytest.fixture(scope="module")
def fake():
    srv = FakeAPI()
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture
def api(fake):
    fake.log.clear()
    fake.prompt_words.clear()
    fake.mode, fake.fail_every, fake.tokens_per_word = "global", 0, 1
    return fake


def audit(api, **kw):
    kw.setdefault("victim_key", VICTIM)
    kw.setdefault("n_samples", N)
    kw.setdefault("prompt_tokens", 60)
    return run_timing_audit(api.url, ATTACKER, progress=False, **kw)


@pytest.fixture(scope="module")
def global_run(fake):
    fake.log.clear()
    fake.mode = "global"
    rep = audit(fake, model="fake")
    return rep, list(fake.posts())


@pytest.mark.slow
def test_global_cache_is_detected_across_keys(global_run):
    rep, posts = global_run
    assert isinstance(rep, TimingReport) and rep.separate_victim
    assert rep.detected, rep.verdict
    assert rep.verdict.startswith("CACHE SHARING DETECTED between attacker and victim (p=")
    assert rep.result.auc > 0.9 and len(rep.hit_times) == len(rep.miss_times) == N
    # protocol: 1 warm-up + N*(victim prime + probe) + N misses, victims only ever prime
    assert len(posts) == rep.n_requests == 1 + 3 * N
    assert sum(k == f"Bearer {VICTIM}" for _, k, _ in posts) == N


@pytest.mark.slow
def test_per_tenant_cache_is_not_detected(api):
    api.mode = "per_tenant"
    rep = audit(api, model="fake", endpoint="chat", n_samples=N_NEG)
    assert not rep.detected and rep.verdict.startswith("no evidence of sharing")


@pytest.mark.slow
def test_self_priming_detects_per_user_caching(api):
    api.mode = "per_tenant"
    rep = audit(api, victim_key=None, prefix_fraction=0.8)  # also: model discovered via GET /models
    assert rep.model == "fake-model" and not rep.separate_victim
    assert rep.detected and "per-user" in rep.verdict
    assert all(k == f"Bearer {ATTACKER}" for _, k, _ in api.log)


def test_prompt_length_calibrated_from_usage(api):
    api.tokens_per_word = 3
    rep = audit(api, model="fake", n_samples=2, prompt_tokens=60 * 3)
    assert rep.words_per_prompt == 60
    assert all(len(body) == 60 for body in api.prompt_words[1:])  # every trial, after the warm-up


def test_dry_run_sends_nothing(api):
    plan = audit(api, dry_run=True, model="fake", victim_requests=5)
    assert isinstance(plan, TimingPlan) and api.log == []
    assert plan.n_requests == 1 + N * 6 + N
    assert plan == plan_timing_audit(api.url, N, 60, 5, "completions", VICTIM, "fake")
    assert plan.approx_prompt_tokens > 7 * N * 60 and "would send" in plan.describe()


def test_rate_limit_is_respected(api):
    rate = 60.0
    t0 = time.monotonic()
    rep = run_timing_audit(api.url, ATTACKER, victim_key=VICTIM, model="fake", n_samples=4,
                           prompt_tokens=20, rate_limit=rate, progress=False)
    elapsed = time.monotonic() - t0
    starts = sorted(t for t, _, _ in api.posts())
    assert len(starts) == rep.n_requests == 13
    assert elapsed >= 0.9 * (len(starts) - 1) / rate
    # no one-second window (here: the whole run) holds more than rate requests + 1
    assert all(sum(s <= t < s + 1 for t in starts) <= rate + 1 for s in starts)


def test_pacer_counts_with_fake_clock():
    now = [0.0]
    slept = []
    pacer = Pacer(10.0, clock=lambda: now[0], sleep=lambda s: (slept.append(s), now.__setitem__(0, now[0] + s)))
    for _ in range(5):
        pacer.wait()
    assert now[0] == pytest.approx(0.4) and len(slept) == 4
    with pytest.raises(ValueError):
        Pacer(0)


def test_bad_key_aborts_with_clear_error(api):
    with pytest.raises(TimingAuditError, match="401"):
        run_timing_audit(api.url, "wrong", model="fake", n_samples=2, prompt_tokens=5, progress=False)


def test_transient_failures_are_dropped_then_abort(api):
    api.fail_every = 5  # the warm-up is POST 1, so it succeeds
    rep = audit(api, model="fake", n_samples=6, max_failures=10)
    assert rep.failures >= 3 and len(rep.hit_times) + len(rep.miss_times) < 12
    api.log.clear()
    with pytest.raises(TimingAuditError, match="failed requests"):
        audit(api, model="fake", n_samples=6, max_failures=1)
    api.log.append((0.0, "", "/v1/completions"))  # now the warm-up itself gets the 503
    with pytest.raises(TimingAuditError, match="HTTP 503"):
        audit(api, model="fake", n_samples=6)


@pytest.mark.slow
def test_report_json_and_plot(global_run, tmp_path):
    rep = global_run[0]
    d = json.loads(rep.to_json())
    assert d["detected"] is True and d["result"]["n_hit"] == N and ATTACKER not in rep.to_json() and VICTIM not in rep.to_json()
    rep.save_plot(tmp_path / "p.png")
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _cli(argv):
    import argparse
    parser = argparse.ArgumentParser(prog="minikv")
    add_audit_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def _timing_argv(api, out, *extra):
    return ["audit", "timing", "--base-url", api.url, "--api-key", ATTACKER, "--victim-key", VICTIM,
            "--model", "fake", "--samples", str(N), "--prompt-tokens", "40", "--no-progress",
            "--out", str(out), *extra]


@pytest.mark.slow
def test_cli_exit_codes_and_outputs(api, tmp_path, capsys, global_run, monkeypatch):
    assert _cli(_timing_argv(api, tmp_path / "a", "--fail-on-detect")) == 2  # end to end
    assert "CACHE SHARING DETECTED" in capsys.readouterr().out
    assert len(list((tmp_path / "a").glob("*.json"))) == 1 and len(list((tmp_path / "a").glob("*.png"))) == 1
    api.mode = "per_tenant"  # few samples suffice for a negative: exit 0 despite --fail-on-detect
    argv = _timing_argv(api, tmp_path / "c", "--fail-on-detect")
    argv[argv.index("--samples") + 1] = "6"
    assert _cli(argv) == 0
    captured = capsys.readouterr()
    assert "no evidence of sharing" in captured.out and "cannot reach p < 1e-08" in captured.err
    # detected without --fail-on-detect is a successful run: exit 0 (reuse a detecting report)
    import minikv.audit.timing as timing
    monkeypatch.setattr(timing, "run_timing_audit", lambda *a, **k: global_run[0])
    assert _cli(_timing_argv(api, tmp_path / "b")) == 0
    assert "CACHE SHARING DETECTED" in capsys.readouterr().out


def test_cli_dry_run_and_errors(api, tmp_path, capsys):
    assert _cli(_timing_argv(api, tmp_path / "d", "--dry-run")) == 0
    assert api.log == [] and "would send" in capsys.readouterr().out and not (tmp_path / "d").exists()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    dead = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"  # bound, never listening
    try:
        argv = _timing_argv(api, tmp_path / "e")
        argv[argv.index(api.url)] = dead
        assert _cli(argv) == 1
    finally:
        closed.close()
    assert "error:" in capsys.readouterr().err
    assert _cli(["audit", "timing", "--base-url", api.url, "--api-key", "wrong", "--model", "fake",
                 "--out", str(tmp_path / "f"), "--no-progress"]) == 1
