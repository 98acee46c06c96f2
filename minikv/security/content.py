"""Content fingerprints: recognise the same prompt blocks across tenant domains, for the operator only.

Per-tenant keys make the *block hash* of one text differ between tenants -- that is the point of
isolation.  Selective sharing (``cache_isolation="selective"``, :mod:`minikv.sharing`)
still needs to know "have k different tenants computed this same content?".  Weakening the block
hash for that would reopen the oracle; instead the engine keeps a second, separate fingerprint:

    fp_0 = HMAC-SHA256(content_key, encode_fields(CONTENT_LABEL, None, tokens_0))
    fp_i = HMAC-SHA256(content_key, encode_fields(CONTENT_LABEL, fp_{i-1}, tokens_i))

It is chained like the block hashes (a block's fingerprint names its whole prefix), covers token
content only (no tenant key, so equal content is equal everywhere), and is keyed with a key
derived from the engine secret (``derive_content_key``), like the audit trail's fingerprints:
without the key nobody can compute the fingerprint of a guess.  It never leaves the engine -- it
is not part of any output, metric or block hash -- so a tenant cannot observe it.  What a tenant
*can* observe is the policy's decision (a hit after a promotion): that is the Sybil limit
documented in :mod:`minikv.sharing`.
"""
from __future__ import annotations

import hmac
from typing import Sequence

from .encoding import encode_fields
from .keys import _derive

CONTENT_LABEL = "minikv/content-fingerprint/v1"
CONTENT_KEY_LABEL = "minikv/content-key/v1"
TAIL_LABEL = "minikv/content-tail/v1"


def derive_content_key(secret: bytes) -> bytes:
    """The key of content fingerprints: ``HMAC-SHA256(secret, encode_fields(CONTENT_KEY_LABEL))``,
    a purpose of its own (never a tenant key, the operator key or the shared key)."""
    return _derive(secret, CONTENT_KEY_LABEL)


def content_fingerprints(key: bytes, token_ids: Sequence[int], block_size: int, known: list[str],
                         n_blocks: int) -> list[str]:
    """Extend ``known`` (the fingerprints of the first blocks, as hex) to ``n_blocks`` full
    blocks of ``token_ids``, in place, and return it.  Each block costs one HMAC, once."""
    while len(known) < n_blocks:
        i = len(known)
        parent = bytes.fromhex(known[-1]) if known else None
        tokens = tuple(token_ids[i * block_size:(i + 1) * block_size])
        if len(tokens) < block_size:
            raise ValueError(f"block {i} is not full ({len(tokens)} of {block_size} tokens)")
        known.append(hmac.digest(key, encode_fields(CONTENT_LABEL, parent, tokens), "sha256").hex())
    return known


def content_tail(key: bytes, token_ids: Sequence[int]) -> str:
    """Fingerprint of a whole prompt (tells distinct prompts apart, as the trail's ``tail_fp``)."""
    return hmac.digest(key, encode_fields(TAIL_LABEL, tuple(token_ids)), "sha256").hex()
