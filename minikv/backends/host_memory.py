"""Host memory for CPU inference: keep freed memory instead of handing it back to the kernel.

A prefill of a few thousand tokens makes temporaries of tens of megabytes in every layer (the
gate_up matmul's output for 4,096 tokens of SmolLM2 is 50 MB in fp32), frees them, and makes
them again in the next layer.  glibc's ``malloc`` serves any request above its mmap threshold
(at most 32 MB, adjusted as blocks are freed) with a fresh ``mmap`` and returns it to the kernel
on ``free``; the next allocation of the same size then starts from pages the kernel must fault in
and zero again, one 4 KiB page at a time.  Memory below that threshold comes from the heap, but
the heap's top is trimmed back to the kernel as soon as 128 KiB or so lie free there.  Either way
the engine pays for page faults on memory it owned a moment ago.

A prefill of the benchmark's prompts touches gigabytes of pages anew this way; with the two
settings below almost none (docs/BENCHMARKS.md, "Host memory", has the counts).  Production CPU engines get the same effect
another way: vLLM's CPU documentation has you preload TCMalloc, whose caches keep freed memory.

:func:`keep_freed_memory` asks glibc, through ``mallopt``, to (1) serve every request from the
heap instead of fresh mappings (``M_MMAP_MAX = 0``) and (2) trim the heap only when more than
1 GiB lies free at its top (``M_TRIM_THRESHOLD``).  The process then keeps the high-water mark of
its temporaries and reuses it.  It is a setting of the whole process, applied when a CPU engine
is built; ``MINIKV_KEEP_FREED_MEMORY=0`` leaves the allocator as it was.  Elsewhere than glibc
(macOS, musl) it does nothing.

The price of keeping freed memory is that a process never gives it back.  That is right for the
temporaries, which the next step wants again, and wrong for the one allocation that is big and
lives as long as its engine: the KV pool (1 GiB by default).  A process that builds engine after
engine -- a benchmark, a lesson comparing forks, the test suite -- would keep every dead pool's
gigabyte in its heap, where fragmentation stops the next pool from reusing it: such a process's
peak resident memory roughly doubles (docs/BENCHMARKS.md, "Host memory").
:func:`mapped_zeros` therefore gives the pool pages of its own, an anonymous ``mmap`` outside the
heap: the kernel hands them out already zero, only as they are first written (a pool a lesson
barely uses costs little), and takes them back the moment the pool's tensor dies.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import os
import sys
import threading

import torch

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_MAX = -4
TRIM_THRESHOLD_BYTES = 1 << 30
MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (mman-common.h); Python 3.11's mmap module lacks the name

_lock = threading.Lock()
_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Apply the settings above once per process; returns whether they are in force."""
    global _applied
    with _lock:
        if _applied is None:
            _applied = _apply()
        return _applied


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The C library, loaded once (``None`` where it cannot be found or loaded)."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    except (OSError, TypeError):
        return None


def _apply() -> bool:
    if os.environ.get("MINIKV_KEEP_FREED_MEMORY", "1") == "0":
        return False
    libc = _libc()
    try:
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # glibc only: another libc's mallopt takes other numbers
    except AttributeError:  # no libc (None), or not glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and mallopt(M_MMAP_MAX, 0) == 1


def give_back_freed_memory() -> bool:
    """Hand the heap's free pages back to the kernel now (glibc ``malloc_trim(0)``).

    The price of :func:`keep_freed_memory` is a process that keeps its high-water mark.  A process
    that moves from one large job to another -- a benchmark section to the next, each with its own
    engines and transformers models -- may ask for the pages back between them: ``malloc_trim``
    returns every free page of the heap, not only its top, so a process running several sections
    peaks near its largest section instead of their sum.  Returns False where there is no glibc.
    """
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None) if libc is not None else None
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on pages of its own (an anonymous ``mmap``, see the module doc), given
    back to the kernel when the tensor is freed.  The tensor holds the mapping alive."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:  # nothing to map (mmap refuses a length of 0)
        return torch.zeros(shape, dtype=dtype)
    # Private, anonymous, zero-filled by the kernel on first touch, not now: a pool's pages fault
    # in as its blocks are first written, a small fraction of a prefill's cost, once in the pool's
    # life.  Populating all of it up front (MAP_POPULATE) would make every fork of a lesson or
    # benchmark pay for pages it never uses.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def populate(t: torch.Tensor) -> str:
    """Fault in every page of ``t`` now, for writing, without changing a byte of it.

    A pool on :func:`mapped_zeros` pages pays for each page the first time it is written, inside
    whatever write comes first: a request's K/V store, or the ``on_alloc`` scrub that zeroes the
    block just before.  The price is not fixed: on a VM that reports free pages back to its host
    (``page_reporting``), a page that went back costs the host a fault of its own, and zeroing a
    fresh gigabyte page by page varies several-fold from run to run, while asking the kernel for
    all the pages at once is steady (docs/BENCHMARKS.md, "Host memory").  A long-running server pays this once in its
    life; a benchmark that wants the steady state pays it before it starts the clock.

    Linux's ``madvise(MADV_POPULATE_WRITE)`` does exactly this in the kernel.  Elsewhere, or on an
    older kernel, each page gets one in-place ``add_(0)`` of one byte, which writes the byte back
    unchanged (the contents stay; do not call it while another thread writes ``t``).
    Returns how it was done: ``"madvise"`` or ``"touch"``.
    """
    if not t.is_contiguous():
        raise ValueError(f"populate needs a contiguous tensor, got strides {t.stride()}")
    flat = t.view(-1).view(torch.uint8)
    if flat.numel() == 0:
        return "madvise"
    page = mmap.PAGESIZE
    start = flat.data_ptr() - flat.data_ptr() % page  # madvise wants a page-aligned start
    length = flat.data_ptr() + flat.numel() - start
    madvise = getattr(_libc(), "madvise", None)
    if madvise is not None and sys.platform.startswith("linux"):
        madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if madvise(start, length, MADV_POPULATE_WRITE) == 0:
            return "madvise"
    first = (page - flat.data_ptr() % page) % page  # the first byte of each page the tensor spans
    flat[:1].add_(0)
    flat[first::page].add_(0)
    return "touch"


class HostMemory:
    """A CPU pool's :class:`~minikv.engine.kv_pool.PoolMemory`: :func:`mapped_zeros` pages, made
    resident by :func:`populate`.  Elsewhere than the CPU, ``torch.zeros`` (resident already)."""

    def zeros(self, shape, dtype, device) -> torch.Tensor:
        if device.type == "cpu":
            return mapped_zeros(shape, dtype)
        return torch.zeros(shape, dtype=dtype, device=device)

    def populate(self, t: torch.Tensor) -> str:
        return populate(t) if t.device.type == "cpu" else "resident"


HOST_MEMORY = HostMemory()
