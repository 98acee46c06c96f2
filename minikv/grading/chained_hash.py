"""Grader for exercise 1: an injective encoding (1a) and a chained, typed block hash (1b).

A block's cache key stands for "this exact prefix, for this tenant".  That holds only if the
bytes hashed are an injective encoding of (parent, tokens, extra, tenant_key): SHA-256 cannot
tell apart inputs that were already equal before hashing.  So the checks attack the encoding
with :data:`TRICKY_FIELDS` / :data:`TRICKY_BLOCKS` -- moved boundaries, digits run together,
``None`` vs empty, types confused -- each a pair that real engines have collided on, then run
the hash in an engine (:mod:`.hashing_workload`) against minikv's ``sha256``.
"""
from __future__ import annotations

import hashlib
import itertools

from ..security.encoding import encode_fields as ref_encode_fields
from ._report import call_safely, expect, grader
from .hashing_workload import WORKLOAD, engine_stage_hasher

KEY_A, KEY_B = b"A" * 32, b"B" * 32

#: (fields_a, fields_b, why they must differ)
TRICKY_FIELDS = [
    ((b"a", b"bc"), (b"ab", b"c"), "a field boundary moved: without a length prefix a|bc and ab|c are the same bytes"),
    (("lora", "salt"), ("lorasalt",), "two fields vs one (vLLM #44701: a LoRA name and a cache_salt collided)"),
    (((1, 23),), ((12, 3),), "token blocks (1, 23) and (12, 3): joining decimal strings gives '123' twice"),
    (((1, 2, 3),), ((1, 23),), "token blocks (1, 2, 3) and (1, 23): digits without separators are ambiguous"),
    ((None,), (b"",), "None vs empty bytes: a missing parent is not an empty one"),
    ((None,), ("",), "None vs the empty string (the anonymous tenant vs a tenant named '')"),
    ((None,), (), "one None field vs no field at all"),
    ((b"",), ("",), "empty bytes vs empty str: types need tags"),
    ((0,), (b"\x00",), "the int 0 vs the byte 0: types need tags"),
    ((("1",),), ((1,),), "the string '1' vs the int 1"),
    (("1",), (1,), "the string '1' vs the int 1"),
    (((),), (), "an empty tuple field vs no field"),
    (((), ()), ((),), "two empty tuples vs one"),
    ((((1, 2), 3),), ((1, (2, 3)),), "nesting moved: ((1, 2), 3) vs (1, (2, 3))"),
    (((1,), 2), ((1, 2),), "a sequence boundary moved: (1,), 2 vs (1, 2)"),
    ((b"\x00\x00\x00\x07", (8,)), (b"", (7, 8)), "bytes of one field spilling into the next"),
    ((2**31,), (2**31 - 1,), "large ints"),
    ((-1,), (255,), "negative ints need a sign"),
    ((b"k" * 32, ()), ((), b"k" * 32), "field order"),
]

#: (name, (parent, tokens, extra, tenant_key) a, ... b, why)
TRICKY_BLOCKS = [
    ("digits", (None, (1, 23), (), None), (None, (12, 3), (), None),
     "blocks (1, 23) and (12, 3) got the same key: token ids joined without separators are ambiguous"),
    ("digits3", (None, (1, 2, 3), (), None), (None, (12, 3), (), None),
     "blocks (1, 2, 3) and (12, 3) got the same key: token ids joined without separators are ambiguous"),
    ("extra", (None, (5, 6), ("a", "bc"), None), (None, (5, 6), ("ab", "c"), None),
     "extra keys ('a', 'bc') and ('ab', 'c') got the same key: extra fields need length prefixes"),
    ("spill", (b"\x00\x00\x00\x07", (8,), (), None), (None, (7, 8), (), None),
     "parent b'\\x00\\x00\\x00\\x07' + block (8,) and no parent + block (7, 8) got the same key: "
     "the parent's bytes ran into the tokens' bytes"),
    ("parent-none", (None, (5, 6), (), None), (b"", (5, 6), (), None),
     "parent None and parent b'' got the same key"),
    ("key-vs-extra", (None, (5, 6), (KEY_A,), None), (None, (5, 6), (), KEY_A),
     "the same bytes as an extra key or as the tenant key gave the same key: fields need tags"),
]


# --------------------------------------------------------------------------- 1a encode_fields

@grader("give every field a type tag and a length prefix: tag || len || payload, recursively for sequences.")
def check_encode_fields(encode_fields) -> str:
    """Exercise 1a: typed, length-prefixed, canonical, injective on a battery of tricky inputs."""
    out = encode_fields(b"ab", "c", 1, None, (1, 2))
    expect(isinstance(out, bytes), f"encode_fields returned {type(out).__name__}, expected bytes")
    expect(out == encode_fields(b"ab", "c", 1, None, (1, 2)), "the same fields gave different bytes twice",
           "the encoding must be deterministic: no randomness, no id() or hash().")
    for a, b, why in TRICKY_FIELDS:
        ea, eb = encode_fields(*a), encode_fields(*b)
        expect(ea != eb, f"encode_fields{a!r} == encode_fields{b!r} ({why})",
               "prefix every field with a type tag and its length in bytes, so a decoder always knows "
               "what a field was and where it ends.")
    expect(encode_fields([1, 2, "a"]) == encode_fields((1, 2, "a")),
           "a list and a tuple with the same items encoded differently",
           "encode lists and tuples as the same 'sequence' type: a key must not depend on the container.")
    for bad in (1.5, {"a": 1}, object()):
        _, exc = call_safely(encode_fields, bad)
        expect(isinstance(exc, TypeError), f"encode_fields({type(bad).__name__}) did not raise TypeError "
               f"({'returned a value' if exc is None else type(exc).__name__})",
               "raise TypeError for unsupported types instead of guessing an encoding (str(x) is ambiguous).")
    # Compare with the engine's reference encoding: equal exactly when the reference is equal.
    inputs = [x for pair in TRICKY_FIELDS for x in pair[:2]]
    for x, y in itertools.combinations(inputs, 2):
        same_ref = ref_encode_fields(*x) == ref_encode_fields(*y)
        expect((encode_fields(*x) == encode_fields(*y)) == same_ref,
               f"encode_fields{x!r} and encode_fields{y!r} are {'different' if same_ref else 'equal'}, "
               f"the reference minikv.security.encoding says {'equal' if same_ref else 'different'}")
    return f"{len(TRICKY_FIELDS)} tricky pairs encode differently; lists == tuples; unsupported types raise"


# --------------------------------------------------------------------------- 1b chained hash

def check_block_hash_properties(hasher, label: str) -> None:
    base = (None, (1, 2, 3, 4), (), None)
    h0 = hasher(*base)
    expect(isinstance(h0, bytes), f"{label} returned {type(h0).__name__}, expected bytes")
    expect(len(h0) >= 16, f"{label} returned {len(h0)} bytes; at least 16 are needed",
           "never truncate a cache key: with 8 bytes a birthday search finds collisions; use the full digest.")
    expect(hasher(*base) == h0, f"{label} gave two different keys for the same block",
           "keys must be deterministic, or a prefix never hits its own cache.")
    variants = {
        "parent": (b"\x01" * 32, (1, 2, 3, 4), (), None),
        "tokens": (None, (1, 2, 3, 5), (), None),
        "extra": (None, (1, 2, 3, 4), ("lora-a",), None),
        "tenant_key": (None, (1, 2, 3, 4), (), KEY_A),
    }
    for field, args in variants.items():
        expect(hasher(*args) != h0, f"changing only `{field}` did not change the key",
               f"the key must cover `{field}`" + (
                   ": chaining (the parent's key) makes a key stand for the whole prefix." if field == "parent"
                   else "."))
    expect(hasher(b"\x01" * 32, (1, 2, 3, 4), (), None) != hasher(b"\x02" * 32, (1, 2, 3, 4), (), None),
           "two different parents gave the same key for the same tokens",
           "hash the parent key into the block key (chaining).")
    for _, a, b, why in TRICKY_BLOCKS:
        expect(hasher(*a) != hasher(*b), why, "encode (parent, tokens, extra, tenant_key) with your typed, "
               "length-prefixed encode_fields before hashing.")


@grader("sha256 over encode_fields(BLOCK_DOMAIN, parent, tuple(tokens), tuple(extra), tenant_key).")
def check_chained_hash(chained_block_hash, encode_fields=None) -> str:
    """Exercise 1b: properties on direct calls, then inside a real engine against ``sha256``."""
    check_block_hash_properties(chained_block_hash, "chained_block_hash")
    if encode_fields is not None:  # domain separation, checked against the learner's own encoding
        for parent, tokens, extra, key in [(None, (1, 2, 3, 4), (), None), (b"p" * 32, (7, 8), ("x",), KEY_A)]:
            for plain in (encode_fields(parent, tokens, extra, key), encode_fields(parent, tuple(tokens), extra, key)):
                expect(chained_block_hash(parent, tokens, extra, key) != hashlib.sha256(plain).digest(),
                       "the key is the plain sha256 of the encoded fields: it is not domain-separated",
                       "put the label BLOCK_DOMAIN first in the message: encode_fields(BLOCK_DOMAIN, parent, ...).")
    cached, log = engine_stage_hasher(chained_block_hash, "sha256")
    return (f"typed and chained; in the engine {len(WORKLOAD)} requests cached exactly what sha256 caches "
            f"({sum(cached)} tokens, 0 cross-tenant)")
