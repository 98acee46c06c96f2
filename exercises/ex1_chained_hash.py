# GENERATED from solutions/ex1_chained_hash.py by `python -m minikv.grading.make_exercises`.
# This file is yours: replace every `raise NotImplementedError` with your implementation,
# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the
# reference solution uses.  Course maintainers: edit solutions/ex1_chained_hash.py and regenerate; never
# edit this file by hand.
# minikv-stub: e1a03a20fbc43ede
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
    raise NotImplementedError("encode_fields: not implemented yet (read the docstring, then write your code here)")


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
    raise NotImplementedError("chained_block_hash: not implemented yet (read the docstring, then write your code here)")
