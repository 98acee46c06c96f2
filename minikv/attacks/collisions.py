"""Crafted collisions for the three UNSAFE block hashers: attack tooling (lesson 06).

A prefix-cache key collision means two different token blocks share one cache entry: the
second request silently attends over K/V computed for the first one's text.  For the
secure hashers finding any collision costs ~2**128 work.  For the unsafe ones it costs
nothing (``poly``), a fraction of a second (``trunc32``) or a few seconds (``builtin``).
Every search here uses the setting the course uses: SmolLM2's vocabulary (ids in
``[0, 49152)``), 16-token blocks, ``parent=None``, ``tenant_key=None``, ``extra=()``.

The pairs found are committed in ``collision_pairs.json`` (load them with
:func:`load_committed_pairs`); ``python -m minikv.attacks.collisions`` re-runs every
search and rewrites the file.  numpy is imported lazily: the engine never needs it here.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

from ..security.hashing import make_hasher

__all__ = [
    "VOCAB_SIZE", "BLOCK_SIZE", "PAIRS_PATH",
    "poly_collision", "search_trunc32_collision", "tuple_hash_np", "search_builtin_collision",
    "collides", "load_committed_pairs", "write_committed_pairs",
]

VOCAB_SIZE = 49152  # SmolLM2's tokenizer
BLOCK_SIZE = 16
PAIRS_PATH = Path(__file__).with_name("collision_pairs.json")
_DEMO_SECRET = bytes(32)  # the unsafe hashers ignore their secret: that is part of the problem

Pair = tuple[tuple[int, ...], tuple[int, ...]]


def collides(name: str, a, b) -> bool:
    """True when blocks ``a`` and ``b`` differ but hasher ``name`` gives them one key."""
    hasher = make_hasher(name, _DEMO_SECRET)
    a, b = tuple(a), tuple(b)
    return a != b and hasher(None, a, (), None) == hasher(None, b, (), None)


# ------------------------------------------------------------------ poly: pure algebra


def poly_collision(tokens, j: int | None = None, vocab_size: int = VOCAB_SIZE) -> tuple[int, ...]:
    """Return a different block with the same ``poly`` hash as ``tokens``.

    ``t[j] += 31; t[j+1] -= 1`` changes ``sum(t_i * 31**i)`` by ``31*31**i - 31**(i+1) = 0``.
    When that would leave the vocabulary the mirror move ``t[j] -= 31; t[j+1] += 1`` is
    used.  ``j=None`` picks the first position where one of the two fits.

    Raises:
        ValueError: no twin at ``j`` stays inside ``[0, vocab_size)`` (e.g. ``t[j] < 31``
            and ``t[j+1] == 0``), or ``j`` is out of range.
    """
    t = list(tokens)
    positions = range(len(t) - 1) if j is None else [j]
    for k in positions:
        if not 0 <= k < len(t) - 1:
            raise ValueError(f"j={k} must be in [0, {len(t) - 2}] for a block of {len(t)} tokens")
        for step in (1, -1):
            hi, lo = t[k] + 31 * step, t[k + 1] - step
            if 0 <= hi < vocab_size and 0 <= lo < vocab_size:
                t[k], t[k + 1] = hi, lo
                return tuple(t)
    raise ValueError(f"no in-vocabulary poly twin of {tuple(tokens)} at j={j}")


# ---------------------------------------------------------- trunc32: birthday search


def search_trunc32_collision(n_samples: int = 2**17, seed: int = 0, vocab_size: int = VOCAB_SIZE,
                             block_size: int = BLOCK_SIZE) -> Pair | None:
    """Birthday search: hash random blocks until two share a 4-byte key.

    With ``n`` samples the expected number of colliding pairs is about ``n**2 / 2**33``:
    ~0.5 at 2**16, ~2 at 2**17.  Returns the first pair found, or ``None``.
    """
    hasher, rng, seen = make_hasher("trunc32", _DEMO_SECRET), random.Random(seed), {}
    for _ in range(n_samples):
        block = tuple(rng.randrange(vocab_size) for _ in range(block_size))
        other = seen.setdefault(hasher(None, block, (), None), block)
        if other != block:
            return other, block
    return None


# ------------------------------------------------------ builtin: CPython's tuple hash

# CPython 3.11 Objects/tupleobject.c, 64-bit build (xxHash's primes and rotation):
#   acc = P5; for lane in hash(items): acc = rotl(acc + lane*P2, 31) * P1
#   acc += len ^ (P5 ^ 3527539); -1 is mapped to 1546275796
_P1, _P2, _P5 = 11400714785074694791, 14029467366897019727, 2870177450012600261
_M64 = (1 << 64) - 1
_LEN_MANGLE = _P5 ^ 3527539


def _round_int(acc: int, lane: int) -> int:
    acc = (acc + lane * _P2) & _M64
    return (((acc << 31) | (acc >> 33)) & _M64) * _P1 & _M64


def tuple_hash_np(lanes):
    """numpy reimplementation of ``hash(tuple)``, one row per tuple.

    ``lanes`` is an ``[n, length]`` array of the items' own hashes as uint64 (for ints in
    ``[0, 2**61 - 1)``, the int itself).  Returns int64, equal to Python's ``hash()``.
    """
    import numpy as np

    lanes = np.asarray(lanes, dtype=np.uint64)
    acc = np.full(lanes.shape[0], _P5, dtype=np.uint64)
    for col in lanes.T:  # numpy array arithmetic wraps mod 2**64, like C's Py_uhash_t
        acc = acc + col * np.uint64(_P2)
        acc = (acc << np.uint64(31)) | (acc >> np.uint64(33))
        acc = acc * np.uint64(_P1)
    acc = acc + np.uint64(lanes.shape[1] ^ _LEN_MANGLE)
    acc[acc == np.uint64(_M64)] = np.uint64(1546275796)
    return acc.view(np.int64)


def _prefix_chunk(seed: int, chunk: int, size: int, n_tok: int):
    # Counter-style randomness: chunk c always gets the same raw words, so a winning
    # prefix can be regenerated from its index instead of storing 15 tokens per sample.
    import numpy as np

    return np.random.default_rng([seed, chunk]).bit_generator.random_raw(((n_tok + 3) // 4, size))


def _token(raw_words, k: int, vocab_size: int):
    # 16 random bits per token, scaled into the vocabulary by multiply-shift.
    return ((raw_words[k // 4] >> (16 * (k % 4))) & 0xFFFF) * vocab_size >> 16


def search_builtin_collision(n_prefixes: int = 2**25, seed: int = 0, vocab_size: int = VOCAB_SIZE,
                             block_size: int = BLOCK_SIZE, chunk: int = 2**18) -> Pair | None:
    """Find two in-vocabulary blocks whose ``builtin`` keys collide (a few seconds).

    ``BuiltinHasher`` hashes the tuple ``(0, 0, t_1, ..., t_16)`` here.  Every round of the
    tuple hash is invertible, so the final hashes are equal iff the states just before the
    last rotation are: ``acc15 + t16*P2 == acc15' + t16'*P2 (mod 2**64)``.  Multiplying by
    ``P2**-1`` turns this into ``u - u' == t16' - t16`` with ``u = acc15 * P2**-1``: we need
    two prefixes whose ``u`` values are less than ``vocab_size`` apart, then set
    ``t16 = 0`` and ``t16' = u - u'``.  Sorting ``n`` random ``u`` values and scanning
    adjacent gaps finds such a pair once ``n**2 * vocab_size`` approaches ``2**64``
    (``n ~ 2e7``; the default ``2**25`` expects ~3 pairs).  Returns ``None`` if unlucky.
    """
    import numpy as np

    n_tok = block_size - 1
    acc0 = _round_int(_round_int(_P5, 0), 0)  # the (parent=None, tenant=None) lanes
    p1, p2, p2inv = np.uint64(_P1), np.uint64(_P2), np.uint64(pow(_P2, -1, 1 << 64))
    s31, s33, mask16, vocab = np.uint64(31), np.uint64(33), np.uint64(0xFFFF), np.uint64(vocab_size)
    n_chunks = -(-n_prefixes // chunk)
    u = np.empty(n_chunks * chunk, dtype=np.uint64)
    lane, tmp = np.empty(chunk, dtype=np.uint64), np.empty(chunk, dtype=np.uint64)
    for c in range(n_chunks):
        raw = _prefix_chunk(seed, c, chunk, n_tok)
        acc = np.full(chunk, acc0, dtype=np.uint64)
        for k in range(n_tok):  # in-place ops: this loop is the whole cost of the search
            np.right_shift(raw[k // 4], np.uint64(16 * (k % 4)), out=lane)
            lane &= mask16
            lane *= vocab
            lane >>= np.uint64(16)
            lane *= p2
            acc += lane
            np.left_shift(acc, s31, out=tmp)
            acc >>= s33
            acc |= tmp
            acc *= p1
        acc *= p2inv
        u[c * chunk:(c + 1) * chunk] = acc

    s = np.sort(u)
    gaps = np.diff(s)
    for i in np.flatnonzero(gaps < vocab):
        lo, hi = s[i], s[i + 1]
        idx_hi = np.flatnonzero(u == hi)
        idx_lo = np.flatnonzero(u == lo)
        if lo == hi:  # equal states: two different prefixes with any equal last token
            idx_hi, idx_lo = idx_hi[:1], idx_hi[1:2]
        a = _regenerate(int(idx_hi[0]), seed, chunk, n_tok, vocab_size) + (0,)
        b = _regenerate(int(idx_lo[0]), seed, chunk, n_tok, vocab_size) + (int(hi - lo),)
        if collides("builtin", a, b):
            return a, b
    return None


def _regenerate(index: int, seed: int, chunk: int, n_tok: int, vocab_size: int) -> tuple[int, ...]:
    raw = _prefix_chunk(seed, index // chunk, chunk, n_tok)[:, index % chunk]
    words = [int(w) for w in raw]
    return tuple(_token(words, k, vocab_size) for k in range(n_tok))


# ---------------------------------------------------------------- committed pairs


def load_committed_pairs(path: Path | str = PAIRS_PATH) -> dict[str, Pair]:
    """Return ``{hash name: (block_a, block_b)}`` from ``collision_pairs.json``."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    return {name: (tuple(p["a"]), tuple(p["b"])) for name, p in data["pairs"].items()}


def write_committed_pairs(path: Path | str = PAIRS_PATH, seed: int = 0) -> dict[str, Pair]:
    """Re-run every search and (over)write the JSON file; returns the pairs."""
    rng = random.Random(seed)
    block = tuple(rng.randrange(VOCAB_SIZE) for _ in range(BLOCK_SIZE))
    found = {
        "poly": ((block, poly_collision(block, 0)), "algebraic twin: t[0] += 31, t[1] -= 1", {"seed": seed}),
        "trunc32": (search_trunc32_collision(seed=seed), "birthday search over random blocks",
                    {"seed": seed, "n_samples": 2**17}),
        "builtin": (search_builtin_collision(seed=seed), "hash((0, 0, *block)): sorted-gap search "
                    "over u = acc15 * P2^-1, then the last token closes the gap", {"seed": seed, "n_prefixes": 2**25}),
    }
    pairs = {}
    for name, (pair, note, params) in found.items():
        if pair is None or not collides(name, *pair):
            raise RuntimeError(f"the {name} search found no collision with seed={seed}")
        pairs[name] = {"hash": name, "a": list(pair[0]), "b": list(pair[1]), "note": note, "search": params}
    doc = {"vocab_size": VOCAB_SIZE, "block_size": BLOCK_SIZE,
           "setting": "parent=None, tenant_key=None, extra=()", "pairs": pairs}
    text = json.dumps(doc, indent=1)
    # One line per token list keeps the file readable and diffs small.
    text = re.sub(r"\[([\d\s,]+)\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]", text)
    Path(path).write_text(text + "\n", encoding="utf-8")
    return {name: (tuple(p["a"]), tuple(p["b"])) for name, p in pairs.items()}


if __name__ == "__main__":  # python -m minikv.attacks.collisions
    import time

    start = time.perf_counter()
    for name, (a, b) in write_committed_pairs().items():
        print(f"{name:8s} {a}\n{'':8s} {b}")
    print(f"wrote {PAIRS_PATH} in {time.perf_counter() - start:.1f} s")
