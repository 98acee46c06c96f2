"""Wrong answers to exercise 1: an encoding that is not injective, a block key that is not chained.

A cache key is only as safe as the bytes it hashes: if two different (parent, tokens, extra,
tenant) tuples encode to the same bytes, SHA-256 faithfully gives them the same key and the
cache hands one request's K/V to the other.  Each mutant below loses one piece of structure --
types, lengths, boundaries, the parent, the tenant -- and ``check_encode_fields`` /
``check_chained_hash`` must notice.
"""
from __future__ import annotations

import hashlib
import struct

from ...security.encoding import encode_fields as _typed
from ...security.hashing import BLOCK_DOMAIN
from ._table import entries

# ============================================================================ 1a encode_fields


def encode_untyped(*fields) -> bytes:
    """Concatenation with a separator: ('a|b', 'c') and ('a', 'b|c') collide; types are lost."""
    return b"|".join(str(f).encode() for f in fields)


def encode_typed_separator(*fields) -> bytes:
    """Type-prefixed fields joined with '|' ('str:alice|int:3'): a name that contains the separator and
    a prefix, 'a|str:b', reads as two fields."""
    return "|".join(f"{type(f).__name__}:{f}" for f in fields).encode()


def encode_no_length(*fields) -> bytes:
    """Type tags but no lengths: (b'a', b'bc') and (b'ab', b'c') give the same bytes."""
    out = b""
    for f in fields:
        if f is None:
            out += b"\x00"
        elif isinstance(f, bytes):
            out += b"\x01" + f
        elif isinstance(f, str):
            out += b"\x02" + f.encode()
        elif isinstance(f, int):
            out += b"\x03" + str(f).encode()
        elif isinstance(f, (tuple, list)):
            out += b"\x04" + encode_no_length(*f)
        else:
            raise TypeError(type(f).__name__)
    return out


def encode_json_like(*fields) -> bytes:
    """repr() of the tuple: lists and tuples differ, and non-encodable types are silently accepted."""
    return repr(fields).encode()


def _encode_typed(value, text_codec=("utf-8", "surrogatepass"), bool_tag=True) -> bytes:
    """tag || length || payload, recursively: a correct encoding, but for the two knobs the mutants turn."""
    if value is None:
        tag, payload = 0, b""
    elif isinstance(value, bool) and bool_tag:
        tag, payload = 5, bytes([value])
    elif isinstance(value, bytes):
        tag, payload = 1, value
    elif isinstance(value, str):
        tag, payload = 2, value.encode(*text_codec)
    elif isinstance(value, int):
        tag, payload = 3, int(value).to_bytes((int(value).bit_length() + 8) // 8, "big", signed=True)
    elif isinstance(value, (tuple, list)):
        tag, payload = 4, b"".join(_encode_typed(v, text_codec, bool_tag) for v in value)
    else:
        raise TypeError(f"cannot encode a {type(value).__name__}")
    return struct.pack(">BQ", tag, len(payload)) + payload


def encode_ascii_ignore(*fields) -> bytes:
    """Typed and length-prefixed, but text goes through ``encode('ascii', 'ignore')``: 'café' and 'caf'
    become one name."""
    return b"".join(_encode_typed(f, ("ascii", "ignore")) for f in fields)


def encode_bool_as_int(*fields) -> bytes:
    """Typed and length-prefixed, but ``True`` takes the int path (bool is a subclass of int): a flag and
    the number 1 get one key."""
    return b"".join(_encode_typed(f, bool_tag=False) for f in fields)


# ============================================================================ 1b chained hash

_DOMAIN = BLOCK_DOMAIN


def hash_untyped_concat(parent, tokens, extra, tenant_key) -> bytes:
    """Untyped concatenation of decimal token ids: blocks (1, 23) and (12, 3) collide."""
    data = (parent or b"") + "".join(map(str, tokens)).encode() + "".join(map(str, extra)).encode() + (tenant_key or b"")
    return hashlib.sha256(data).digest()


def hash_unchained(parent, tokens, extra, tenant_key) -> bytes:
    """Content-only key: ignores the parent, so a block is reused after a different prefix."""
    return hashlib.sha256(_typed(_DOMAIN, tuple(tokens), tuple(extra), tenant_key)).digest()


def hash_packed_no_boundaries(parent, tokens, extra, tenant_key) -> bytes:
    """Raw bytes glued together (packed int32 tokens): the parent's bytes run into the tokens'."""
    data = (parent or b"") + struct.pack(f">{len(tokens)}i", *tokens) + b"".join(
        e if isinstance(e, bytes) else str(e).encode() for e in extra) + (tenant_key or b"")
    return hashlib.sha256(data).digest()


def hash_ignores_tenant(parent, tokens, extra, tenant_key) -> bytes:
    """Typed and chained, but the tenant key never reaches the cache key."""
    return hashlib.sha256(_typed(_DOMAIN, parent, tuple(tokens), tuple(extra))).digest()


def hash_truncated(parent, tokens, extra, tenant_key) -> bytes:
    """Typed, chained, domain-separated -- then cut to 16 bytes ("still 128 bits"): the contract says the
    full digest, never truncated (an easy one for a grader to miss)."""
    return hashlib.sha256(_typed(_DOMAIN, parent, tuple(tokens), tuple(extra), tenant_key)).digest()[:16]


def hash_label_last(parent, tokens, extra, tenant_key) -> bytes:
    """Typed, chained, full digest, but the domain label is hashed after the fields: the contract puts it
    first."""
    return hashlib.sha256(_typed(parent, tuple(tokens), tuple(extra), tenant_key, _DOMAIN)).digest()


def hash_no_type_checks(parent, tokens, extra, tenant_key) -> bytes:
    """Right key for right input, but a str parent or the token True gets a key too (True keys like 1 once
    the tokens are packed as ints): the contract's TypeError never comes."""
    return hashlib.sha256(_typed(_DOMAIN, parent, tuple(int(t) for t in tokens), tuple(extra), tenant_key)).digest()


MUTANTS = {
    "1a": entries(("untyped", encode_untyped), ("no-length", encode_no_length), ("repr", encode_json_like),
                  ("typed-separator", encode_typed_separator), ("ascii-ignore", encode_ascii_ignore),
                  ("bool-as-int", encode_bool_as_int)),
    "1b": entries(("untyped-concat", hash_untyped_concat), ("unchained", hash_unchained),
                  ("packed-no-boundaries", hash_packed_no_boundaries), ("ignores-tenant", hash_ignores_tenant),
                  ("truncated", hash_truncated), ("label-last", hash_label_last),
                  ("no-type-checks", hash_no_type_checks)),
}


DIAGNOSES = {
    ("1a", "untyped"): "containing the separator", ("1a", "no-length"): "boundary moved",
    ("1a", "repr"): "a list and a tuple", ("1a", "typed-separator"): "containing the separator",
    ("1b", "untyped-concat"): "without separators are ambiguous", ("1b", "unchained"): "unchained key",
    ("1b", "packed-no-boundaries"): "need length prefixes", ("1b", "ignores-tenant"): "tenant key never reaches the hash",
    ("1b", "truncated"): "truncated key",
    ("1a", "ascii-ignore"): "lossy text encoding", ("1a", "bool-as-int"): "bool encoded like int",
    ("1b", "label-last"): "domain label not first", ("1b", "no-type-checks"): "keys for values that are not block fields",
}
