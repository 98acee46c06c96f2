"""``minikv.engine.host_memory``: a CPU engine keeps freed memory (counted in page faults, not timed).

Each check runs in a fresh process, since the allocator's settings belong to the whole process:
build a CPU engine (or not), then allocate and free a 64 MiB tensor and allocate a 48 MiB one (sizes
of a prefill's per-layer temporaries, which vary from layer to layer and step to step), and count
the minor page faults of the second.  With the setting in force it reuses pages of the first (a few
faults); without it, glibc maps fresh memory and faults in all 12,288 pages.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CODE = r"""
import json, resource, sys, torch
if sys.argv[1] == "engine":
    from minikv import LLM
    LLM("tiny-random", dtype="float32", device="cpu")
from minikv.engine import host_memory
def touch(mib):
    t = torch.empty(mib * 256 * 1024, dtype=torch.float32)
    t.fill_(1.0)
    del t
touch(64)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch(48)
print(json.dumps({"faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before,
                  "applied": host_memory._applied}))
"""

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt: Linux only")


def _run(mode: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", CODE, mode], capture_output=True, text=True, timeout=300,
                         env={**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cpu_engine_keeps_freed_memory_for_the_next_allocation():
    kept = _run("engine")
    assert kept["applied"] is True
    assert kept["faults"] < 1000, kept  # the 48 MiB reuse the 64 MiB's pages
    plain = _run("bare")  # no engine built: glibc's defaults
    assert plain["applied"] is None and plain["faults"] > 8000, plain  # 12,288 pages faulted in anew


def test_the_setting_can_be_turned_off():
    off = _run("engine", MINIKV_KEEP_FREED_MEMORY="0")
    assert off["applied"] is False and off["faults"] > 8000, off
