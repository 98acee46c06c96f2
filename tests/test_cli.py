"""The ``minikv`` command: generate, serve (flags + a real subprocess), audit, bench."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx
import pytest

from minikv.cli import build_parser, main
from minikv.engine.lifecycle import VerifyHits
from minikv.engine.cli_flags import engine_kwargs_from_args

ROOT = Path(__file__).resolve().parents[1]


def test_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for cmd in ("generate", "serve", "audit", "bench"):
        assert cmd in out


def test_audit_has_isolation_next_to_the_others():
    args = build_parser().parse_args(["audit", "isolation", "--model", "tiny-random"])
    assert args.audit_command == "isolation" and callable(args.func)
    for sub in ("timing", "gu", "detect"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["audit", sub, "--help"])


def test_generate_prints_the_completion(tiny_path, capsys):
    from minikv import LLM, SamplingParams
    expected = LLM(str(tiny_path)).generate("Hello there", SamplingParams(max_tokens=5, temperature=0,
                                                                          ignore_eos=True))[0].outputs[0].text
    rc = main(["generate", "--model", str(tiny_path), "Hello there", "--max-tokens", "5", "--temperature", "0",
               "--ignore-eos"])
    assert rc == 0
    assert capsys.readouterr().out == expected + "\n"
    assert main(["generate", "--model", str(tiny_path), "Hi", "--max-tokens", "3", "--chat"]) == 0


def test_generate_bad_input_exits_1(tiny_path, capsys):
    assert main(["generate", "--model", str(tiny_path), "Hi", "--max-tokens", "0"]) == 1
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "--model", str(tiny_path), "", "--max-tokens", "2"]) == 1


def test_policy_flags_map_to_engine_settings(tmp_path):
    secret = tmp_path / "secret"
    secret.write_bytes(b"0123456789abcdef0123456789abcdef\n")
    args = build_parser().parse_args([
        "serve", "--model", "tiny-random", "--api-keys", "k.json", "--cache-isolation", "shared",
        "--hash-algo", "trunc32", "--no-chain-hashes", "--verify-hits", "tokens", "--scrub", "none",
        "--enable-prefix-caching", "--shared-prefix", "You are helpful.", "--shared-prefix", "Be brief.",
        "--max-cached-blocks-per-tenant", "4", "--audit-log", "trail.jsonl", "--block-size", "8",
        "--num-blocks", "64", "--max-num-seqs", "4", "--dtype", "float32", "--device", "cpu", "--seed", "3",
        "--engine-secret-file", str(secret), "--report-cached-tokens"])
    kw = engine_kwargs_from_args(args)
    assert kw == dict(model="tiny-random", device="cpu", dtype="float32", seed=3, block_size=8, num_blocks=64,
                      max_num_seqs=4, enable_prefix_caching=True, cache_isolation="shared", hash_algo="trunc32",
                      chain_hashes=False, scrub="none", max_cached_blocks_per_tenant=4, audit_log="trail.jsonl",
                      verify_hits=VerifyHits.TOKENS, shared_prefixes=("You are helpful.", "Be brief."),
                      engine_secret=b"0123456789abcdef0123456789abcdef")
    assert args.report_cached_tokens and args.host == "127.0.0.1"
    # nothing given -> only the model: the engine's (secure) defaults apply
    plain = build_parser().parse_args(["serve", "--model", "m", "--api-keys", "k.json"])
    assert engine_kwargs_from_args(plain) == {"model": "m"}
    assert build_parser().parse_args(["serve", "--model", "m", "--api-keys", "k", "--chain-hashes"]).chain_hashes
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--api-keys", "k", "--cache-isolation", "nope"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m", "--api-keys", "k", "--num-blocks", "0"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--model", "m"])  # --api-keys is required


def test_bench_delegates(monkeypatch):
    seen = {}
    fake = types.ModuleType("minikv.bench")
    fake.main = lambda argv: seen.setdefault("argv", argv) and 0
    monkeypatch.setitem(sys.modules, "minikv.bench", fake)
    assert main(["bench", "--quick", "-n", "3"]) == 0
    assert seen["argv"] == ["--quick", "-n", "3"]


def test_bench_missing_module(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "minikv.bench", None)  # import raises ModuleNotFoundError
    assert main(["bench"]) == 1
    assert "not available" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_subprocess(tiny_path, tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-a": "alice", "sk-b": "bob"}))
    secret = tmp_path / "secret"
    secret_value = "SUPERSECRET-ENGINE-KEY-0123456789"
    secret.write_text(secret_value)
    trail = tmp_path / "trail.jsonl"
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "minikv", "serve", "--model", str(tiny_path), "--host", "127.0.0.1",
           "--port", str(port), "--api-keys", str(keys), "--enable-prefix-caching", "--num-blocks", "128",
           "--report-cached-tokens", "--audit-log", str(trail), "--engine-secret-file", str(secret)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 90
        while True:
            assert proc.poll() is None, proc.stdout.read()
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "server did not come up"
            time.sleep(0.2)
        body = {"model": str(tiny_path), "prompt": "subprocess server " * 4, "max_tokens": 3}
        r = httpx.post(base + "/v1/completions", json=body, headers={"Authorization": "Bearer sk-a"}, timeout=60)
        assert r.status_code == 200, r.text
        assert "cached_tokens" in r.json()["usage"]["prompt_tokens_details"]
        assert httpx.post(base + "/v1/completions", json=body, timeout=60).status_code == 401
    finally:
        proc.terminate()  # by this process's own pid
        try:
            out, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert secret_value not in out and "subprocess server" not in out
    events = [json.loads(line) for line in trail.read_text().splitlines()]
    assert {"engine", "summary"} == {e["event"] for e in events}  # default level: one line per request
    assert {e["tenant"] for e in events if e["event"] == "summary"} == {"alice"}
