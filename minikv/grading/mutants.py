"""Realistic wrong implementations of every exercise: each grader must reject all of them.

Every mutant is a mistake someone has made (or easily would): ``tests/test_grading.py`` proves
that each grader fails on each of its mutants, and lessons 07/08 run a few of them through the
graders to show what the checks catch.  ``MUTANTS[exercise_id]`` lists ``(name, implementation,
what is wrong)``.
"""
from __future__ import annotations

import hashlib
import hmac
import random
import struct

import numpy as np
from scipy import stats

from ..engine.sampling import SamplingParams
from ..security.encoding import encode_fields as _typed

# ============================================================================ 1a encode_fields


def encode_untyped(*fields) -> bytes:
    """Concatenation with a separator: ('a|b', 'c') and ('a', 'b|c') collide; types are lost."""
    return b"|".join(str(f).encode() for f in fields)


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


# ============================================================================ 1b chained hash

_DOMAIN = "minikv-course/block-key/v1"


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


def derive_no_secret_check(engine_secret, tenant) -> bytes:
    """Correct HMAC, but an empty or 5-byte secret is accepted (brute-forceable keys)."""
    return hmac.digest(bytes(engine_secret, "utf-8") if isinstance(engine_secret, str) else engine_secret,
                       _typed("tenant", tenant), "sha256")


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


class KeyedTruncated(_KeyedBase):
    """Correct keying, but the key is truncated to 8 bytes 'to save memory'."""

    def __call__(self, parent, tokens, extra, tenant_key):
        key = self._shared if tenant_key is None else tenant_key
        return hmac.digest(key, _typed(parent, tuple(tokens), tuple(extra), tenant_key is not None), "sha256")[:8]


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


# ============================================================================ 3a zero_blocks


def zero_k_only(pool, block_ids):
    """Forgets the values: V keeps the previous owner's data."""
    if block_ids:
        pool.k_cache[:, list(block_ids)] = 0


def zero_layer0_only(pool, block_ids):
    """Only layer 0 ('the one that inverts to tokens'); deeper layers leak too (Shadow in the Cache)."""
    if block_ids:
        pool.k_cache[0, list(block_ids)] = 0
        pool.v_cache[0, list(block_ids)] = 0


def zero_wrong_dim(pool, block_ids):
    """Indexes dim 0 (layers) instead of dim 1 (blocks): wipes whole layers of everyone's K/V."""
    ids = [b for b in block_ids if b < pool.k_cache.shape[0]]
    if ids:
        pool.k_cache[ids] = 0
        pool.v_cache[ids] = 0


def zero_out_of_place(pool, block_ids):
    """Builds a zeroed copy of the whole pool (twice the memory) and rebinds the attributes."""
    import torch
    if block_ids:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        pool.k_cache = pool.k_cache.index_fill(1, idx, 0)
        pool.v_cache = pool.v_cache.index_fill(1, idx, 0)


# ============================================================================ 3b scrubber


def _zero(pool, ids):
    import torch
    if ids:
        idx = torch.as_tensor(list(ids), dtype=torch.long, device=pool.k_cache.device)
        pool.k_cache.index_fill_(1, idx, 0)
        pool.v_cache.index_fill_(1, idx, 0)


class ScrubNothing:
    """Both hooks do nothing: recycled blocks keep the previous tenant's K/V."""

    def on_free(self, pool, block_ids):
        pass

    def on_alloc(self, pool, block_ids):
        pass


class ScrubDeferred:
    """'Batch the scrubs for efficiency': blocks given to on_alloc are queued and zeroed at the next
    on_free -- after their new owner has received them (stale data visible) and written them
    (the owner's own K/V destroyed)."""

    def __init__(self):
        self.queue: list[int] = []

    def on_free(self, pool, block_ids):
        _zero(pool, self.queue)
        self.queue = []

    def on_alloc(self, pool, block_ids):
        self.queue += list(block_ids)


class ScrubFirstBlockOnly:
    """Assumes one block per call: only block_ids[0] is zeroed."""

    def on_free(self, pool, block_ids):
        pass

    def on_alloc(self, pool, block_ids):
        _zero(pool, list(block_ids)[:1])


class ScrubOnlyK:
    """Zeroes the keys and forgets the values."""

    def on_free(self, pool, block_ids):
        pass

    def on_alloc(self, pool, block_ids):
        zero_k_only(pool, list(block_ids))


class ScrubWholePool:
    """'Just wipe everything on allocation': destroys cached prefixes and running requests' K/V."""

    def on_free(self, pool, block_ids):
        pass

    def on_alloc(self, pool, block_ids):
        pool.k_cache.zero_()
        pool.v_cache.zero_()


# ============================================================================ 4 isolation audit


def verdict_one_direction(cross, same) -> str:
    """Checks only that nobody else hit: 'pass' when nothing was ever cached."""
    return "fail" if cross > 0 else "pass"


def verdict_wrong_order(cross, same) -> str:
    """Tests 'no hit at all' first: a leak with no same-tenant hit is reported 'inconclusive'."""
    if same == 0:
        return "inconclusive"
    return "fail" if cross > 0 else "pass"


def _docs(llm, tenants, seed):
    eng = llm.engine
    rng = random.Random(seed)
    bs, vocab = eng.block_size, eng.model.shape.vocab_size
    fresh = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    return {t: fresh(3 * bs) for t in tenants}, fresh, bs


_AUDIT_PARAMS = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def _report(n, cross, same, verdict):
    from types import SimpleNamespace
    return SimpleNamespace(n_requests=n, cross_tenant_cached_tokens=cross, same_tenant_cached_tokens=same,
                           verdict=verdict)


def _good_verdict(cross, same):
    return "fail" if cross > 0 else ("inconclusive" if same == 0 else "pass")


def audit_one_direction(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """The right workload with a one-directional verdict (SGLang #23300's test)."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    cross = same = 0
    outs = llm.generate([docs[t] + fresh(bs) for t in tenants], _AUDIT_PARAMS, tenant=tenants)
    cross += sum(o.num_cached_tokens for o in outs)
    wave = [("same", t, docs[t]) for t in tenants] + [("cross", u, docs[tenants[(i + 1) % len(tenants)]])
                                                      for i, u in enumerate(tenants)]
    outs = llm.generate([d + fresh(bs) for _, _, d in wave], _AUDIT_PARAMS, tenant=[t for _, t, _ in wave])
    for (kind, _, _), o in zip(wave, outs):
        same += o.num_cached_tokens if kind == "same" else 0
        cross += o.num_cached_tokens if kind == "cross" else 0
    return _report(len(tenants) * 3, cross, same, verdict_one_direction(cross, same))


def audit_sequential(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """Right workload and verdict, but one request at a time: isolation is never tested inside a batch."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    cross = same = 0
    for t in tenants:
        cross += llm.generate([docs[t] + fresh(bs)], _AUDIT_PARAMS, tenant=t)[0].num_cached_tokens
    for i, u in enumerate(tenants):
        same += llm.generate([docs[u] + fresh(bs)], _AUDIT_PARAMS, tenant=u)[0].num_cached_tokens
        other = docs[tenants[(i + 1) % len(tenants)]]
        cross += llm.generate([other + fresh(bs)], _AUDIT_PARAMS, tenant=u)[0].num_cached_tokens
    return _report(len(tenants) * 3, cross, same, _good_verdict(cross, same))


def audit_everything_cross(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """Counts every cached token as cross-tenant: even a tenant's own re-send 'leaks'."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    prompts = [docs[t] + fresh(bs) for t in tenants]
    llm.generate(prompts, _AUDIT_PARAMS, tenant=tenants)
    wave = [(t, docs[t]) for t in tenants] + [(u, docs[tenants[(i + 1) % len(tenants)]]) for i, u in enumerate(tenants)]
    outs = llm.generate([d + fresh(bs) for _, d in wave], _AUDIT_PARAMS, tenant=[t for t, _ in wave])
    cross = sum(o.num_cached_tokens for o in outs)
    return _report(len(tenants) * 3, cross, 0, _good_verdict(cross, 0))


def audit_no_copy(llm, tenants=("alice", "bob", "carol"), doc_blocks=3, seed=0):
    """Never sends another tenant's document: every tenant only repeats its own, so a shared
    cache can never show a cross-tenant hit (the audit is blind to the leak it looks for)."""
    docs, fresh, bs = _docs(llm, list(tenants), seed)
    tenants = list(tenants)
    cross = same = 0
    outs = llm.generate([docs[t] + fresh(bs) for t in tenants], _AUDIT_PARAMS, tenant=tenants)
    cross += sum(o.num_cached_tokens for o in outs)
    outs = llm.generate([docs[t] + fresh(bs) for t in tenants], _AUDIT_PARAMS, tenant=tenants)
    same += sum(o.num_cached_tokens for o in outs)
    return _report(len(tenants) * 2, cross, same, _good_verdict(cross, same))


# ============================================================================ 5 statistics


def ks_wrong_alternative(hit, miss):
    """alternative='less': tests 'hits are SLOWER'."""
    r = stats.ks_2samp(np.asarray(hit, float), np.asarray(miss, float), alternative="less")
    return float(r.statistic), float(r.pvalue)


def ks_two_sided(hit, miss):
    """Two-sided: also 'detects' a cache when hits are slower, and halves the evidence."""
    r = stats.ks_2samp(np.asarray(hit, float), np.asarray(miss, float))
    return float(r.statistic), float(r.pvalue)


def auc_flipped(hit, miss):
    """P(hit > miss): the classifier 'larger latency => hit'."""
    h, m = np.asarray(hit, float)[:, None], np.asarray(miss, float)[None, :]
    return float(((h > m).sum() + 0.5 * (h == m).sum()) / (h.size * m.size))


def auc_ignores_ties(hit, miss):
    """Strict comparison only: ties count 0 instead of one half."""
    h, m = np.asarray(hit, float)[:, None], np.asarray(miss, float)[None, :]
    return float((h < m).sum() / (h.size * m.size))


# ============================================================================ the table

MUTANTS: dict[str, list[tuple[str, object, str]]] = {
    "1a": [("untyped", encode_untyped, encode_untyped.__doc__),
           ("no-length", encode_no_length, encode_no_length.__doc__),
           ("repr", encode_json_like, encode_json_like.__doc__)],
    "1b": [("untyped-concat", hash_untyped_concat, hash_untyped_concat.__doc__),
           ("unchained", hash_unchained, hash_unchained.__doc__),
           ("packed-no-boundaries", hash_packed_no_boundaries, hash_packed_no_boundaries.__doc__),
           ("ignores-tenant", hash_ignores_tenant, hash_ignores_tenant.__doc__)],
    "2a": [("unkeyed", derive_unkeyed, derive_unkeyed.__doc__),
           ("none-is-empty", derive_none_is_empty, derive_none_is_empty.__doc__),
           ("concat", derive_concat, derive_concat.__doc__),
           ("no-secret-check", derive_no_secret_check, derive_no_secret_check.__doc__)],
    "2b": [("salt-never-used", KeyedSaltNeverUsed, KeyedSaltNeverUsed.__doc__),
           ("first-block-only", KeyedFirstBlockOnly, KeyedFirstBlockOnly.__doc__),
           ("truncated", KeyedTruncated, KeyedTruncated.__doc__)],
    "2c": [("salt-last-block-only", keys_salt_last_block_only, keys_salt_last_block_only.__doc__),
           ("salt-never-passed", keys_salt_never_passed, keys_salt_never_passed.__doc__),
           ("straddling-block-public", keys_straddling_block_public, keys_straddling_block_public.__doc__),
           ("unchained", keys_unchained, keys_unchained.__doc__)],
    "3a": [("k-only", zero_k_only, zero_k_only.__doc__),
           ("layer0-only", zero_layer0_only, zero_layer0_only.__doc__),
           ("wrong-dim", zero_wrong_dim, zero_wrong_dim.__doc__),
           ("out-of-place", zero_out_of_place, zero_out_of_place.__doc__)],
    "3b": [("nothing", ScrubNothing, ScrubNothing.__doc__),
           ("deferred", ScrubDeferred, ScrubDeferred.__doc__),
           ("first-block-only", ScrubFirstBlockOnly, ScrubFirstBlockOnly.__doc__),
           ("k-only", ScrubOnlyK, ScrubOnlyK.__doc__),
           ("whole-pool", ScrubWholePool, ScrubWholePool.__doc__)],
    "4a": [("one-direction", verdict_one_direction, verdict_one_direction.__doc__),
           ("wrong-order", verdict_wrong_order, verdict_wrong_order.__doc__)],
    "4b": [("one-direction", audit_one_direction, audit_one_direction.__doc__),
           ("sequential", audit_sequential, audit_sequential.__doc__),
           ("everything-cross", audit_everything_cross, audit_everything_cross.__doc__),
           ("no-copy", audit_no_copy, audit_no_copy.__doc__)],
    "5a": [("wrong-alternative", ks_wrong_alternative, ks_wrong_alternative.__doc__),
           ("two-sided", ks_two_sided, ks_two_sided.__doc__)],
    "5b": [("flipped", auc_flipped, auc_flipped.__doc__),
           ("ignores-ties", auc_ignores_ties, auc_ignores_ties.__doc__)],
}
