"""Host memory for CPU inference: keep freed memory instead of handing it back to the kernel.

A prefill of a few thousand tokens makes temporaries of tens of megabytes in every layer (the
gate_up matmul's output for 4,096 tokens of SmolLM2 is 50 MB in fp32), frees them, and makes
them again in the next layer.  glibc's ``malloc`` serves any request above its mmap threshold
(at most 32 MB, adjusted as blocks are freed) with a fresh ``mmap`` and returns it to the kernel
on ``free``; the next allocation of the same size then starts from pages the kernel must fault in
and zero again, one 4 KiB page at a time.  Memory below that threshold comes from the heap, but
the heap's top is trimmed back to the kernel as soon as 128 KiB or so lie free there.  Either way
the engine pays for page faults on memory it owned a moment ago.

Counted on the 2-core CPU (SmolLM2, fp32, the benchmark's 16 prompts, 4,500 tokens): about
440,000 minor page faults per prefill (1.8 GB of pages touched anew), and 14,000 with the two
settings below; the prefill ran 157 and 166 GFLOP/s before, 176 and 174 after (two processes
each, alternating), at the same peak resident memory.  Production CPU engines get the same effect
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
gigabyte in its heap, where fragmentation stops the next pool from reusing it.  Measured on
the 2-core CPU with a random SmolLM2-shaped model: the benchmark's throughput section (2 requests)
peaked at 10.1 GB resident with pools in the heap and at 5.1 GB with pools on their own pages;
its prefill section at 8.5 and 4.2 GB.  (The first such run to be noticed, a ``make gpu-check``
dry run under transformers 5.17, was killed past 15 GB on a 24 GB machine.)
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
    returns every free page of the heap, not only its top.  Measured on the 2-core CPU: the gpu-check
    dry run's bench (four sections in one process) peaked at 8.7 GB resident, each section alone
    at 2.5-5.7 GB.  Returns False where there is no glibc.
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
    # in as its blocks are first written, about 0.28 s per GiB on the 2-core CPU (12 us per token of
    # SmolLM2 in fp32, under 1% of its prefill), once in the pool's life.  Populating all of it
    # up front (MAP_POPULATE, 0.38 s per GiB) made every fork of a lesson or benchmark pay for
    # pages it never used: the throughput section took 85 s instead of 49 (one run each).
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    return torch.frombuffer(pages, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


def populate(t: torch.Tensor) -> str:
    """Fault in every page of ``t`` now, for writing, without changing a byte of it.

    A pool on :func:`mapped_zeros` pages pays for each page the first time it is written, inside
    whatever write comes first: a request's K/V store, or the ``on_alloc`` scrub that zeroes the
    block just before.  The price is not fixed.  On the 2-core VM that runs this course, zeroing a
    fresh GiB page by page took 5.2 s in one run and 0.7 s in the next (most likely because the VM
    reports free pages back to its host, ``page_reporting`` on its kernel command line, and a page
    that went back costs the host a fault of its own), while asking the kernel for all the pages at
    once took 0.34-0.37 s.  A long-running server pays this once in its
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
