#!/usr/bin/env python3
"""Start, stop and locate the project's private Redis (the KV tier of ``minikv.tiers.redis_tier``).

    python scripts/redis_server.py start [--port 6390]   # waits for PING, writes the PID file
    python scripts/redis_server.py status                # prints the URL, exit 1 if not up
    python scripts/redis_server.py stop                  # by PID

``make redis`` starts it; ``make test`` starts it before pytest and nbval when ``redis-server``
is installed (``apt-get install -y redis-server``) and stops it afterwards, as it does vLLM
(scripts/vllm_server.py, the model of this script).  The tests read ``out/redis/server.json``
(``{"url", "pid", "port"}``) or ``$MINIKV_REDIS_URL``.

What the server runs, and why:

* ``--bind 127.0.0.1 --protected-mode yes``: loopback only; this Redis has no password, and
  what it holds (sealed K/V) is nobody else's business.
* ``--port 6390``: a port of its own, never the system Redis on 6379.
* ``--save '' --appendonly no``: a cache, never persisted; ``--dir out/redis`` keeps anything it
  writes inside the checkout.
* ``--maxmemory 256mb --maxmemory-policy allkeys-lru``: bounded, evicting old blocks itself.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_server import alive, stop_pid, stop_recorded  # noqa: E402 -- one way to check and stop a server by its PID
STATE_DIR = ROOT / "out" / "redis"
DEFAULT_PORT = 6390
INSTALL = "apt-get install -y redis-server"


def files(port: int) -> tuple[Path, Path, Path]:
    """(state, PID file, log) of the server on ``port`` (``*-<port>`` for a non-default port)."""
    tag = "" if port == DEFAULT_PORT else f"-{port}"
    return STATE_DIR / f"server{tag}.json", STATE_DIR / f"redis{tag}.pid", STATE_DIR / f"redis{tag}.log"


def say(msg: str) -> None:
    print(f"[redis-server] {msg}", flush=True)


def ping(port: int, timeout: float = 1.0) -> bool:
    """Does a Redis answer PING on loopback ``port``?  (RESP by hand: no client needed.)"""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def read_state(port: int) -> dict | None:
    try:
        state = json.loads(files(port)[0].read_text())
    except (OSError, ValueError):
        return None
    return state if alive(int(state.get("pid", 0))) else None


def start(args: argparse.Namespace) -> int:
    state_file, pid_file, log_file = files(args.port)
    state = read_state(args.port)
    if state and ping(args.port):
        say(f"already running: {state['url']} (pid {state['pid']})")
        return 0
    exe = shutil.which("redis-server")
    if exe is None:
        say(f"redis-server is not installed: {INSTALL}")
        return 1
    if ping(args.port):
        say(f"port {args.port} already serves a Redis that is not ours; choose --port")
        return 1
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    cmd = [exe, "--bind", "127.0.0.1", "--protected-mode", "yes", "--port", str(args.port),
           "--save", "", "--appendonly", "no", "--dir", str(STATE_DIR), "--daemonize", "no",
           "--maxmemory", args.maxmemory, "--maxmemory-policy", "allkeys-lru"]
    with open(log_file, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True)
    pid_file.write_text(f"{proc.pid}\n")
    started = time.time()
    while time.time() - started < args.timeout:
        if proc.poll() is not None:
            say(f"redis-server exited with status {proc.returncode}; last lines of {log_file}:")
            print("\n".join(log_file.read_text(errors="replace").splitlines()[-20:]))
            pid_file.unlink(missing_ok=True)
            return 1
        if ping(args.port):
            url = f"redis://127.0.0.1:{args.port}/0"
            state_file.write_text(json.dumps({"url": url, "pid": proc.pid, "port": args.port}))
            say(f"up at {url} (pid {proc.pid}, log {log_file})")
            return 0
        time.sleep(0.1)
    say(f"no PONG after {args.timeout:.0f} s; stopping it")
    stop_pid(proc.pid)
    pid_file.unlink(missing_ok=True)
    return 1


def stop(args: argparse.Namespace) -> int:
    state_file, pid_file, _ = files(args.port)
    return stop_recorded(state_file, pid_file, say)


def status(args: argparse.Namespace) -> int:
    state = read_state(args.port)
    if state and ping(args.port):
        print(state["url"])
        return 0
    say("not running")
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Start/stop the project's private Redis (see module doc).")
    p.add_argument("command", choices=("start", "stop", "status"))
    p.add_argument("--port", type=int, default=int(os.environ.get("MINIKV_REDIS_PORT", DEFAULT_PORT)))
    p.add_argument("--maxmemory", default="256mb")
    p.add_argument("--timeout", type=float, default=20.0)
    args = p.parse_args(argv)
    return {"start": start, "stop": stop, "status": status}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
