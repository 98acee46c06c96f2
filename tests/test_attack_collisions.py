"""Tests for minikv.attacks.collisions and the committed collision_pairs.json."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minikv.attacks import collisions as C
from minikv.security.hashing import UNSAFE_HASHES, make_hasher

SECRET = bytes(range(32))
SECURE = ["sha256", "hmac-sha256", "blake2b-keyed"]
PAIRS = C.load_committed_pairs()
ROOT = Path(__file__).resolve().parents[1]
M64 = (1 << 64) - 1


def _key(name, block):
    return make_hasher(name, SECRET)(None, tuple(block), (), None)


def test_one_committed_pair_per_unsafe_hash():
    assert set(PAIRS) == UNSAFE_HASHES
    doc = json.loads(C.PAIRS_PATH.read_text())
    assert doc["vocab_size"] == C.VOCAB_SIZE == 49152 and doc["block_size"] == C.BLOCK_SIZE == 16
    for name, entry in doc["pairs"].items():
        assert entry["hash"] == name and entry["note"]


@pytest.mark.parametrize("name", sorted(UNSAFE_HASHES))
def test_committed_pair_is_a_real_in_vocabulary_collision(name):
    a, b = PAIRS[name]
    assert a != b and len(a) == len(b) == 16
    assert all(type(t) is int and 0 <= t < 49152 for t in a + b)
    assert _key(name, a) == _key(name, b)
    assert C.collides(name, a, b)


@pytest.mark.parametrize("name", sorted(UNSAFE_HASHES))
@pytest.mark.parametrize("secure", SECURE)
def test_secure_hashers_separate_every_committed_pair(name, secure):
    a, b = PAIRS[name]
    assert _key(secure, a) != _key(secure, b)
    assert not C.collides(secure, a, b)


def test_builtin_pair_collides_under_python_hash_itself():
    a, b = PAIRS["builtin"]
    # the exact tuples BuiltinHasher hashes for parent=None, tenant_key=None, extra=()
    assert hash((0, 0, *a)) == hash((0, 0, *b))
    assert _key("builtin", a) == hash((0, 0, *a)).to_bytes(8, "big", signed=True)


def test_builtin_pair_follows_the_documented_algebra():
    # u = acc15 * P2^-1 of the two 15-token prefixes differ by exactly the last-token gap
    a, b = PAIRS["builtin"]

    def u(prefix):
        acc = C._P5
        for lane in (0, 0, *prefix):
            acc = C._round_int(acc, lane)
        return acc * pow(C._P2, -1, 1 << 64) & M64

    assert (u(a[:15]) - u(b[:15])) & M64 == (b[15] - a[15]) & M64


_CHILD = """
from minikv.attacks.collisions import load_committed_pairs
from minikv.security.hashing import make_hasher
h = make_hasher("builtin", bytes(32)); a, b = load_committed_pairs()["builtin"]
print(h(None, a, (), None).hex(), h(None, b, (), None).hex(), h(b"P" * 32, a, (7,), b"K" * 32).hex())
"""


def test_builtin_hash_is_stable_across_processes():
    h = make_hasher("builtin", SECRET)
    a, b = PAIRS["builtin"]
    here = [h(None, a, (), None).hex(), h(None, b, (), None).hex(), h(b"P" * 32, a, (7,), b"K" * 32).hex()]
    for seed in ("1", "987654"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=ROOT, capture_output=True,
                             text=True, check=True, timeout=120)
        assert out.stdout.strip().splitlines()[-1].split() == here


# ------------------------------------------------------------------ poly

_block = st.lists(st.integers(0, 49151), min_size=16, max_size=16).map(tuple)


@settings(max_examples=200, deadline=None)
@given(_block, st.integers(0, 14))
def test_poly_twin_collides_for_random_blocks(block, j):
    try:
        twin = C.poly_collision(block, j)
    except ValueError:
        # only impossible when neither direction fits the vocabulary
        assert (block[j] + 31 >= 49152 or block[j + 1] == 0) and (block[j] < 31 or block[j + 1] == 49151)
        return
    assert twin != block and all(0 <= t < 49152 for t in twin)
    assert [i for i in range(16) if twin[i] != block[i]] == [j, j + 1]
    assert abs(twin[j] - block[j]) == 31 and abs(twin[j + 1] - block[j + 1]) == 1
    assert _key("poly", block) == _key("poly", twin)
    assert _key("sha256", block) != _key("sha256", twin)


def test_poly_twin_is_the_forward_move_when_it_fits():
    block = tuple(range(100, 116))
    assert C.poly_collision(block, 3) == block[:3] + (block[3] + 31, block[4] - 1) + block[5:]
    assert C.poly_collision(block) == (131, 100) + block[2:]


def test_poly_twin_refuses_out_of_vocabulary_moves():
    with pytest.raises(ValueError, match="j=0"):
        C.poly_collision((5, 0) + (1,) * 14, 0)
    with pytest.raises(ValueError, match="j=15"):
        C.poly_collision(tuple(range(16)), 15)


def test_poly_twin_also_holds_with_parent_and_tenant():
    h, block = make_hasher("poly", SECRET), tuple(range(500, 516))
    twin = C.poly_collision(block, 7)
    assert h(b"P" * 32, block, (), b"K" * 32) == h(b"P" * 32, twin, (), b"K" * 32)


# ------------------------------------------------------------------ trunc32

def test_trunc32_birthday_search_finds_a_new_pair_quickly():
    start = time.perf_counter()
    pair = C.search_trunc32_collision(n_samples=2**16, seed=1)
    assert time.perf_counter() - start < 5
    assert pair is not None and pair != PAIRS["trunc32"]
    a, b = pair
    assert a != b and _key("trunc32", a) == _key("trunc32", b)
    assert _key("sha256", a) != _key("sha256", b)


def test_trunc32_search_returns_none_when_too_small():
    assert C.search_trunc32_collision(n_samples=50, seed=1) is None


# ------------------------------------------------------------------ builtin

def test_numpy_tuple_hash_matches_python_hash():
    rng = random.Random(7)
    for length in (0, 1, 2, 16, 18, 40):
        tuples = [tuple(rng.randrange(49152) for _ in range(length)) for _ in range(200)]
        if length:  # items whose hash is not the item itself: negative and >= 2**61 - 1
            tuples += [tuple(rng.choice([-5, -1, 2**61, 2**64 - 1, 0]) for _ in range(length)) for _ in range(50)]
        lanes = np.array([[hash(x) & M64 for x in t] for t in tuples], dtype=np.uint64).reshape(len(tuples), length)
        assert C.tuple_hash_np(lanes).tolist() == [hash(t) for t in tuples]


@pytest.mark.slow  # ~4 s and ~600 MB of numpy arrays: it re-runs the builtin search
def test_committed_pairs_are_reproducible(tmp_path):
    pairs = C.write_committed_pairs(tmp_path / "pairs.json", seed=0)
    assert pairs == PAIRS
    assert (tmp_path / "pairs.json").read_text() == C.PAIRS_PATH.read_text()
