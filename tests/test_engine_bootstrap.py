"""The engine's torch floor, enforced where torch comes from: scripts/bootstrap.py.

A GPU box whose system Python has an older torch used to install cleanly and then fail on the
first forward pass (``scaled_dot_product_attention(enable_gqa=...)`` needs torch 2.5).  These
tests hand bootstrap a fake base python whose ``import torch`` reports a chosen version, and
check that a too-old one is refused -- before any venv is created -- with a message naming the
version, the floor and the fix, and that a new enough one is accepted.
"""
from __future__ import annotations

import importlib.util
import stat
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bootstrap():
    spec = importlib.util.spec_from_file_location("minikv_bootstrap", ROOT / "scripts" / "bootstrap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _python_with_torch(tmp_path: Path, version: str) -> Path:
    """An executable that runs this interpreter with a stub ``torch`` (only ``__version__``)."""
    (tmp_path / "stub" / "torch").mkdir(parents=True)
    (tmp_path / "stub" / "torch" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nPYTHONPATH="{tmp_path / "stub"}" exec "{sys.executable}" "$@"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    return exe


def test_the_floors_match_what_the_engine_uses(bootstrap):
    import tomllib
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.5" in deps and "transformers>=4.56" in deps
    assert bootstrap.torch_floor() == "2.5"
    assert bootstrap.version_tuple("2.4.1+cu121") == (2, 4, 1) < bootstrap.version_tuple("2.5")
    assert bootstrap.version_tuple("2.5.0a0+git1234") >= bootstrap.version_tuple("2.5")
    assert bootstrap.version_tuple("2.10.0") > bootstrap.version_tuple("2.5")  # not string order


@pytest.mark.parametrize("mode", ["system", "auto"])
def test_an_old_system_torch_is_refused_before_anything_is_created(bootstrap, tmp_path, monkeypatch, mode):
    base = _python_with_torch(tmp_path, "2.4.1+cu121")
    monkeypatch.setenv("MINIKV_TORCH", mode)
    venv = tmp_path / "venv"
    with pytest.raises(SystemExit) as exc:
        bootstrap.create_venv(str(base), venv)
    msg = str(exc.value)
    assert "torch 2.4.1+cu121" in msg and "torch>=2.5" in msg and "enable_gqa" in msg
    assert "pip install --upgrade 'torch>=2.5'" in msg and "MINIKV_TORCH=pip" in msg  # the fixes
    assert not venv.exists()


def test_a_new_enough_system_torch_passes_the_check(bootstrap, tmp_path):
    base = _python_with_torch(tmp_path, "2.5.1+cu124")
    bootstrap.check_torch(base, "the base python")  # returns: no SystemExit
    assert bootstrap.torch_version(base) == "2.5.1+cu124"


def test_no_torch_at_all_is_not_refused(bootstrap, tmp_path):
    """A base python without torch is the normal CPU path: bootstrap installs the pinned one."""
    exe = tmp_path / "python"
    exe.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S -c "import sys; sys.exit(1)"\n')
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    assert bootstrap.torch_version(exe) is None
    bootstrap.check_torch(exe, "the base python")


def test_an_unknown_mode_is_refused(bootstrap, tmp_path, monkeypatch):
    monkeypatch.setenv("MINIKV_TORCH", "sytem")
    with pytest.raises(SystemExit, match="MINIKV_TORCH='sytem'"):
        bootstrap.create_venv(sys.executable, tmp_path / "venv")
    assert not (tmp_path / "venv").exists()


def test_the_running_torch_meets_the_floor(bootstrap):
    import torch
    assert bootstrap.version_tuple(torch.__version__) >= bootstrap.version_tuple(bootstrap.torch_floor())
