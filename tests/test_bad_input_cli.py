"""The command line's bad input: one line that names the flag and the value, exit status 1 (2
for argparse), no traceback and no hang.  Secret and keys files must be regular files, read
with a bound; a key may have one role; ``--upstream`` URLs are parsed before anything starts."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minikv.cli import main
from minikv.security.keys import read_secret_file

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": "alice", "sk-b": "bob"}))
    return path


def _one_line(err: str) -> str:
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith(("error", "minikv"))]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("kind", ["fifo", "device", "directory", "missing", "too large"])
def test_secret_files_must_be_regular_and_small(tmp_path, kind):
    path = tmp_path / "secret"
    if kind == "fifo":
        os.mkfifo(path)                       # nobody writes it: opening it blocking would hang
    elif kind == "device":
        path = Path("/dev/zero")              # never ends: reading it whole would exhaust memory
    elif kind == "directory":
        path.mkdir()
    elif kind == "too large":
        path.write_bytes(b"x" * 70_000)
    words = {"fifo": "is a FIFO", "device": "is a device", "directory": "is a directory",
             "missing": "No such file", "too large": "larger than 65536 bytes"}[kind]
    with pytest.raises(ValueError, match=f"^--engine-secret-file '{path}'.*{words}"):
        read_secret_file(path, "--engine-secret-file")


def test_serve_refuses_a_fifo_secret_without_hanging(tmp_path, keys):
    fifo = tmp_path / "secret.fifo"
    os.mkfifo(fifo)
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-m", "minikv", "serve", "--model", "tiny-random", "--api-keys", str(keys),
                           "--engine-secret-file", str(fifo)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert _one_line(proc.stderr) == f"error: --engine-secret-file '{fifo}' is a FIFO; give a regular file"


def test_keys_files_refuse_devices(capsys):
    assert main(["serve", "--api-keys", "/dev/zero", "--model", "tiny-random"]) == 1
    assert "--api-keys '/dev/zero' is a device" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("flag", ["--operator-keys", "--gateway-keys"])
def test_serve_refuses_a_key_with_two_roles(tmp_path, keys, capsys, flag):
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"sk-x": "ops", "sk-b": "ops2"}))     # sk-b is bob's tenant key
    assert main(["serve", "--api-keys", str(keys), flag, str(other), "--model", "no-such-model"]) == 1
    line = _one_line(capsys.readouterr().err)
    assert line == f"error: entry 2 of --api-keys and entry 2 of {flag} are the same key; a key must have one role"
    assert "sk-b" not in line                                          # never print a key


def test_gateway_refuses_a_key_with_two_roles(tmp_path, keys, capsys):
    ops = tmp_path / "ops.json"
    ops.write_text(json.dumps({"sk-a": "ops"}))
    assert main(["gateway", "--upstream", "http://127.0.0.1:9/v1", "--api-keys", str(keys),
                 "--operator-keys", str(ops)]) == 1
    assert "entry 1 of --api-keys and entry 1 of --operator-keys are the same key" in \
        _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("url, words", [
    ("http://127.0.0.1:bad/v1", "Port could not be cast"),
    ("http://127.0.0.1:99999/v1", "Port out of range 0-65535"),
    ("http://[::1/v1", "Invalid IPv6 URL"),
    ("ftp://127.0.0.1/v1", "expected http(s)"),
    ("127.0.0.1:8000/v1", "expected http(s)"),
])
def test_gateway_upstream_urls_are_named(keys, capsys, url, words):
    with pytest.raises(SystemExit) as exc:
        main(["gateway", "--upstream", url, "--api-keys", str(keys)])
    assert exc.value.code == 2
    line = _one_line(capsys.readouterr().err)
    assert f"--upstream {url!r}" in line and words in line


def test_gateway_secret_and_upstream_key_files(tmp_path, keys, capsys):
    assert main(["gateway", "--upstream", "http://127.0.0.1:9/v1", "--api-keys", str(keys),
                 "--secret-file", "/dev/zero"]) == 1
    assert "--secret-file '/dev/zero' is a device" in _one_line(capsys.readouterr().err)
    fifo = tmp_path / "key.fifo"
    os.mkfifo(fifo)
    assert main(["gateway", "--upstream", "http://127.0.0.1:9/v1", "--api-keys", str(keys),
                 "--upstream-key-file", str(fifo)]) == 1
    assert f"--upstream-key-file '{fifo}' is a FIFO" in _one_line(capsys.readouterr().err)


@pytest.mark.parametrize("salts", [False, True])
def test_serve_refuses_a_tenant_named_like_a_salted_domain(tmp_path, salts):
    """A tenant called ``bob#salt-x`` would spend bob's tier quota and report as bob: refused
    whether or not client salts are trusted, in one line naming the tenant and the flag."""
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"sk-a": "alice", "sk-e": "bob#salt-x"}))
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    argv = [sys.executable, "-m", "minikv", "serve", "--model", "tiny-random", "--api-keys", str(path)]
    proc = subprocess.run(argv + (["--trust-client-salt"] if salts else []), env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 1
    line = _one_line(proc.stderr)
    assert "'bob#salt-x'" in line and "'bob'" in line and "--api-keys" in line, line
