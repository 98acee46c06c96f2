"""``minikv.backends.host_memory``: a CPU engine keeps freed memory (counted in page faults, not timed).

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
from minikv.backends import host_memory
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


POOL_CODE = r"""
import gc, json, sys, torch
from minikv import LLM
def rss_mib():
    return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) / 1024
llm = LLM("tiny-random", dtype=sys.argv[1], device="cpu", num_blocks=int(sys.argv[2]))
pool = llm.engine.pool
zero = bool((pool._kv == 0).all())  # zero from the start, pad block included
pool.k_cache.fill_(1.0)  # every page of the pool now resident (a pool in use)
pool.v_cache.fill_(1.0)
nbytes, mid = pool._kv.nbytes, rss_mib()
del llm, pool
gc.collect()  # an engine's objects point at each other: the cyclic collector frees it
print(json.dumps({"zero": zero, "pool_mib": nbytes / 2**20, "given_back_mib": mid - rss_mib()}))
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_dead_pool_gives_its_memory_back_despite_the_kept_heap(dtype):
    """The KV pool is the one big allocation that must *not* be kept: it lives on pages of its own
    (``host_memory.mapped_zeros``), zero from the start, and the process's resident memory drops
    by its size once the engine is gone, although the engine set the allocator to keep freed memory."""
    out = subprocess.run([sys.executable, "-c", POOL_CODE, dtype, "40000"], capture_output=True, text=True,
                         timeout=300, env=os.environ.copy())
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["zero"] is True, got
    assert got["pool_mib"] > 100, got  # big enough to see in the resident size
    assert got["given_back_mib"] > 0.9 * got["pool_mib"], got


def test_mapped_zeros_is_a_writable_zero_tensor_of_the_asked_shape():
    import torch

    from minikv.backends.host_memory import mapped_zeros

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        t = mapped_zeros((3, 5, 7), dtype)
        assert t.shape == (3, 5, 7) and t.dtype == dtype and t.is_contiguous() and bool((t == 0).all())
        t[1, 2, 3] = 2.5
        assert t.sum().item() == 2.5 and t.view(-1)[1 * 35 + 2 * 7 + 3].item() == 2.5
    assert mapped_zeros((0, 4), torch.float32).shape == (0, 4)


def _faults_of_a_full_write(t) -> int:
    import resource

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    t.fill_(3.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.parametrize("how", ["madvise", "touch"])
def test_populate_faults_every_page_in_and_changes_no_byte(monkeypatch, how):
    """After ``populate`` a full write of the tensor faults (almost) no page in; without it, every
    page.  Counted in page faults, not timed.  ``touch`` is the fallback where madvise refuses."""
    import torch

    from minikv.backends import host_memory

    if how == "touch":  # an advice number no kernel knows: madvise fails with EINVAL
        monkeypatch.setattr(host_memory, "MADV_POPULATE_WRITE", 12345)
    pages = (64 << 20) // 4096
    cold = host_memory.mapped_zeros(((64 << 20) // 4,), torch.float32)
    assert _faults_of_a_full_write(cold) > 0.9 * pages  # the control: lazy pages fault on first write
    t = host_memory.mapped_zeros(((64 << 20) // 4,), torch.float32)
    t[::1000] = torch.arange(t[::1000].numel(), dtype=torch.float32)  # some data, on some pages
    before = t.clone()
    assert host_memory.populate(t) == how
    assert torch.equal(t, before)  # contents unchanged
    assert _faults_of_a_full_write(t) < 0.05 * pages


def test_populate_refuses_a_strided_tensor_by_its_strides():
    import torch

    from minikv.backends.host_memory import mapped_zeros, populate

    with pytest.raises(ValueError, match=r"contiguous.*\(1, 4\)"):
        populate(mapped_zeros((4, 4), torch.float32).t())


def test_a_prefaulted_pool_keeps_its_blocks():
    import torch

    from minikv.backends.host_memory import HOST_MEMORY
    from minikv.engine.kv_pool import KVPool

    pool = KVPool(2, 8, 4, 2, 8, torch.float32, "cpu", memory=HOST_MEMORY)
    pool.k_cache[0, 3] = 1.5
    pool.v_cache[1, 5] = -2.0
    k, v = pool.k_cache.clone(), pool.v_cache.clone()
    assert pool.prefault() in ("madvise", "touch")
    assert torch.equal(pool.k_cache, k) and torch.equal(pool.v_cache, v)
    assert int(torch.count_nonzero(pool._kv[:, pool.pad_block])) == 0  # the pad block still zero


TRIM_CODE = r"""
import json, sys, torch
from minikv.backends import host_memory
def rss_mib():
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096 >> 20
assert host_memory.keep_freed_memory()
t = torch.empty(256 * 256 * 1024, dtype=torch.float32)   # 256 MiB from the heap (M_MMAP_MAX = 0)
t.fill_(1.0)
small = torch.ones(16)                                   # allocated above it: the heap's top is not free
del t
kept = rss_mib()
trimmed = host_memory.give_back_freed_memory()
print(json.dumps({"kept": kept, "after": rss_mib(), "trimmed": trimmed}))
"""


def test_freed_memory_can_be_given_back_between_jobs():
    out = subprocess.run([sys.executable, "-c", TRIM_CODE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["trimmed"] is True
    assert got["kept"] - got["after"] > 200, got   # the freed 256 MiB leave the process's resident set
