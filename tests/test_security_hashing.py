"""Tests for minikv.security.encoding, .keys and .hashing."""

from __future__ import annotations

import ast
import enum
import hashlib
import hmac
import json
import os
import subprocess
import sys
import timeit
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.security.encoding import decode_fields, encode_fields
from minikv.security.hashing import BLOCK_DOMAIN, HASHERS, UNSAFE_HASHES, BlockHasher, make_hasher
from minikv.security.keys import (derive_operator_key, derive_shared_key, derive_tenant_key,
                                  new_engine_secret)

SECRET = bytes(range(32))
OTHER_SECRET = bytes(range(1, 33))
BLOCK = tuple(range(1000, 1016))
SECURE = sorted(set(HASHERS) - UNSAFE_HASHES)
KEYED = ["hmac-sha256", "blake2b-keyed"]
ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------ encoding

@pytest.mark.parametrize("a, b", [
    ((b"a", b"bc"), (b"ab", b"c")),
    (("lora", "salt"), ("lorasalt",)),
    (("lora", "salt"), ("lorasal", "t")),
    (("abc",), (b"abc",)),
    ((None,), (b"",)),
    ((None,), ()),
    ((None,), ("",)),
    ((1,), (True,)),
    ((0,), (False,)),
    (((1, 2),), (1, 2)),
    (((1, 2),), ((1, (2,)),)),
    (((True, 2),), ((1, 2),)),
    (((), ()), ((),)),
    ((0,), (b"\x00",)),
    (((1,), 2), ((1, 2),)),
    ((2**31,), (2**31 - 1,)),
    (((2**31,),), ((2**31 - 1,),)),
    ((-1,), (2**8 - 1,)),
])
def test_tricky_inputs_encode_differently(a, b):
    assert encode_fields(*a) != encode_fields(*b)


def test_field_layout_is_tag_length_payload():
    assert encode_fields(b"xy") == b"\x01" + (2).to_bytes(8, "big") + b"xy"
    assert encode_fields(None) == b"\x00" + bytes(8)
    # a token tuple packs as big-endian int32 under its own tag
    assert encode_fields((1, 2)) == b"\x06" + (8).to_bytes(8, "big") + b"\x00\x00\x00\x01\x00\x00\x00\x02"


def test_list_and_tuple_are_the_same_sequence():
    # deliberate: a key must not depend on the caller's container type
    assert encode_fields([1, 2, "a"]) == encode_fields((1, 2, "a"))


def test_int_subclasses_encode_canonically():
    class Color(enum.IntEnum):
        RED = 7

    assert encode_fields(Color.RED) == encode_fields(7)
    assert encode_fields((Color.RED, 3)) == encode_fields((7, 3))
    assert encode_fields(bytearray(b"ab"), memoryview(b"c")) == encode_fields(b"ab", b"c")


@pytest.mark.parametrize("bad, name", [(1.5, "float"), ({"a": 1}, "dict"), ((1, 2.0), "float"),
                                       ([b"x", {1}], "set"), (object(), "object")])
def test_unsupported_types_raise_naming_the_type(bad, name):
    with pytest.raises(TypeError, match=name):
        encode_fields("ok", bad)


def _typed(value):
    """A representation where True != 1 and lists equal tuples (the encoding's notion of equality)."""
    if isinstance(value, (list, tuple)):
        return ("seq", tuple(_typed(v) for v in value))
    return (type(value).__name__, value)


_leaf = st.none() | st.binary(max_size=6) | st.text(max_size=6) | st.integers() | st.booleans()
_field = st.recursive(_leaf, lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner), max_leaves=12)
_fields = st.lists(_field, max_size=4).map(tuple)


@settings(max_examples=300, deadline=None)
@given(_fields)
def test_decode_inverts_encode(fields):
    # A left inverse is the proof of injectivity for every input, not just sampled pairs.
    assert _typed(decode_fields(encode_fields(*fields))) == _typed(fields)


@settings(max_examples=300, deadline=None)
@given(_fields, _fields)
def test_distinct_fields_give_distinct_encodings(x, y):
    if _typed(x) != _typed(y):
        assert encode_fields(*x) != encode_fields(*y)
    else:
        assert encode_fields(*x) == encode_fields(*y)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=20), st.data())
def test_every_split_of_a_byte_string_is_a_different_key(data, draw):
    i = draw.draw(st.integers(0, len(data)))
    j = draw.draw(st.integers(0, len(data)))
    if i != j:
        assert encode_fields(data[:i], data[i:]) != encode_fields(data[:j], data[j:])


@given(st.lists(st.integers(-(2**70), 2**70), max_size=20))
def test_int_sequences_round_trip_across_packed_widths(ints):
    assert decode_fields(encode_fields(ints)) == (tuple(ints),)


@pytest.mark.parametrize("blob", [b"\x01", b"\x01" + (5).to_bytes(8, "big") + b"ab", b"\x09" + bytes(8),
                                  b"\x04" + (1).to_bytes(8, "big") + b"\x02"])
def test_decode_rejects_malformed_input(blob):
    with pytest.raises(ValueError):
        decode_fields(blob)


# ------------------------------------------------------------------ keys

def test_engine_secret_is_fresh_and_32_bytes():
    a, b = new_engine_secret(), new_engine_secret()
    assert isinstance(a, bytes) and len(a) == 32 and a != b


def test_tenant_key_matches_the_documented_derivation():
    expected = hmac.new(SECRET, encode_fields("minikv/tenant-key/v1", "alice"), hashlib.sha256).digest()
    assert derive_tenant_key(SECRET, "alice") == expected


def test_tenant_keys_are_deterministic_and_separated():
    alice = derive_tenant_key(SECRET, "alice")
    assert alice == derive_tenant_key(SECRET, "alice") and len(alice) == 32
    keys = {derive_tenant_key(SECRET, t) for t in ("alice", "bob", "", None, "None")}
    keys |= {derive_operator_key(SECRET), derive_shared_key(SECRET), derive_tenant_key(OTHER_SECRET, "alice")}
    assert len(keys) == 8  # anonymous != "", and every label is its own domain


def test_key_validation_names_the_problem():
    with pytest.raises(ValueError, match="8 bytes"):
        derive_tenant_key(b"x" * 8, "alice")
    with pytest.raises(TypeError, match="str"):
        derive_operator_key("not-bytes-but-long-enough")
    with pytest.raises(TypeError, match="int"):
        derive_tenant_key(SECRET, 42)
    assert derive_shared_key(bytearray(SECRET)) == derive_shared_key(SECRET)


# ------------------------------------------------------------------ hashers

@pytest.fixture(params=sorted(HASHERS))
def name(request):
    return request.param


def test_hashers_follow_the_seam_and_are_deterministic(name):
    h1, h2 = make_hasher(name, SECRET), make_hasher(name, SECRET)
    assert isinstance(h1, BlockHasher)
    parent, tk = hashlib.sha256(b"p").digest(), derive_tenant_key(SECRET, "alice")
    out = h1(parent, BLOCK, (), tk)
    assert isinstance(out, bytes) and out == h2(parent, BLOCK, (), tk) == h1(parent, list(BLOCK), (), tk)
    assert len(out) == h1.digest_size == (32 if name in SECURE else len(out))
    assert h1.unsafe == (name in UNSAFE_HASHES)


def test_tenant_keys_separate_and_group_blocks(name):
    h = make_hasher(name, SECRET)
    alice, bob = derive_tenant_key(SECRET, "alice"), derive_tenant_key(SECRET, "bob")
    assert h(None, BLOCK, (), alice) == h(None, BLOCK, (), derive_tenant_key(SECRET, "alice"))
    outs = {h(None, BLOCK, (), k) for k in (alice, bob, None, derive_tenant_key(SECRET, None))}
    assert len(outs) == 4


def test_every_input_changes_the_hash(name):
    h = make_hasher(name, SECRET)
    base = h(None, BLOCK, (), None)
    variants = [h(hashlib.sha256(b"p").digest(), BLOCK, (), None), h(hashlib.sha256(b"q").digest(), BLOCK, (), None),
                h(None, BLOCK[:-1] + (BLOCK[-1] + 1,), (), None), h(None, BLOCK[::-1], (), None),
                h(None, BLOCK, ("lora-a",), None), h(None, BLOCK, ("lora-b",), None), h(None, BLOCK, (7,), None)]
    assert len({base, *variants}) == 1 + len(variants)


@pytest.mark.parametrize("keyed", KEYED)
def test_keyed_hashers_differ_across_engine_secrets(keyed):
    a, b = make_hasher(keyed, SECRET), make_hasher(keyed, OTHER_SECRET)
    assert a.keyed and a(None, BLOCK, (), None) != b(None, BLOCK, (), None)
    assert (a(None, BLOCK, (), derive_tenant_key(SECRET, "t"))
            != b(None, BLOCK, (), derive_tenant_key(OTHER_SECRET, "t")))
    with pytest.raises(ValueError, match="tenant_key"):
        a(None, BLOCK, (), b"short")
    # tenant-keyed and shared blocks live in disjoint message domains, even under one key
    assert a(None, BLOCK, (), derive_shared_key(SECRET)) != a(None, BLOCK, (), None)


def test_sha256_is_the_documented_unkeyed_formula():
    """Exercise 1b's construction: domain-separated, never the plain sha256 of the fields."""
    h, tk = make_hasher("sha256", SECRET), derive_tenant_key(SECRET, "alice")
    fields = (b"P" * 32, BLOCK, ("x",), tk)
    assert h(*fields) == hashlib.sha256(encode_fields(BLOCK_DOMAIN, *fields)).digest()
    assert h(*fields) != hashlib.sha256(encode_fields(*fields)).digest()
    assert h(None, BLOCK, (), None) == make_hasher("sha256", OTHER_SECRET)(None, BLOCK, (), None)


_CHILD = """
import json, sys
from minikv.security.hashing import HASHERS, make_hasher
from minikv.security.keys import derive_tenant_key
secret = bytes(range(32)); tk = derive_tenant_key(secret, "alice")
print(json.dumps({n: make_hasher(n, secret)(b"P" * 32, tuple(range(1000, 1016)), ("x",), tk).hex()
                  for n in HASHERS}))
"""


def test_all_hashers_are_stable_across_processes_and_hash_seeds():
    tk = derive_tenant_key(SECRET, "alice")
    here = {n: make_hasher(n, SECRET)(b"P" * 32, BLOCK, ("x",), tk).hex() for n in HASHERS}
    for seed in ("0", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=120)
        assert json.loads(out.stdout.strip().splitlines()[-1]) == here


@pytest.mark.parametrize("bad", ["md5", "SHA256", "", None, 3])
def test_make_hasher_rejects_unknown_names(bad):
    with pytest.raises(ValueError, match=r"sha256.*") as err:
        make_hasher(bad, SECRET)
    assert repr(bad) in str(err.value)


def test_make_hasher_validates_the_secret(name):
    with pytest.raises(ValueError, match="4"):
        make_hasher(name, b"abcd")


def test_every_registered_hasher_is_a_setting_and_a_flag():
    """The registry is the one list: the config, its UNSAFE subset and the CLI all follow it."""
    from minikv.cli import build_parser
    from minikv.engine import config

    assert set(HASHERS) == set(config.HASH_ALGOS)
    assert UNSAFE_HASHES == frozenset(config.UNSAFE_HASH_ALGOS) and UNSAFE_HASHES < set(HASHERS)
    for name in HASHERS:
        args = build_parser().parse_args(["generate", "--model", "m", "x", "--hash-algo", name])
        assert args.hash_algo == name
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--model", "m", "x", "--hash-algo", "md5"])


def test_hashing_a_block_costs_microseconds(name):
    h, tk = make_hasher(name, SECRET), derive_tenant_key(SECRET, "alice")
    parent = hashlib.sha256(b"p").digest()
    per_call = min(timeit.repeat(lambda: h(parent, BLOCK, (), tk), number=2000, repeat=3)) / 2000
    assert per_call < 100e-6  # measured ~0.5-3 us; a 30x margin keeps this stable on busy machines


@pytest.mark.parametrize("module", ["encoding", "hashing", "keys", "scrub"])
def test_no_module_level_torch_import(module):
    tree = ast.parse((ROOT / "minikv" / "security" / f"{module}.py").read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
    names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
    assert not any(x.split(".")[0] in ("torch", "numpy") for x in names)


def test_importing_minikv_security_loads_neither_torch_nor_numpy():
    code = ("import sys, minikv.security, minikv.attacks.collisions, minikv.security.scrub; "
            "print('torch' in sys.modules, 'numpy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.split()[-2:] == ["False", "False"]
