"""Typed, length-prefixed encoding of the fields that go into a cache key.

Every field is ``tag (1 byte) || length (8 bytes, big-endian) || payload``, so different field
tuples never give the same bytes (``("lora", "salt")`` vs ``("lorasalt",)``, vLLM #44701), and
:func:`decode_fields` inverts it: the proof of injectivity.  Tuples and lists are the same
sequence; token tuples take packed int32/int64 fast paths.  Lesson 07, section 2 ("One byte
string from many fields") explains why a key needs this and tabulates the wire format.
"""

from __future__ import annotations

import struct

__all__ = ["encode_fields", "decode_fields"]

TAG_NONE, TAG_BYTES, TAG_STR, TAG_INT, TAG_BOOL, TAG_SEQ, TAG_INTS32, TAG_INTS64 = range(8)

_HEADER = struct.Struct(">BQ")  # tag + 8-byte length: 9 bytes in front of every field
_ONLY_INT = frozenset({int})
_NONE_FIELD = _HEADER.pack(TAG_NONE, 0)
_BOOL_FIELDS = {False: _HEADER.pack(TAG_BOOL, 1) + b"\x00", True: _HEADER.pack(TAG_BOOL, 1) + b"\x01"}
_packers: dict[tuple[str, int], struct.Struct] = {}  # ("i" | "q", n) -> compiled Struct


def _packer(code: str, n: int) -> struct.Struct:
    # Compiling a format string costs more than packing 16 ints, so keep one per length.
    packer = _packers.get((code, n))
    if packer is None:
        packer = _packers[(code, n)] = struct.Struct(f">{n}{code}")
    return packer


def _encode_int(value: int) -> bytes:
    # (bit_length + 8) // 8 bytes always leave room for the sign bit, for any sign.
    payload = value.to_bytes((value.bit_length() + 8) // 8, "big", signed=True)
    return _HEADER.pack(TAG_INT, len(payload)) + payload


def _encode_seq(items) -> bytes:
    n = len(items)
    # Fast path: a token block is a tuple of plain ints (exactly ``int``: bools and int
    # subclasses take the slow path below so that True never packs as 1).
    if _ONLY_INT.issuperset(map(type, items)):
        # struct raises on out-of-range values, which is cheaper than min()/max() checks
        # on the hot path; huge ints fall through to the generic form.
        try:
            return _HEADER.pack(TAG_INTS32, 4 * n) + _packer("i", n).pack(*items)
        except struct.error:
            pass
        try:
            return _HEADER.pack(TAG_INTS64, 8 * n) + _packer("q", n).pack(*items)
        except struct.error:
            pass
    elif all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        # IntEnum members and friends: normalise to int so the key is canonical.
        return _encode_seq([int(x) for x in items])
    return _HEADER.pack(TAG_SEQ, n) + b"".join(map(_encode_one, items))


def _encode_one(value) -> bytes:
    kind = type(value)
    # Exact-type dispatch first (the common case), isinstance second (subclasses).
    if kind is tuple or kind is list:
        return _encode_seq(value)
    if kind is bytes:
        return _HEADER.pack(TAG_BYTES, len(value)) + value
    if value is None:
        return _NONE_FIELD
    if kind is bool:
        return _BOOL_FIELDS[value]
    if kind is int:
        return _encode_int(value)
    if kind is str:
        data = value.encode("utf-8", "surrogatepass")
        return _HEADER.pack(TAG_STR, len(data)) + data
    if isinstance(value, int):
        return _encode_int(int(value))
    if isinstance(value, str):
        return _encode_one(str(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return _encode_one(bytes(value))
    if isinstance(value, (tuple, list)):
        return _encode_seq(value)
    raise TypeError(
        f"cannot encode a value of type {kind.__name__!r} in a cache key; "
        "supported: None, bytes, str, int, bool, tuple/list of those"
    )


def encode_fields(*fields) -> bytes:
    """Encode ``fields`` into bytes from which they can be recovered unambiguously.

    The result is the concatenation of each field's ``tag || length || payload``.  Because
    every field is self-delimiting, the concatenation is uniquely decodable too: different
    argument tuples (including ones of different lengths) never give the same bytes.

    >>> encode_fields(b"a", b"bc") == encode_fields(b"ab", b"c")
    False
    >>> encode_fields("lora", "salt") == encode_fields("lorasalt")
    False

    Raises:
        TypeError: a field (or nested item) has an unsupported type; the message names it.
    """
    return b"".join(map(_encode_one, fields))


def decode_fields(data: bytes) -> tuple:
    """Invert :func:`encode_fields` (sequences come back as tuples).

    The engine never needs this; it exists as the *proof* of injectivity -- an encoding
    with a left inverse cannot map two inputs to one output -- and for the tests.

    Raises:
        ValueError: ``data`` is truncated, has trailing bytes or an unknown tag.
    """
    view = memoryview(bytes(data))
    fields, pos = [], 0
    while pos < len(view):
        value, pos = _decode_one(view, pos)
        fields.append(value)
    return tuple(fields)


def _decode_one(view: memoryview, pos: int):
    if pos + _HEADER.size > len(view):
        raise ValueError(f"truncated field header at byte {pos}")
    tag, length = _HEADER.unpack_from(view, pos)
    pos += _HEADER.size
    if tag == TAG_SEQ:
        items = []
        for _ in range(length):
            item, pos = _decode_one(view, pos)
            items.append(item)
        return tuple(items), pos
    end = pos + length
    if end > len(view):
        raise ValueError(f"field at byte {pos - _HEADER.size} claims {length} bytes, only {len(view) - pos} left")
    payload = view[pos:end]
    if tag == TAG_NONE and length == 0:
        return None, end
    if tag == TAG_BYTES:
        return bytes(payload), end
    if tag == TAG_STR:
        return bytes(payload).decode("utf-8", "surrogatepass"), end
    if tag == TAG_INT and length > 0:
        return int.from_bytes(payload, "big", signed=True), end
    if tag == TAG_BOOL and length == 1 and payload[0] in (0, 1):
        return bool(payload[0]), end
    if tag == TAG_INTS32 and length % 4 == 0:
        return struct.unpack(f">{length // 4}i", payload), end
    if tag == TAG_INTS64 and length % 8 == 0:
        return struct.unpack(f">{length // 8}q", payload), end
    raise ValueError(f"malformed field: tag {tag:#04x} with length {length}")
