"""Block hashers: how a KV block's prefix-cache key is computed.

A block key covers the parent block's key (so it names the *whole* prefix), the block's token
ids, extra keys and the tenant key, typed by :mod:`.encoding`.  ``sha256`` is exercise 1b's
chained, domain-separated hash; ``hmac-sha256`` (and ``blake2b-keyed``) exercise 2b's keyed
one, so that only the engine can compute keys and equal prompts of different tenants never
share blocks.  Lesson 06 shows what collisions and guessable keys do; lesson 07, sections 3
and 5, builds these hashers.

Every hasher follows the ``BlockHasher`` protocol (the seam of ARCHITECTURE.md) and is built
by ``make_hasher(name, secret)``.  The three UNSAFE hashers exist so the course can demonstrate
real collisions (``minikv.attacks.collisions``); never serve traffic with them.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Protocol, runtime_checkable

from .encoding import encode_fields
from .keys import MIN_SECRET_BYTES, check_secret, derive_shared_key

__all__ = [
    "BLOCK_DOMAIN",
    "BLOCK_LABEL",
    "BlockHasher",
    "Sha256Hasher",
    "HmacSha256Hasher",
    "Blake2bKeyedHasher",
    "BuiltinHasher",
    "Trunc32Hasher",
    "PolyHasher",
    "HASHERS",
    "UNSAFE_HASHES",
    "make_hasher",
]


#: Domain-separation labels, the first field of every block-key message: a block key can never
#: equal a hash computed for another purpose (a tenant key, an audit fingerprint) over the same
#: fields, and bumping ``v1`` changes every key at once.  solutions/ex1 and ex2 import them: the
#: hashers below are exactly what exercises 1b and 2b build (lesson 07, sections 3 and 5).
BLOCK_DOMAIN = "minikv/block-key/v1"     # unkeyed (sha256)
BLOCK_LABEL = "minikv/keyed-block/v1"    # keyed (hmac-sha256, blake2b-keyed)


@runtime_checkable
class BlockHasher(Protocol):
    """The seam: return the cache key of one full block (any ``bytes``, same input -> same key)."""

    def __call__(self, parent: bytes | None, tokens: tuple[int, ...],
                 extra: tuple, tenant_key: bytes | None) -> bytes: ...


class Sha256Hasher:
    """SHA-256 over the typed encoding of (BLOCK_DOMAIN, parent, tokens, extra, tenant_key).

    The construction exercise 1b's ``chained_block_hash`` builds (over minikv's encoding).
    This is vLLM's default block hash since v0.10.2, which replaced Python's ``hash()``
    after crafted collisions were shown to be practical.  Security property: collision
    resistance (~2**128 work to find any collision).  It is *unkeyed*: anyone can compute
    the key of a guessed prefix, so isolation between tenants rests entirely on the secret
    ``tenant_key`` being part of the input.  Deterministic across processes and machines.
    """

    name, digest_size, keyed, unsafe = "sha256", 32, False, False

    def __init__(self, secret: bytes):
        check_secret(secret)  # unused, but every hasher is built the same way

    def __call__(self, parent, tokens, extra, tenant_key):
        check_block_fields(parent, tokens)
        return hashlib.sha256(encode_fields(BLOCK_DOMAIN, parent, tuple(tokens), tuple(extra), tenant_key)).digest()


def check_block_fields(parent, tokens) -> None:
    """A key exists only for what the engine produces: a parent key (bytes) or None, and int token ids.
    Anything else (a str parent, True for 1) is the caller's bug, refused rather than keyed."""
    if parent is not None and not isinstance(parent, bytes):
        raise TypeError(f"parent must be bytes or None, got {parent!r}")
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"token ids must be int, got {t!r}")


class _KeyedHasher:
    """Shared logic: pick the tenant key, or the engine-wide shared key when there is none."""

    keyed, unsafe, digest_size = True, False, 32

    def __init__(self, secret: bytes):
        self._shared_key = derive_shared_key(secret)

    def _key(self, tenant_key):
        if tenant_key is None:
            return self._shared_key
        if len(tenant_key) < MIN_SECRET_BYTES:
            raise ValueError(f"tenant_key must be at least {MIN_SECRET_BYTES} bytes, got {len(tenant_key)}")
        return tenant_key

    @staticmethod
    def _message(parent, tokens, extra, tenant_key) -> bytes:
        # The "keyed by a tenant?" flag puts tenant-keyed and shared blocks in disjoint
        # message domains, a second wall behind the key itself.
        return encode_fields(BLOCK_LABEL, parent, tuple(tokens), tuple(extra), tenant_key is not None)


class HmacSha256Hasher(_KeyedHasher):
    """HMAC-SHA256 keyed with ``tenant_key`` (or the shared key derived from the secret).

    Exercise 2b's ``TenantKeyedHasher``, exactly (same key, same message, same bytes).
    Security property: a pseudo-random function.  Without the key, block hashes are
    unpredictable and unforgeable, so neither a client nor a reader of a hash dump can
    confirm a guessed prompt; with different keys, equal prompts get unrelated hashes.
    """

    name = "hmac-sha256"

    def __call__(self, parent, tokens, extra, tenant_key):
        return hmac.digest(self._key(tenant_key), self._message(parent, tokens, extra, tenant_key), "sha256")


class Blake2bKeyedHasher(_KeyedHasher):
    """BLAKE2b in its built-in keyed mode (32-byte digest), same keying as HMAC.

    Same security property as HMAC-SHA256 (BLAKE2's keyed mode is a PRF by design, no
    HMAC wrapper needed), one compression pass instead of HMAC's extra ones.  The
    ``person`` string domain-separates minikv block keys from any other BLAKE2b use.
    """

    name = "blake2b-keyed"
    _PERSON = b"minikv/block/v1"

    def __call__(self, parent, tokens, extra, tenant_key):
        return hashlib.blake2b(self._message(parent, tokens, extra, tenant_key), digest_size=32,
                               key=self._key(tenant_key), person=self._PERSON).digest()


# ---------------------------------------------------------------- UNSAFE hashers


def _bytes_as_int(value: bytes | None) -> int:
    # A deterministic stand-in for hash(bytes), which PYTHONHASHSEED would randomise.
    return 0 if value is None else int.from_bytes(value[:8], "big")


def _extra_as_int(value) -> int:
    if type(value) is int:
        return value
    return int.from_bytes(hashlib.sha256(encode_fields(value)).digest()[:8], "big")


class BuiltinHasher:
    """UNSAFE: Python's ``hash()`` of ``(parent_int, tenant_int, *extra_ints, *tokens)``, 8 bytes.

    This is what vLLM used before v0.10.2 (CVE-2025-25183: predictable ``hash()``
    collisions in prefix caching).  ``hash()`` of a tuple of ints is a 64-bit
    xxHash-style mix that is *not* seeded by ``PYTHONHASHSEED`` (only str/bytes hashes
    are), and it is invertible step by step, so anyone can compute it and crafted
    collisions take seconds (:func:`minikv.attacks.collisions.search_builtin_collision`).
    Parent and tenant key enter as the int of their first 8 bytes (0 for ``None``) so the
    result is stable across processes.
    """

    name, digest_size, keyed, unsafe = "builtin", 8, False, True

    def __init__(self, secret: bytes):
        check_secret(secret)

    def __call__(self, parent, tokens, extra, tenant_key):
        lanes = (_bytes_as_int(parent), _bytes_as_int(tenant_key), *map(_extra_as_int, extra), *tokens)
        return hash(lanes).to_bytes(8, "big", signed=True)


class Trunc32Hasher:
    """UNSAFE: SHA-256 of the typed (parent, tokens, extra, tenant_key), truncated to 4 bytes.

    The hash function is fine; the output is too short.  By the birthday bound, about
    2**16 random blocks already contain a colliding pair -- a fraction of a second.
    """

    name, digest_size, keyed, unsafe = "trunc32", 4, False, True

    def __init__(self, secret: bytes):
        check_secret(secret)

    def __call__(self, parent, tokens, extra, tenant_key):
        return hashlib.sha256(encode_fields(parent, tokens, extra, tenant_key)).digest()[:4]


_MASK64 = (1 << 64) - 1


class PolyHasher:
    """UNSAFE: polynomial hash ``h = sum(s_i * 31**i) mod 2**64``, 8 bytes.

    ``s = [parent_int, tenant_int, *extra_ints, *tokens]``.  Rolling/polynomial hashes are
    tempting because they are cheap and incremental, but they are *linear*: adding 31 to
    token j and subtracting 1 from token j+1 changes h by ``31*31**i - 31**(i+1) = 0``, so
    collisions need no search at all.  Megatron-LM's prefix cache used a polynomial hash
    until PR #4158 replaced it with SHA-256 because of exactly this zero-delta move.
    """

    name, digest_size, keyed, unsafe = "poly", 8, False, True
    BASE = 31

    def __init__(self, secret: bytes):
        check_secret(secret)

    def __call__(self, parent, tokens, extra, tenant_key):
        seq = (_bytes_as_int(parent), _bytes_as_int(tenant_key), *map(_extra_as_int, extra), *tokens)
        h = 0
        for s in reversed(seq):  # Horner's rule: s_0 + 31*(s_1 + 31*(s_2 + ...))
            h = h * 31 + s
        return (h & _MASK64).to_bytes(8, "big")


HASHERS: dict[str, type] = {
    cls.name: cls
    for cls in (Sha256Hasher, HmacSha256Hasher, Blake2bKeyedHasher, BuiltinHasher, Trunc32Hasher, PolyHasher)
}
UNSAFE_HASHES = frozenset({"builtin", "trunc32", "poly"})


def make_hasher(name: str, secret: bytes) -> BlockHasher:
    """Build the registered hasher ``name``, keyed (where it is keyed) from ``secret``.

    Raises:
        ValueError: unknown ``name`` (the message lists valid names), or ``secret`` too short.
        TypeError: ``secret`` is not bytes.
    """
    cls = HASHERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown hash algorithm {name!r}; valid names: {', '.join(sorted(HASHERS))}")
    return cls(secret)
