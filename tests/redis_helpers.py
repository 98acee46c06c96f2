"""A real Redis for the redis-marked tests: the one `make test` started, else a private one for the module.

Without ``redis-server`` the tests skip, naming the install command -- except where
``$MINIKV_REQUIRE_REDIS`` is set (CI, ``.ci/run``), where a missing Redis is a failure.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "redis_server.py"
INSTALL = "apt-get install -y redis-server (then `make redis`, or let `make test` start it)"
TEST_PORT = 6391  # a private server of the tests' own, when make test's (6390) is not up


def _script():
    spec = importlib.util.spec_from_file_location("minikv_redis_server", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def redis_base():
    """Yield ``redis://127.0.0.1:PORT``; start (and afterwards stop) a private server if needed."""
    if shutil.which("redis-server") is None or importlib.util.find_spec("redis") is None:
        msg = f"no redis-server (or no redis client): {INSTALL}; pip install 'minikv[tiers]'"
        if os.environ.get("MINIKV_REQUIRE_REDIS"):
            pytest.fail(msg)
        pytest.skip(msg)
    srv = _script()
    url = os.environ.get("MINIKV_REDIS_URL")
    state = srv.read_state(srv.DEFAULT_PORT)
    if url is None and state and srv.ping(srv.DEFAULT_PORT):
        url = state["url"]
    started = False
    if url is None:
        run = subprocess.run([sys.executable, str(SCRIPT), "start", "--port", str(TEST_PORT)],
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stdout + run.stderr
        url, started = json.loads(srv.files(TEST_PORT)[0].read_text())["url"], True
    try:
        yield url.rsplit("/", 1)[0]
    finally:
        if started:
            subprocess.run([sys.executable, str(SCRIPT), "stop", "--port", str(TEST_PORT)], capture_output=True)


def fresh_db(base: str, db: int):
    """A redis client on database ``db``, emptied (each test module keeps to its own database)."""
    import redis
    client = redis.Redis.from_url(f"{base}/{db}")
    client.flushdb()
    return client
