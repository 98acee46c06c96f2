"""minikv.serve.lab.ServerLab: the lesson-09 helper starts real servers and always stops them."""
from __future__ import annotations

import httpx
import pytest

from minikv.serve.lab import ServerLab

KEYS = {"sk-a": "alice", "sk-b": "bob"}


def test_lab_serves_named_servers_and_stops_them_on_failure(tmp_path):
    lab = ServerLab("tiny-random", KEYS, tmp_path, num_blocks=64, enable_prefix_caching=True)
    with pytest.raises(ZeroDivisionError):
        with lab.guard():
            lab.start("tenant", cache_isolation="tenant")
            r = httpx.post(lab.url("tenant") + "/completions", timeout=60, headers={"Authorization": "Bearer sk-a"},
                           json={"model": "tiny-random", "prompt": [5, 6, 7, 8], "max_tokens": 1})
            assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4
            assert lab.llms["tenant"].engine.config.cache_isolation == "tenant"
            1 / 0                                    # a failing cell
    assert lab.servers == {}                         # the guard stopped the server
    assert lab.trails["tenant"].is_file() and lab.trails["tenant"].read_text().strip()   # the trail was written
    with pytest.raises(KeyError, match="no running server named 'tenant'"):
        lab.url("tenant")
    lab.stop()                                       # stopping twice is harmless


def test_lab_refuses_a_second_server_with_the_same_name(tmp_path):
    lab = ServerLab("tiny-random", KEYS, tmp_path, num_blocks=64)
    try:
        lab.start("x")
        with pytest.raises(ValueError, match="a server named 'x' is already running"):
            lab.start("x")
    finally:
        lab.stop()
