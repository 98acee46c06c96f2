"""Wrong answers to exercise 2: tenant keys that are guessable, and keys that miss some blocks.

Per-tenant keying only isolates tenants if (a) nobody can compute another tenant's key without
the engine secret and (b) that key reaches *every* private block's cache key.  The mutants
break one or the other, the way real engines have (SGLang #23300 dropped the salt entirely);
a first-block-only key looks right until a public system prompt breaks the chain.
"""
from __future__ import annotations

import hashlib
import hmac

from ...security.encoding import encode_fields as _typed
from ._table import entries

# ============================================================================ 2a tenant keys


def derive_unkeyed(engine_secret, tenant) -> bytes:
    """sha256 of the tenant name: anyone who knows a tenant's name can compute its key."""
    return hashlib.sha256(_typed("tenant", tenant)).digest()


def derive_none_is_empty(engine_secret, tenant) -> bytes:
    """HMAC over the raw name with None -> '': the anonymous tenant shares tenant ''s cache."""
    if len(engine_secret) < 16:
        raise ValueError("short secret")
    return hmac.digest(engine_secret, (tenant or "").encode(), "sha256")


def derive_concat(engine_secret, tenant) -> bytes:
    """secret || tenant: the 'key' carries the engine secret itself."""
    if len(engine_secret) < 16:
        raise ValueError("short secret")
    return bytes(engine_secret) + _typed(tenant)


def _check(engine_secret):
    if not isinstance(engine_secret, bytes):
        raise TypeError("secret must be bytes")
    if len(engine_secret) < 16:
        raise ValueError("short secret")


def derive_str_tenant(engine_secret, tenant) -> bytes:
    """HMAC over ``str(tenant)``: the anonymous tenant (None) shares the key of the tenant named 'None'."""
    _check(engine_secret)
    return hmac.digest(engine_secret, f"minikv/tenant-key/v1:{tenant}".encode(), "sha256")


def derive_nfc_normalised(engine_secret, tenant) -> bytes:
    """'Normalise the name first': NFC-normalises, so two distinct ids that render alike ('café' composed
    and decomposed) share one key."""
    import unicodedata
    _check(engine_secret)
    name = None if tenant is None else unicodedata.normalize("NFC", tenant)
    return hmac.digest(engine_secret, _typed("minikv/tenant-key/v1", name), "sha256")


def derive_ascii_lossy(engine_secret, tenant) -> bytes:
    """Encodes the name with ``encode('ascii', 'ignore')``: 'café' and 'caf' become the same tenant."""
    _check(engine_secret)
    name = None if tenant is None else tenant.encode("ascii", "ignore")
    return hmac.digest(engine_secret, _typed("minikv/tenant-key/v1", name), "sha256")


def derive_sha256_concat(engine_secret, tenant) -> bytes:
    """``sha256(secret || message)`` in place of HMAC: an improvised keyed hash (length extension)."""
    from ...security.encoding import encode_fields
    _check(engine_secret)
    return hashlib.sha256(engine_secret + encode_fields("minikv/tenant-key/v1", tenant)).digest()


def derive_sha256_of_encoding(engine_secret, tenant) -> bytes:
    """``sha256(encode_fields(label, tenant, secret))``: the secret inside a typed message, then a plain
    hash -- no concatenation for the ad-hoc list to spot, but still not HMAC."""
    from ...security.encoding import encode_fields
    _check(engine_secret)
    return hashlib.sha256(encode_fields("minikv/tenant-key/v1", tenant, bytes(engine_secret))).digest()


def derive_no_secret_check(engine_secret, tenant) -> bytes:
    """Correct HMAC, but an empty or 5-byte secret is accepted (brute-forceable keys)."""
    return hmac.digest(bytes(engine_secret, "utf-8") if isinstance(engine_secret, str) else engine_secret,
                       _typed("tenant", tenant), "sha256")


def derive_label_last(engine_secret, tenant) -> bytes:
    """NEGATIVE CONTROL (correct): HMAC-SHA256 keyed by the secret over the typed tenant THEN the label --
    the contract names the construction and the label, not the message's layout; the grader must ACCEPT it."""
    _check(engine_secret)
    if tenant is not None and not isinstance(tenant, str):
        raise TypeError(f"tenant must be a str or None, got {tenant!r}")
    return hmac.digest(engine_secret, _typed(tenant, "minikv/tenant-key/v1"), "sha256")


def derive_raw_label_prefix(engine_secret, tenant) -> bytes:
    """NEGATIVE CONTROL (correct): HMAC-SHA256 keyed by the secret over the label's raw bytes, a NUL, then
    the typed tenant; another layout of the same labelled message, so the grader must ACCEPT it."""
    _check(engine_secret)
    return hmac.digest(bytes(engine_secret), b"minikv/tenant-key/v1\x00" + _typed(tenant), "sha256")


# ============================================================================ 2b keyed hasher


class _KeyedBase:
    def __init__(self, engine_secret):
        if len(engine_secret) < 16:
            raise ValueError("short secret")
        self._shared = hmac.digest(engine_secret, _typed("shared"), "sha256")


class KeyedSaltNeverUsed(_KeyedBase):
    """HMAC with the shared key only: the tenant key is accepted and dropped (SGLang #23300)."""

    def __call__(self, parent, tokens, extra, tenant_key):
        return hmac.digest(self._shared, _typed(parent, tuple(tokens), tuple(extra)), "sha256")


class KeyedFirstBlockOnly(_KeyedBase):
    """Keys only the first block and relies on chaining: after a public (unkeyed) system prompt,
    every private block is shared across tenants."""

    def __call__(self, parent, tokens, extra, tenant_key):
        key = tenant_key if (parent is None and tenant_key is not None) else self._shared
        return hmac.digest(key, _typed(parent, tuple(tokens), tuple(extra)), "sha256")


class KeyedSha256Concat(_KeyedBase):
    """``sha256(tenant_key || message)`` in place of HMAC: an improvised keyed hash."""

    def __call__(self, parent, tokens, extra, tenant_key):
        key = self._shared if tenant_key is None else tenant_key
        return hashlib.sha256(key + _typed("minikv/keyed-block/v1", parent, tuple(tokens), tuple(extra),
                                           tenant_key is not None)).digest()


class KeyedTruncated(_KeyedBase):
    """Correct keying, but the key is truncated to 8 bytes 'to save memory'."""

    def __call__(self, parent, tokens, extra, tenant_key):
        key = self._shared if tenant_key is None else tenant_key
        return hmac.digest(key, _typed(parent, tuple(tokens), tuple(extra), tenant_key is not None), "sha256")[:8]


class KeyedNoDomainMarker(_KeyedBase):
    """HMAC keyed per domain, in every block, but the message never says whether the block is a tenant's
    or shared: only the HMAC key tells the two kinds apart, so a tenant key equal to the shared key gives
    shared blocks' keys (the contract's domain marker, never checked before)."""

    def __call__(self, parent, tokens, extra, tenant_key):
        key = self._shared if tenant_key is None else tenant_key
        return hmac.digest(key, _typed("minikv/keyed-block/v1", parent, tuple(tokens), tuple(extra)), "sha256")


# ============================================================================ 2c block_keys


def keys_salt_last_block_only(hasher, token_ids, block_size, tenant_key=None, public_len=0):
    """The tenant key reaches only the last full block: the earlier ones stay shared."""
    n = len(token_ids) // block_size
    keys, parent = [], None
    for i in range(n):
        parent = hasher(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), (),
                        tenant_key if i == n - 1 and (i + 1) * block_size > public_len else None)
        keys.append(parent)
    return keys


def keys_salt_never_passed(hasher, token_ids, block_size, tenant_key=None, public_len=0):
    """The salt is accepted but never passed to the hasher (SGLang #23300)."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        parent = hasher(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), (), None)
        keys.append(parent)
    return keys


def keys_straddling_block_public(hasher, token_ids, block_size, tenant_key=None, public_len=0):
    """Off by one: a block that merely *starts* inside the public prefix is treated as public,
    so its private tail (the first tokens after the system prompt) is shared."""
    keys, parent = [], None
    for i in range(len(token_ids) // block_size):
        key = None if i * block_size < public_len else tenant_key
        parent = hasher(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), (), key)
        keys.append(parent)
    return keys


def keys_unchained(hasher, token_ids, block_size, tenant_key=None, public_len=0):
    """Every block hashed with parent=None: blocks are reused after a different prefix."""
    keys = []
    for i in range(len(token_ids) // block_size):
        key = None if (i + 1) * block_size <= public_len else tenant_key
        keys.append(hasher(None, tuple(token_ids[i * block_size:(i + 1) * block_size]), (), key))
    return keys


MUTANTS = {
    "2a": entries(("unkeyed", derive_unkeyed), ("none-is-empty", derive_none_is_empty), ("concat", derive_concat),
                  ("no-secret-check", derive_no_secret_check), ("str-tenant", derive_str_tenant),
                  ("nfc-normalised", derive_nfc_normalised), ("ascii-lossy", derive_ascii_lossy),
                  ("sha256-concat", derive_sha256_concat), ("sha256-of-encoding", derive_sha256_of_encoding)),
    "2b": entries(("salt-never-used", KeyedSaltNeverUsed), ("first-block-only", KeyedFirstBlockOnly),
                  ("truncated", KeyedTruncated), ("sha256-concat", KeyedSha256Concat),
                  ("no-domain-marker", KeyedNoDomainMarker)),
    "2c": entries(("salt-last-block-only", keys_salt_last_block_only), ("salt-never-passed", keys_salt_never_passed),
                  ("straddling-block-public", keys_straddling_block_public), ("unchained", keys_unchained)),
}


DIAGNOSES = {
    ("2a", "unkeyed"): "anyone who knows the tenant's name", ("2a", "none-is-empty"): "untyped tenant encoding",
    ("2a", "concat"): "contains the engine secret", ("2a", "no-secret-check"): "accepted a 5-byte secret",
    ("2a", "str-tenant"): "None (anonymous) and 'None'", ("2a", "nfc-normalised"): "two Unicode forms",
    ("2a", "ascii-lossy"): "lossy encoding", ("2a", "sha256-concat"): "ad-hoc keyed hash",
    ("2a", "sha256-of-encoding"): "not HMAC",
    ("2b", "salt-never-used"): "tenant key never reaches the hash", ("2b", "first-block-only"): "only enters the first block",
    ("2b", "truncated"): "truncated key", ("2b", "sha256-concat"): "ad-hoc keyed hash",
    ("2b", "no-domain-marker"): "no domain marker",
    ("2c", "salt-last-block-only"): "tenant key missing from a private block", ("2c", "salt-never-passed"): "tenant key missing from a private block",
    ("2c", "straddling-block-public"): "straddles the end of the public prefix", ("2c", "unchained"): "unchained keys",
}

#: correct implementations that differ only in layout: the graders must ACCEPT them
NEGATIVE_CONTROLS = {"2a": entries(("label-last", derive_label_last), ("raw-label-prefix", derive_raw_label_prefix))}
