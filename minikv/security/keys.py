"""Server-side key material: the engine secret and the keys derived from it.

Every key is ``HMAC-SHA256(secret, encode_fields(label, ...))`` with one versioned label per
purpose: a tenant's cache key, the operator key of audit fingerprints, the shared key of
unkeyed blocks.  Clients never see, choose or copy a key (unlike vLLM's client-chosen
``cache_salt``), and the typed encoding keeps the anonymous tenant ``None`` apart from ``""``.
Lesson 07, section 4 ("Per-tenant keys, derived on the server") tells why; exercise 2a
writes :func:`derive_tenant_key`.
"""

from __future__ import annotations

import hmac
import os
import secrets
import stat

from .encoding import encode_fields

__all__ = [
    "SECRET_BYTES",
    "MIN_SECRET_BYTES",
    "new_engine_secret",
    "derive_tenant_key",
    "derive_operator_key",
    "derive_shared_key",
    "check_secret",
    "read_secret_file",
    "TENANT_LABEL",
    "SHARED_LABEL",
    "OPERATOR_LABEL",
]

SECRET_BYTES = 32  # 256 bits: the HMAC-SHA256 block key size we aim for
MIN_SECRET_BYTES = 16  # 128 bits: below this, brute-forcing the secret becomes a real risk

# One versioned label per purpose (domain separation).  solutions/ex2_tenant_keys.py imports
# TENANT_LABEL and SHARED_LABEL, so the course's derivation and the engine's are the same bytes.
TENANT_LABEL = "minikv/tenant-key/v1"
OPERATOR_LABEL = "minikv/operator-key/v1"
SHARED_LABEL = "minikv/shared-key/v1"


def new_engine_secret() -> bytes:
    """Return 32 fresh bytes from the OS CSPRNG (:mod:`secrets`, never :mod:`random`).

    An engine started without a configured secret uses a random one, which is safe but
    means cache keys (and audit fingerprints) change on every restart.
    """
    return secrets.token_bytes(SECRET_BYTES)


def check_secret(secret, name: str = "engine secret") -> bytes:
    """Return ``secret`` as bytes; ``TypeError`` unless bytes, ``ValueError`` if under 16 bytes.

    The one validation of an engine secret (``EngineConfig`` calls it too)."""
    if not isinstance(secret, (bytes, bytearray)):
        raise TypeError(f"{name} must be bytes, got {type(secret).__name__}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{name} must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)} bytes")
    return bytes(secret)


MAX_SECRET_FILE_BYTES = 64 << 10


def read_secret_file(path, flag: str, max_bytes: int = MAX_SECRET_FILE_BYTES) -> bytes:
    """The bytes of a secret (or keys) file named by ``flag``, or a one-line ``ValueError``
    naming the flag and the path.  Only a regular file is read, and at most ``max_bytes``:
    opening a FIFO nobody writes blocks forever, and ``/dev/zero`` never ends, so the server
    would hang or run out of memory before it could say what is wrong.  The file is opened
    non-blocking and checked with ``fstat`` on the open descriptor (no window between a check
    and the open for the path to be swapped)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise ValueError(f"{flag} {str(path)!r}: {exc.strerror or type(exc).__name__}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a plain file"
        raise ValueError(f"{flag} {str(path)!r} is {kind}; give a regular file")
    with os.fdopen(fd, "rb") as fh:
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"{flag} {str(path)!r} is larger than {max_bytes} bytes")
    return data


def _derive(secret, *fields) -> bytes:
    return hmac.digest(check_secret(secret), encode_fields(*fields), "sha256")


def derive_tenant_key(secret: bytes, tenant: str | None) -> bytes:
    """Return the 32-byte cache key of ``tenant`` (``None`` = anonymous requests).

    Deterministic: the same (secret, tenant) always gives the same key, so a tenant's
    blocks keep hitting across its requests; different tenants get unrelated keys.
    """
    if tenant is not None and not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str or None, got {type(tenant).__name__}")
    return _derive(secret, TENANT_LABEL, tenant)


def derive_operator_key(secret: bytes) -> bytes:
    """Return the key that keys audit-log fingerprints of block hashes.

    Fingerprints are ``HMAC(operator_key, block_hash)``: someone reading the log cannot
    hash a guessed prompt and look for it, because they lack this key.
    """
    return _derive(secret, OPERATOR_LABEL)


def derive_shared_key(secret: bytes) -> bytes:
    """Return the key that keyed block hashers use when ``tenant_key`` is ``None``.

    That is the case under ``cache_isolation="shared"`` and for operator-declared public
    prefixes.  Keying those hashes too means block hashes still reveal nothing to someone
    who sees them (e.g. in a debug dump) but not the engine secret.
    """
    return _derive(secret, SHARED_LABEL)
