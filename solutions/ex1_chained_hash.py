"""Exercise 1 (lesson 07): a chained, domain-separated block hash.

The engine names every full KV block by a *cache key*.  A hit on that key makes a request
attend over K/V that another request computed, so the key must cover everything that
determined those K/V, and two different inputs must never share a key:

* 1a ``encode_fields`` -- glue several typed fields into ONE byte string so that different
  field tuples can never give the same bytes (type tag + length prefix per field);
* 1b ``chained_block_hash`` -- the engine's ``BlockHasher`` seam: SHA-256 over a domain label
  and the encoded ``(parent, tokens, extra, tenant_key)``.  ``parent`` is the previous block's
  key, so a key stands for the whole prefix (the *chain*).

Plug it into the real engine with ``LLM("tiny-random", block_hasher=chained_block_hash, ...)``.
Grade with ``check_encode_fields`` / ``check_chained_hash`` (``minikv.grading``) or ``make grade``.
"""
from __future__ import annotations

import hashlib
import struct

# The domain-separation label: block keys can never equal a SHA-256 computed for another purpose
# (a tenant key, an audit fingerprint) over the same fields.  The engine uses the same string.
# (Do not import minikv.security: it holds the reference implementation, and the grader refuses a
# file that imports it.)
BLOCK_DOMAIN = "minikv/block-key/v1"

# One possible wire format (you may design your own): tag (1 byte) || length (8 bytes) || payload.
TAG_NONE, TAG_BYTES, TAG_STR, TAG_INT, TAG_SEQ, TAG_BOOL = 0, 1, 2, 3, 4, 5


def encode_fields(*fields) -> bytes:
    """Encode ``fields`` into bytes from which they could be decoded unambiguously.

    Contract:

    * supported values: ``None``, ``bytes``, ``str``, ``int``, ``bool`` and (nested) ``tuple``/``list``
      of those; anything else (``float``, ``dict``, ...) raises ``TypeError``;
    * *injective*: different field tuples give different bytes.  All of these must differ:
      ``(b"a", b"bc")`` vs ``(b"ab", b"c")``; ``("lora", "salt")`` vs ``("lorasalt",)``;
      ``((1, 23),)`` vs ``((12, 3),)``; ``(None,)`` vs ``(b"",)`` vs ``("",)`` vs ``(0,)`` vs ``((),)``
      vs ``()``; ``("1",)`` vs ``(1,)``; ``(((1, 2), 3),)`` vs ``((1, (2, 3)),)``; ``(True,)`` vs ``(1,)``
      (``bool`` is a subclass of ``int`` in Python, but a flag and a number are different keys);
      ``("café",)`` vs ``("caf",)`` (text is encoded without loss: every character counts);
    * canonical: a list and a tuple with the same items encode the same (the engine must not
      care which container a caller used); the same input always gives the same bytes.

    Stuck?  ``make hint EX=1a`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    return b"".join(_encode_one(f) for f in fields)


def _encode_one(value) -> bytes:
    if value is None:
        tag, payload = TAG_NONE, b""
    elif isinstance(value, bool):  # before int: True must not encode like 1
        tag, payload = TAG_BOOL, bytes([value])
    elif isinstance(value, (bytes, bytearray)):
        tag, payload = TAG_BYTES, bytes(value)
    elif isinstance(value, str):
        tag, payload = TAG_STR, value.encode("utf-8", "surrogatepass")
    elif isinstance(value, int):
        tag, payload = TAG_INT, int(value).to_bytes((int(value).bit_length() + 8) // 8, "big", signed=True)
    elif isinstance(value, (tuple, list)):
        tag, payload = TAG_SEQ, b"".join(_encode_one(v) for v in value)
    else:
        raise TypeError(f"cannot encode a {type(value).__name__} in a cache key")
    return struct.pack(">BQ", tag, len(payload)) + payload
    # END SOLUTION


def chained_block_hash(parent: bytes | None, tokens: tuple[int, ...], extra: tuple,
                       tenant_key: bytes | None) -> bytes:
    """The ``BlockHasher`` seam: the cache key of one full block.

    ``parent`` is the previous block's key (``None`` for the first block), ``tokens`` the block's
    token ids, ``extra`` a tuple of extra keys (the engine passes ``()``; vLLM puts LoRA names and
    ``cache_salt`` there), ``tenant_key`` the per-tenant key the engine derived (``None`` when the
    block is shared).

    Contract:

    * returns ``bytes``: the full 32-byte SHA-256 digest, never truncated; same input -> same output;
    * **chained**: the same tokens after a different parent give a different key (a key names
      the whole prefix, not 16 tokens: deeper layers' K/V depend on everything before);
    * covers every field: changing ``parent``, ``tokens``, ``extra`` or ``tenant_key`` changes
      the key, and field boundaries are unambiguous (use your ``encode_fields``);
    * **domain-separated**: the message starts with ``BLOCK_DOMAIN``, so the key is not the
      plain ``sha256(encode_fields(parent, tokens, extra, tenant_key))``.

    * refuses what it cannot key safely: ``parent`` that is neither ``None`` nor ``bytes``, a
      token that is not an ``int`` (``bool`` included) -> ``TypeError`` naming the bad value;
    * never ``hash()`` (CVE-2025-25183), and never a shortened digest: 16 bytes halve the work of a
      birthday search for two colliding blocks, so the grader wants all 32.

    Stuck?  ``make hint EX=1b``.
    """
    # BEGIN SOLUTION
    if parent is not None and not isinstance(parent, (bytes, bytearray)):
        raise TypeError(f"parent must be None or bytes (the previous block's key), got {parent!r}")
    if tenant_key is not None and not isinstance(tenant_key, (bytes, bytearray)):
        raise TypeError(f"tenant_key must be None or bytes, got {tenant_key!r}")
    tokens = tuple(tokens)
    for t in tokens:
        if isinstance(t, bool) or not isinstance(t, int):
            raise TypeError(f"token ids must be ints, got {t!r}")
    # The label first (domain separation), then every field, typed and length-prefixed: two different
    # (parent, tokens, extra, tenant_key) tuples can never give the same message.
    message = encode_fields(BLOCK_DOMAIN, parent, tokens, tuple(extra), tenant_key)
    digest = hashlib.sha256(message).digest()
    return digest  # all 32 bytes: a truncated key makes birthday collisions cheap
    # END SOLUTION
