"""scripts/profile_ttft.py, the tool for the next GPU session's open question (why a prefix hit
was slower than a miss on an H200), runs here on the CPU: a tool first run inside a lease of
minutes must already work."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts" / "profile_ttft.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_it_profiles_one_hit_and_one_miss_with_both_profilers():
    p = _run("--device", "cpu", "--model", "tiny-random", "--system-tokens", "200")
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    out = p.stdout
    hit = re.search(r"^== hit: (\d+) tokens cached, TTFT (\d+\.\d\d) ms", out, flags=re.M)
    miss = re.search(r"^== miss: (\d+) tokens cached, TTFT (\d+\.\d\d) ms", out, flags=re.M)
    assert hit and miss, out[:3000]
    assert int(hit.group(1)) == 192 and int(miss.group(1)) == 0  # the system prompt's full blocks, and nothing
    for side in ("hit", "miss"):
        assert f"== cProfile, {side}, by time in the function itself\n   own ms    cum ms   calls  function" in out
        assert re.search(rf"== torch.profiler, {side}, by host time\n-+", out), out[-3000:]
        assert "by device time" not in out  # no CUDA here: no device table claimed
    listed = re.findall(r"^ +(\d+\.\d{3}) +(\d+\.\d{3}) +(\d+)  (\S.*)$", out, flags=re.M)
    assert len(listed) >= 2 * 10 and all(float(own) <= float(cum) + 1e-3 for own, cum, _, _ in listed)
    assert any(float(own) > 0 for own, _, _, _ in listed)  # milliseconds, not seconds rounded to 0.000


def test_bad_sizes_are_refused_by_name():
    p = _run("--device", "cpu", "--system-tokens", "3")
    assert p.returncode == 2 and "--system-tokens must be at least 16 (one block), got 3" in p.stderr
