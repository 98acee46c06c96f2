"""Grader for exercise 2: tenant keys (2a), a keyed hasher (2b) and the chain plumbing (2c).

A chained hash stops *accidental* sharing; a tenant key stops *deliberate* probing, but only if
(a) nobody can compute a tenant's key without the engine secret, and (b) the key reaches every
private block.  (b) is where engines fail: a key in the first block only seems enough, since
chaining carries it down -- until an unkeyed public system prompt starts the chain.  Each check
tests the contract on direct calls, then installs the code in an engine (the workload of
:mod:`.hashing`) and compares with minikv's ``hmac-sha256``.
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import unicodedata

from ..engine.block_manager import BlockManager
from ..engine.sequence import Sequence
from ..security.encoding import encode_fields as ref_encode_fields
from ..security.hashing import BLOCK_LABEL, make_hasher
from ..security.keys import SHARED_LABEL, TENANT_LABEL
from ..security.keys import derive_tenant_key as ref_derive_tenant_key
from ._report import CheckFailed, call_safely, expect, grader
from .hashing import (KEY_A, KEY_B, check_block_hash_properties, engine_stage_block_keys, engine_stage_hasher,
                      engine_stage_key_derivation, tenant_name)

SECRET_A = bytes(range(32))
SECRET_B = bytes(range(1, 33))


# --------------------------------------------------------------------------- 2a tenant keys

def _adhoc(secret: bytes, message: bytes) -> dict[bytes, str]:
    """Keyed hashes that are NOT HMAC, built the way people improvise them."""
    return {hashlib.sha256(secret + message).digest(): "sha256(secret || message)",
            hashlib.sha256(message + secret).digest(): "sha256(message || secret)",
            hashlib.sha256(secret + b"|" + message).digest(): "sha256(secret | message)"}


#: tenant names that real encodings have confused: None vs "None" vs "", case, spaces, separators,
#: and two Unicode forms of one visible name (NFC "é" vs NFD "e" + combining accent) -- different
#: identities to the auth layer, so different tenants here.
TENANTS = ["alice", "bob", "", None, "None", "alice ", "Alice", "a", "lice", "a|b", "a", "caf\u00e9", "cafe\u0301",
           "caf", "\u00c5ngstr\u00f6m", "A\u030angstro\u0308m"]


def _collision_class(a, b) -> str:
    if None in (a, b) and ({a, b} & {"None", ""}):
        return f"two different tenants map to the same key: {tenant_name(a)} and {tenant_name(b)} (bug class: " \
               "untyped tenant encoding -- None, '' and 'None' are three tenants)"
    if isinstance(a, str) and isinstance(b, str) and unicodedata.normalize("NFC", a) == unicodedata.normalize("NFC", b):
        return f"two different tenants map to the same key: {a!r} and {b!r}, two Unicode forms (bug class: " \
               "normalising or lossy-encoding tenant names -- the auth layer's ids are opaque)"
    if isinstance(a, str) and isinstance(b, str) and a.encode("ascii", "ignore") == b.encode("ascii", "ignore"):
        return f"two different tenants map to the same key: {a!r} and {b!r} (bug class: lossy encoding of names " \
               "-- non-ASCII characters dropped)"
    return f"two different tenants map to the same key: {tenant_name(a)} and {tenant_name(b)}"


def check_hmac_keyed_by_secret(derive_tenant_key) -> None:
    """HMAC-SHA256 by behaviour, whatever layout the learner gave the labelled message: HMAC zero-pads a
    key shorter than SHA-256's 64-byte block and hashes a longer one first (RFC 2104), so a secret and
    the same secret plus a zero byte, or a long secret and its SHA-256, give the same key.  A keyed hash
    built any other way (the secret inside a plain hash's message) tells them apart."""
    long_secret = bytes(range(100))
    for t in ("alice", None):
        same = {"a secret and the same secret followed by a zero byte":
                (derive_tenant_key(SECRET_A, t), derive_tenant_key(SECRET_A + b"\x00", t)),
                "a 100-byte secret and its SHA-256":
                (derive_tenant_key(long_secret, t), derive_tenant_key(hashlib.sha256(long_secret).digest(), t))}
        for what, (a, b) in same.items():
            expect(a == b, f"the key of {tenant_name(t)} is not HMAC-SHA256 keyed by the engine secret: {what} gave "
                   "different keys, which HMAC's key schedule never does (bug class: not HMAC -- a keyed hash built "
                   "some other way, e.g. a plain hash over a message that contains the secret)",
                   "which construction does the contract name, and what are its key and its message?  Lesson 07's "
                   "section 4 and the glossary's HMAC entry describe it; the standard library has it.")


@grader("a tenant key only the server can compute: keyed with the engine secret by a real MAC, distinct for every "
        "tenant name.")
def check_tenant_key_derivation(derive_tenant_key, encode_fields=None) -> str:
    """Exercise 2a: a server-side PRF of (secret, tenant); then used by a real engine.  With
    ``encode_fields`` (the learner's 1a), the construction itself is checked: an HMAC, not an
    improvised keyed hash."""
    tenants = list(dict.fromkeys(TENANTS))
    k = derive_tenant_key(SECRET_A, "alice")
    expect(isinstance(k, bytes), f"derive_tenant_key returned {type(k).__name__}, expected bytes")
    expect(len(k) >= 16, f"the key has {len(k)} bytes; an HMAC-SHA256 key has 32", "return the full HMAC digest.")
    expect(derive_tenant_key(SECRET_A, "alice") == k, "two calls for the same tenant gave different keys",
           "derive the key deterministically from (secret, tenant), or the tenant never hits its own cache.")
    keys = {t: derive_tenant_key(SECRET_A, t) for t in tenants}
    for a, b in itertools.combinations(tenants, 2):
        expect(keys[a] != keys[b], _collision_class(a, b),
               "encode the tenant name exactly, typed, before the MAC: no str(), no `or ''`, no normalisation.")
    for t in ("alice", None):
        expect(derive_tenant_key(SECRET_B, t) != keys[t],
               f"two different engine secrets gave tenant {tenant_name(t)} the same key: anyone who knows the "
               "tenant's name can compute it", "which input of your construction carries the engine secret, and "
               "could someone who knows only the tenant's name compute the result?")
    for t, key in keys.items():
        expect(SECRET_A not in key and key not in SECRET_A,
               f"the key of tenant {tenant_name(t)} contains the engine secret (or is part of it)",
               "never put the secret itself into a key: run it through HMAC.")
    for t in ("alice", None):
        improvised = {}
        for enc in {encode_fields or ref_encode_fields, ref_encode_fields}:
            improvised.update(_adhoc(SECRET_A, enc(TENANT_LABEL, t)))
        expect(keys[t] not in improvised, f"the key of {tenant_name(t)} is {improvised.get(keys[t])}: an improvised "
               "keyed hash, not HMAC (bug class: ad-hoc keyed hash)", "plain SHA-256 over secret-and-message is open "
               "to length extension and has no proof as a PRF; HMAC is the construction built for this.")
    for bad, exc_type, what in ((b"short", ValueError, "a 5-byte secret"), (b"", ValueError, "an empty secret"),
                                ("x" * 32, TypeError, "a str secret")):
        _, exc = call_safely(derive_tenant_key, bad, "alice")
        expect(isinstance(exc, exc_type), f"derive_tenant_key accepted {what} "
               f"({'no error' if exc is None else type(exc).__name__}); expected {exc_type.__name__}",
               "reject secrets that are not bytes (TypeError) or shorter than 16 bytes (ValueError): "
               "a short secret can be brute-forced, and then every tenant key with it.")
    check_hmac_keyed_by_secret(derive_tenant_key)
    # Compare with the reference derivation: equal exactly when the reference keys are equal.
    grid = [(s, t) for s in (SECRET_A, SECRET_B) for t in tenants]
    for (s1, t1), (s2, t2) in itertools.combinations(grid, 2):
        same_ref = ref_derive_tenant_key(s1, t1) == ref_derive_tenant_key(s2, t2)
        expect((derive_tenant_key(s1, t1) == derive_tenant_key(s2, t2)) == same_ref,
               f"keys for {tenant_name(t1)} and {tenant_name(t2)} compare differently from the reference")
    engine_stage_key_derivation(derive_tenant_key)
    return (f"{len(tenants)} tenants x 2 secrets give distinct 32-byte keys; short secrets rejected; "
            f"the engine with your keys isolates tenants both ways")


# --------------------------------------------------------------------------- 2b keyed hasher

def check_domain_marker(h, encode_fields=None) -> None:
    """A tenant block and a shared block may never share a key, even if the tenant key were the shared
    key: the message says which kind of domain the block is in.  Without that marker the two messages
    are equal and only the HMAC key tells them apart, so a tenant block keyed with the shared key IS the
    shared block.  The shared key is the learner's: any bytes the hasher holds, or the key derived from
    the secret and ``SHARED_LABEL`` in the usual layouts."""
    candidates = [bytes(v) for v in getattr(h, "__dict__", {}).values() if isinstance(v, (bytes, bytearray))]
    for enc in {encode_fields or ref_encode_fields, ref_encode_fields}:
        candidates.append(hmac.digest(SECRET_A, enc(SHARED_LABEL), "sha256"))
    candidates.append(hmac.digest(SECRET_A, SHARED_LABEL.encode(), "sha256"))
    for key in candidates:
        for parent in (None, b"\x07" * 32):
            expect(h(parent, (1, 2, 3, 4), (), key) != h(parent, (1, 2, 3, 4), (), None),
                   "a tenant block whose key equals the shared key gets the same block key as the shared block: the "
                   "hashed message does not say which kind of domain the block is in (bug class: no domain marker)",
                   "the contract asks the message to say whether the block is a tenant's or shared, so the two kinds "
                   "can never share a key whatever their HMAC keys are.")


@grader("a real MAC keyed with the tenant key, in EVERY block; shared blocks keyed from the secret too.")
def check_tenant_keyed_hasher(hasher_cls, encode_fields=None) -> str:
    """Exercise 2b: a keyed BlockHasher; the key must enter every block (shared prefixes!)."""
    _, exc = call_safely(hasher_cls, b"short")
    expect(isinstance(exc, ValueError), "TenantKeyedHasher(b'short') did not raise ValueError",
           "refuse engine secrets shorter than 16 bytes.")
    h = hasher_cls(SECRET_A)
    for parent in (None, b"\x07" * 32):
        got = h(parent, (1, 2, 3, 4), (), KEY_A)
        improvised = {}
        for enc in {encode_fields or ref_encode_fields, ref_encode_fields}:
            for message in (enc(BLOCK_LABEL, parent, (1, 2, 3, 4), (), True), enc(parent, (1, 2, 3, 4), ()),
                            enc(BLOCK_LABEL, parent, (1, 2, 3, 4), ())):
                improvised.update(_adhoc(KEY_A, message))
        expect(got not in improvised, f"the block key is {improvised.get(got)} keyed with the tenant key: an "
               "improvised keyed hash, not HMAC (bug class: ad-hoc keyed hash)",
               "sha256(key || message) is open to length extension: anyone holding one block key can compute "
               "keys of longer messages.  Use HMAC.")
    check_block_hash_properties(h, "TenantKeyedHasher(secret)")
    expect(hasher_cls(SECRET_A)(None, (1, 2), (), KEY_A) == h(None, (1, 2), (), KEY_A),
           "two hashers built from the same secret disagree", "no randomness: keys must survive a restart.")
    expect(h(None, (1, 2, 3, 4), (), KEY_A) != h(None, (1, 2, 3, 4), (), KEY_B),
           "two tenant keys gave the same key for the first block: the tenant key never reaches the hash",
           "key the HMAC with tenant_key.")
    parent = b"\x07" * 32
    expect(h(parent, (1, 2, 3, 4), (), KEY_A) != h(parent, (1, 2, 3, 4), (), KEY_B),
           "with a parent, two tenant keys gave the same key: the tenant key only enters the first block",
           "key every block.  Chaining carries a first-block key down the chain only while every parent is "
           "keyed: after an operator-declared public prefix (unkeyed blocks) or with chain_hashes=False, "
           "the private blocks that follow would be shared across tenants.")
    expect(h(parent, (1, 2, 3, 4), (), None) != h(parent, (1, 2, 3, 4), (), KEY_A),
           "a shared block (tenant_key=None) and a tenant block got the same key",
           "what in your message, or in your key, tells a tenant block from a shared block with the same parent "
           "and tokens?")
    expect(hasher_cls(SECRET_B)(None, (1, 2, 3, 4), (), None) != h(None, (1, 2, 3, 4), (), None),
           "shared blocks (tenant_key=None) get the same key under two different engine secrets: they are not "
           "keyed, so anyone can compute them", "blocks without a tenant key need a key too: from what can it come "
           "that no client knows?")
    check_domain_marker(h, encode_fields)
    cached, log = engine_stage_hasher(h, "hmac-sha256")
    return (f"keyed in every block; with a public system prompt the engine shares exactly its "
            f"{len(log.public)} public block hits and no private block ({sum(cached)} cached tokens, as hmac-sha256)")


# --------------------------------------------------------------------------- 2c plumbing

def _engine_keys(hasher, token_ids, block_size, tenant_key, public_len) -> list[bytes]:
    """What the engine's BlockManager computes for these tokens (the reference)."""
    bm = BlockManager(1, block_size, hasher=hasher, enable_caching=True)
    seq = Sequence("grade", list(token_ids), None, tenant_key=tenant_key)
    seq.public_len = public_len
    return [bm.prefix_cache.block_hash(seq, i) for i in range(len(token_ids) // block_size)]


@grader("chain every full block onto the previous key; the tenant key goes into every block after the public "
        "prefix.")
def check_block_keys(block_keys) -> str:
    """Exercise 2c: the chain plumbing equals the engine's, then isolates inside the engine."""
    hasher = make_hasher("hmac-sha256", SECRET_A)
    tokens = list(range(50, 63))  # 13 tokens: 3 full blocks of 4 and a partial one
    cases = [(n, bs, key, pub) for n in (0, 3, 4, 8, 13) for bs in (4,) for key in (KEY_A, None)
             for pub in (0, 4, 6, 8, 100)] + [(13, 2, KEY_A, 5), (13, 16, KEY_A, 0)]
    for n, bs, key, pub in cases:
        ids = tokens[:n]
        got = list(block_keys(hasher, ids, bs, key, pub))
        want = _engine_keys(hasher, ids, bs, key, pub)
        where = f"{n} tokens, block size {bs}, tenant_key={'KEY' if key else None}, public_len={pub}"
        expect(len(got) == len(want), f"{len(got)} keys for {where}; the engine has {len(want)} full blocks",
               "one key per FULL block: len(token_ids) // block_size of them; a partial block has no key.")
        for i, (g, w) in enumerate(zip(got, want)):
            if g == w:
                continue
            parent = want[i - 1] if i else None
            block = tuple(ids[i * bs:(i + 1) * bs])
            public = (i + 1) * bs <= pub
            straddles = i * bs < pub < (i + 1) * bs
            diag = {
                hasher(parent, block, (), None): ("block {i} was hashed without the tenant key (bug class: "
                                                  + ("a block that straddles the end of the public prefix treated "
                                                     "as public)" if straddles else
                                                     "tenant key missing from a private block)"),
                                                  "pass tenant_key to every block after the public prefix (not only "
                                                  "the last, not never): unkeyed blocks are shared across tenants."),
                hasher(parent, block, (), key): ("block {i} lies inside the public prefix but was hashed with the "
                                                 "tenant key", "blocks entirely inside public_len get tenant_key=None."),
                hasher(None, block, (), None if public else key): ("block {i} was hashed without its parent "
                                                                   "(bug class: unchained keys)",
                                                                   "chain: parent = the previous block's key."),
            }
            what, hint = diag.get(g, ("block {i}'s key differs from the engine's", ""))
            raise CheckFailed(f"{what.format(i=i)} ({where})", hint)
    engine_stage_block_keys(block_keys)
    return (f"{len(cases)} prompts give the engine's exact keys; installed in the engine, tenants share only "
            f"the public prefix")
