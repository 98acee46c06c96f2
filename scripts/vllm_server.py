#!/usr/bin/env python3
"""Start, stop and locate the project's real vLLM server (CPU build, in ``.venv-vllm``).

    python scripts/vllm_server.py start [--port 8017]   # waits for /health, writes the PID file
    python scripts/vllm_server.py status                # prints the base URL, exit 1 if not up
    python scripts/vllm_server.py stop                  # by PID (the process group it leads)

``make test`` starts it once before pytest and nbval and stops it afterwards, so the tests and
lesson 11 share one warm server (start-up takes one to a few minutes on 2 cores). Whoever needs
the server reads ``out/vllm/server.json`` (``{"base_url", "pid", "model", "block_size"}``) or
``$MINIKV_VLLM_URL``.  A server on another ``--port`` keeps files of its own (``server-<port>.json``,
``vllm-<port>.pid``), so ``stop --port P`` only ever stops that one.

What the server runs, and why each flag:

* ``--model <dir>``: the converted SmolLM2 checkpoint of ``minikv.models.hub`` (the course
  model; vLLM reads the same config.json/safetensors/tokenizer files minikv does), served as
  ``smollm2-135m-instruct`` so clients name it the way they name it for ``minikv serve``.
* ``--dtype float32``: the checkpoint's dtype; CPU bf16 kernels need AVX512-BF16.
* ``--enable-prompt-tokens-details``: responses carry ``usage.prompt_tokens_details.
  cached_tokens``, which the isolation audit and the gateway's start-up probe read.
  Prefix caching itself is on by default in vLLM 0.32 (V1 engine).
* ``VLLM_CPU_KVCACHE_SPACE`` (GiB of RAM for KV blocks, default here 2): SmolLM2-135M needs
  30 layers x 2 x 3 KV heads x 64 dims x 4 bytes = 46 KB per token, so 2 GiB hold ~45k tokens --
  plenty for the tests, and small enough for a 24 GiB machine shared with other work.
* loopback only (``--host 127.0.0.1``): this server has no authentication at all.
* stats logging stays on: without it ``/metrics`` has no ``vllm:num_requests_running``, which
  the tests read to see that a client's disconnect aborted its request.

vLLM's CPU build uses 128-token KV blocks; ``block_size`` in the state file records it for the
tests (prompts must be longer than one block, or nothing can ever be cached).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_PY = ROOT / ".venv-vllm" / "bin" / "python"
STATE_DIR = ROOT / "out" / "vllm"
MODEL = "smollm2-135m-instruct"
CPU_BLOCK_SIZE = 128
DEFAULT_PORT = 8017


def files(port: int) -> tuple[Path, Path, Path]:
    """(state, PID file, log) of the server on ``port``: ``server.json``, ``vllm.pid`` and ``vllm.log``
    for the default port (the one the tests and lesson 11 read), ``*-<port>`` for any other, so a
    second server (a benchmark's, say) never overwrites or stops the first."""
    tag = "" if port == DEFAULT_PORT else f"-{port}"
    return STATE_DIR / f"server{tag}.json", STATE_DIR / f"vllm{tag}.pid", STATE_DIR / f"vllm{tag}.log"


def say(msg: str) -> None:
    print(f"[vllm-server] {msg}", flush=True)


def model_dir(name: str) -> str:
    """The converted checkpoint directory, resolved by the project's venv (it owns minikv)."""
    py = ROOT / ".venv" / "bin" / "python"
    out = subprocess.run([str(py if py.exists() else sys.executable), "-m", "minikv.models.hub", "path",
                          name, "-q"], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise SystemExit(f"[vllm-server] cannot resolve model {name!r}: {out.stderr.strip()}")
    return out.stdout.strip()


def healthy(base: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=timeout) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
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
    if state and healthy(state["base_url"].removesuffix("/v1")):
        say(f"already running: {state['base_url']} (pid {state['pid']})")
        return 0
    if not VENV_PY.exists():
        say("no .venv-vllm: run `make vllm` first (vLLM's CPU build, Linux x86-64 only)")
        return 1
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    base = f"http://127.0.0.1:{args.port}"
    if healthy(base):
        say(f"port {args.port} already serves something that is not ours; choose --port")
        return 1
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(args.kv_gib), VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [str(VENV_PY), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir(args.model),
           "--served-model-name", args.model, "--dtype", "float32", "--enable-prompt-tokens-details",
           "--host", "127.0.0.1", "--port", str(args.port), "--max-model-len", str(args.max_model_len)]
    started = time.time()
    with open(log_file, "wb") as log:
        # A process group of its own: the server forks engine workers, and stop() ends the whole
        # group by this one PID.  Not a session of its own: Linux's autogroup scheduler gives each
        # session a fair share as a whole, and vLLM's CPU build pins its busy worker to core 0, so a
        # session of its own owned that core.  Every `import torch` pins itself to each core in turn
        # (MKL counting cores), and a test process importing torch then waited behind vLLM's session
        # for minutes.  Measured (2 cores, vLLM serving a steady load, two busy loops beside): in
        # its own session, 5 fresh imports took 3.6-4.5 s, the sixth 187 s, and the seventh was
        # still waiting 6 min later; in the caller's session, 16 of 16 took 1.7-2.6 s.  The price:
        # under that load vLLM shares core 0 with its neighbours (timing audit, 30 samples of 512
        # tokens: hit/miss medians 520/1,566 ms against 263/816 ms in its own session; p = 8.5e-18
        # in both).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                process_group=0)
    pid_file.write_text(f"{proc.pid}\n")
    while time.time() - started < args.timeout:
        if proc.poll() is not None:
            say(f"vLLM exited with status {proc.returncode} during start-up; last lines of {log_file}:")
            print("\n".join(log_file.read_text(errors="replace").splitlines()[-30:]))
            pid_file.unlink(missing_ok=True)
            return 1
        if healthy(base):
            took = time.time() - started
            state_file.write_text(json.dumps({"base_url": f"{base}/v1", "pid": proc.pid, "model": args.model,
                                         "block_size": CPU_BLOCK_SIZE, "startup_s": round(took, 1)}))
            say(f"up at {base}/v1 in {took:.0f} s (pid {proc.pid}, log {log_file})")
            return 0
        time.sleep(1.0)
    say(f"no /health after {args.timeout:.0f} s; stopping it (log: {log_file})")
    stop_pid(proc.pid)
    return 1


def stop_pid(pid: int, grace: float = 30.0) -> None:
    """SIGTERM the group ``pid`` leads, then SIGKILL whatever is left after ``grace`` s."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        deadline = time.time() + grace
        while time.time() < deadline:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    return
            except ChildProcessError:   # not our child (started by another process)
                if not alive(pid):
                    return
            time.sleep(0.2)


def stop_recorded(state_file: Path, pid_file: Path, say) -> int:
    """Stop the server whose PID ``pid_file`` records (if it still runs), then forget it: both
    files go.  ``say`` prints in the caller's voice.  Shared by every server helper in scripts/."""
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        say("not running (no PID file)")
        return 0
    if alive(pid):
        stop_pid(pid)
        say(f"stopped pid {pid}")
    pid_file.unlink(missing_ok=True)
    state_file.unlink(missing_ok=True)
    return 0


def stop(args: argparse.Namespace) -> int:
    state_file, pid_file, _ = files(args.port)
    return stop_recorded(state_file, pid_file, say)


def status(args: argparse.Namespace) -> int:
    state = read_state(args.port)
    if state and healthy(state["base_url"].removesuffix("/v1")):
        print(state["base_url"])
        return 0
    say("not running")
    return 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Start/stop the project's vLLM server (see module doc).")
    p.add_argument("command", choices=("start", "stop", "status"))
    p.add_argument("--port", type=int, default=int(os.environ.get("MINIKV_VLLM_PORT", DEFAULT_PORT)))
    p.add_argument("--model", default=MODEL)
    p.add_argument("--kv-gib", type=int, default=int(os.environ.get("MINIKV_VLLM_KV_GIB", "2")))
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--timeout", type=float, default=float(os.environ.get("MINIKV_VLLM_START_TIMEOUT", "600")))
    args = p.parse_args(argv)
    return {"start": start, "stop": stop, "status": status}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
