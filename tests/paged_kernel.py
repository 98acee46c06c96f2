"""Build minikv's C++ paged-attention kernel once for the test session, where a compiler exists.

``make test`` has already built it (``make model`` runs ``python -m minikv.backends.cpu_kernels``);
this is a no-op then.  With a compiler present a failed build is an error, not a skip: the
kernel is what ``attention_backend="auto"`` runs on the CPU.  Without one, the kernel's tests
skip and the engine runs the pure-PyTorch "fused" backend (tests check that too).
"""
from __future__ import annotations

from minikv.backends import kernel_build, cpu_kernels

HAS_COMPILER = kernel_build.compiler() is not None
if HAS_COMPILER:
    kernel_build.build()
KERNEL_BUILT = HAS_COMPILER and cpu_kernels.available()
