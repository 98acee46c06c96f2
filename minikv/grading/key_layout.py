"""Grader for exercise 2d, an open design: the key layout of a prompt with public, per-tenant and
per-user parts.

There is no single right answer to check byte for byte, so the grader checks *properties*, then
*measures*:

1. the contract on direct calls: shape, determinism, errors for bad input;
2. isolation on direct calls, the attacker's way: many identities send the *same* prompt (a
   prefix-probing attacker guesses the victim's content), and two identities may get equal keys
   for a block only where its scope allows it -- a public block for everyone, a per-tenant block
   inside one tenant; a per-user block never.  Blocks that straddle a boundary take the stricter
   scope;
3. the same inside a real engine: :func:`~.engines.use_key_layout` makes the engine take every
   block's domain key from the learner's layout, and :data:`WORKLOAD` (seeded: tenants x users x
   requests, plus attackers replaying other identities' prompts) runs through it while a listener
   watches every cache hit; a hit on a block outside the reader's scope fails the check;
4. the hit rate of that run (cached prompt tokens / prompt tokens) against the reference layout's
   on the same workload.  The reference shares everything isolation allows, so an isolating layout
   cannot beat it, and one that falls short over-keys: the check requires the reference's rate
   (to :data:`TOLERANCE`) and, when short, says which sharing the layout gave up.
"""
from __future__ import annotations

import functools
import hmac
import random

from ..engine.lifecycle import REUSES, Transition
from ..security.encoding import encode_fields as ref_encode_fields
from ..security.keys import derive_tenant_key as ref_derive_tenant_key
from ._report import CheckFailed, call_safely, expect, grader, single_thread
from .engines import BS, ENGINE_SECRET, GREEDY, tiny_llm, use_key_layout

USER_LABEL = "minikv/user-key/v1"
TOLERANCE = 0.001  # hit rates are exact fractions of one deterministic run: this only absorbs rounding


def reference_key_layout(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end):
    """The reference layout: public blocks shared (None), the tenant's key for per-tenant blocks, and
    for per-user blocks a key derived from the tenant's key and the typed user name; a block takes the
    scope of its last (strictest) token.  Validates nothing: the grader only feeds it good input."""
    tenant_key = ref_derive_tenant_key(engine_secret, tenant)
    user_key = hmac.digest(tenant_key, ref_encode_fields(USER_LABEL, user), "sha256")
    return [None if (i + 1) * block_size <= public_len else
            tenant_key if (i + 1) * block_size <= tenant_end else user_key
            for i in range(n_tokens // block_size)]


def scope(i: int, block_size: int, public_len: int, tenant_end: int) -> str:
    """Which part block ``i`` belongs to: the strictest part any of its tokens is in."""
    end = (i + 1) * block_size
    return "public" if end <= public_len else "tenant" if end <= tenant_end else "user"


def may_share(scope_: str, a: tuple, b: tuple) -> bool:
    """May identities ``a`` and ``b`` ((tenant, user) pairs) share a block of ``scope_``?"""
    return a == b or scope_ == "public" or (scope_ == "tenant" and a[0] == b[0])


def who(ident: tuple) -> str:
    tenant, user = ident
    return f"user {user!r} of tenant {tenant!r}"


# --------------------------------------------------------------------------- direct calls

def _layout(fn, ident, n, pub, end, bs=BS) -> list:
    keys, exc = call_safely(fn, ENGINE_SECRET, ident[0], ident[1], n, bs, pub, end)
    if exc is not None:
        raise CheckFailed(f"key_layout raised {type(exc).__name__}: {exc} for {who(ident)} ({n} tokens, block size "
                          f"{bs}, public_len={pub}, tenant_end={end})", "valid input must give a layout.")
    expect(isinstance(keys, (list, tuple)), f"key_layout returned {type(keys).__name__}, expected a list")
    keys = list(keys)
    expect(len(keys) == n // bs, f"{len(keys)} keys for {n} tokens at block size {bs}; there are {n // bs} full "
           "blocks", "one entry per FULL block; a trailing partial block has none.")
    for i, k in enumerate(keys):
        expect(k is None or (isinstance(k, bytes) and len(k) >= 16),
               f"block {i}'s key is {type(k).__name__} {k!r:.40}: expected None or a key of 16+ bytes",
               "a domain key is the bytes of a MAC (32 for HMAC-SHA256), or None for the shared domain.")
    return keys


#: identities that send the same prompt in the isolation check: same user names in two tenants,
#: tenants and users that typed encodings keep apart (None / '' / 'None'), and names with separators
IDENTITIES = [("acme", "alice"), ("acme", "bob"), ("globex", "alice"), ("globex", "bob"), ("acme", None),
              ("acme", ""), ("acme", "None"), (None, None), ("", None), ("None", None), ("a:b", "c"), ("a", "b:c"),
              ("a|b", "c"), ("a", "b|c")]
#: (tokens, public_len, tenant_end): boundaries inside blocks (straddling) and on block edges
SHAPES = [(35, 10, 22), (32, 8, 20), (24, 0, 12), (24, 12, 12), (24, 4, 24), (3, 0, 0), (40, 40, 40)]


def _violation_class(i, sc, a, b, pub, end) -> str:
    """The bug class behind two identities sharing block ``i`` of scope ``sc``, which they may not."""
    where = f"block {i} (per-{sc} part"
    if _straddles(i, pub, end):
        edge = "public" if i * BS < pub < (i + 1) * BS else "per-tenant"
        return (f"{where}: it straddles the end of the {edge} part) gets the same key for {who(a)} and {who(b)} "
                "(bug class: a straddling block takes the looser key -- its private tokens are shared)")
    if sc == "tenant" or (a[0] != b[0] and a[1] == b[1]):
        leak = "cross-tenant leak" if sc == "tenant" else "user key not bound to its tenant"
        return f"{where}) gets the same key for {who(a)} and {who(b)} (bug class: {leak})"
    if a[0] == b[0] and {a[1], b[1]} <= {None, "", "None"}:
        return (f"{where}) gets the same key for {who(a)} and {who(b)} (bug class: untyped user encoding -- None, '' "
                "and 'None' are three users)")
    if a[0] != b[0]:
        return (f"{where}) gets the same key for {who(a)} and {who(b)} (bug class: ambiguous encoding of (tenant, "
                "user) -- two different pairs run together into one name)")
    return f"{where}) gets the same key for {who(a)} and {who(b)} (bug class: cross-user leak)"


def _straddles(i: int, pub: int, end: int) -> bool:
    return any(i * BS < edge < (i + 1) * BS for edge in (pub, end))


def check_isolation_direct(key_layout) -> int:
    """Every identity sends the same prompt; two blocks with equal keys (at any positions) must be
    shareable by their identities at the stricter of their scopes.  Returns the blocks compared."""
    compared = 0
    for n, pub, end in SHAPES:
        by_key: dict = {}  # key -> [(block, scope, identity)]
        for ident in IDENTITIES:
            for i, k in enumerate(_layout(key_layout, ident, n, pub, end)):
                by_key.setdefault(k, []).append((i, scope(i, BS, pub, end), ident))
                compared += 1
        found = []
        for holders in by_key.values():
            for x, (i, sa, a) in enumerate(holders):
                for j, sb, b in holders[x + 1:]:
                    strict = max(sa, sb, key=_STRICT.index)
                    if not may_share(strict, a, b):
                        block = i if sa == strict else j
                        found.append((_straddles(block, pub, end), block, strict, a, b))
        if found:
            _, i, sc, a, b = min(found, key=lambda f: (f[0], f[1]))  # a plain leak is named before a straddle
            raise CheckFailed(_violation_class(i, sc, a, b, pub, end) + f" ({n} tokens, public_len={pub}, "
                              f"tenant_end={end})", _ISOLATION_HINT)
    return compared


_STRICT = ("public", "tenant", "user")
_ISOLATION_HINT = ("list, for each block, who may share it; then ask which inputs your key for that block depends "
                   "on, and whether two identities who must not share could ever feed it the same bytes.")

#: a second engine secret: every non-shared key must change with it
OTHER_SECRET = bytes(range(200, 232))

BAD_INPUT = [((None, "bob"), ValueError, "a user without a tenant (tenant=None, user='bob')"),
             ((7, "bob"), TypeError, "tenant=7 (not a str)"), (("acme", 7), TypeError, "user=7 (not a str)"),
             (("acme", b"bob"), TypeError, "user=b'bob' (bytes, not a str)")]


def check_contract(key_layout) -> None:
    """Shape, determinism and errors, before any isolation property."""
    first = _layout(key_layout, ("acme", "alice"), 35, 10, 22)
    expect(first == _layout(key_layout, ("acme", "alice"), 35, 10, 22),
           "two calls for the same user and prompt gave different keys: the user never hits its own cache",
           "derive every key deterministically from the secret and the names (no randomness, no counters).")
    other = key_layout(OTHER_SECRET, "acme", "alice", 35, BS, 10, 22)
    for i, (a, b) in enumerate(zip(first, other)):
        expect(a is None or a != b, f"block {i}'s key is the same under two different engine secrets (bug class: keys a "
               "client can compute -- a key that does not change with the engine secret is a function of names "
               "alone)", "every key that is not the shared domain (None) must come from the engine secret through a "
               "keyed MAC: your 2a already does that.")
    for (tenant, user), exc_type, what in BAD_INPUT:
        _, exc = call_safely(key_layout, ENGINE_SECRET, tenant, user, 35, BS, 10, 22)
        expect(isinstance(exc, exc_type), f"key_layout accepted {what} "
               f"({'no error' if exc is None else type(exc).__name__}); expected {exc_type.__name__}",
               "validate the identity first: a user is always a user OF a tenant, and ids are strings.")
    for args, what in (((b"short", "acme", "alice", 35, BS, 10, 22), "a 5-byte secret"),
                       ((ENGINE_SECRET, "acme", "alice", 35, BS, 22, 10), "public_len > tenant_end"),
                       ((ENGINE_SECRET, "acme", "alice", 20, BS, 10, 22), "tenant_end > n_tokens"),
                       ((ENGINE_SECRET, "acme", "alice", 35, BS, -1, 22), "public_len < 0")):
        _, exc = call_safely(key_layout, *args)
        expect(isinstance(exc, ValueError), f"key_layout accepted {what} "
               f"({'no error' if exc is None else type(exc).__name__}); expected ValueError",
               "check the secret and the part boundaries before computing anything.")
    _, exc = call_safely(key_layout, "x" * 32, "acme", "alice", 35, BS, 10, 22)
    got = "no error" if exc is None else type(exc).__name__
    expect(isinstance(exc, TypeError), f"key_layout accepted a str secret ({got}); expected TypeError",
           "a secret is bytes: your 2a already says so.")


# --------------------------------------------------------------------------- in the engine

TENANTS = ("acme", "globex", "initech")
USERS = ("alice", "bob", "carol")        # the same names in every tenant: users are per tenant
SYSTEM_LEN, DOC_LEN, PROFILE_LEN, QUESTION_LEN = 18, 14, 10, 5   # public 18 | tenant to 32 | user to 47


@functools.lru_cache(maxsize=None)
def workload(seed: int = 37) -> tuple:
    """(tenant, user, prompt, public_len, tenant_end) in order: every user of every tenant asks twice
    (shuffled), each prompt = the public system prompt + the tenant's documents + the user's profile +
    a fresh question; then five attackers replay another identity's exact prompt.  Seeded: the same
    requests on every run, so the hit rate is a fixed number."""
    rng = random.Random(seed)

    def tokens(n):  # tiny-random's byte tokens are ids 3..258
        return tuple(rng.randrange(3, 259) for _ in range(n))

    system = tokens(SYSTEM_LEN)
    docs = {t: tokens(DOC_LEN) for t in TENANTS}
    profiles = {(t, u): tokens(PROFILE_LEN) for t in TENANTS for u in USERS}
    asks = [(t, u) for t in TENANTS for u in USERS for _ in range(2)]
    rng.shuffle(asks)
    pub, end = SYSTEM_LEN, SYSTEM_LEN + DOC_LEN
    reqs = [(t, u, system + docs[t] + profiles[(t, u)] + tokens(QUESTION_LEN), pub, end) for t, u in asks]
    victim = next(r for r in reqs if r[:2] == ("acme", "alice"))[2]
    for attacker in (("acme", "bob"), ("globex", "alice"), ("initech", "carol"), ("acme", "alice"), ("acme", None)):
        reqs.append((*attacker, victim, pub, end))   # ("acme", "alice") replaying her own: a legitimate hit
    return tuple(reqs)


class ScopeLog:
    """Block-manager listener: which identity wrote each stored block and the block's scope; every
    hit on a block outside the reader's scope is a leak (writer, reader, block, scope)."""

    def __init__(self, llm, request: dict):
        self.bm, self.request = llm.engine.block_manager, request
        self.written: dict[bytes, tuple] = {}
        self.leaks: list[tuple] = []
        self.bm.listeners.append(self)

    def __call__(self, event, ids, seq) -> None:
        if seq is None or seq.request_id not in self.request.get("seen", {}):
            return
        tenant, user, pub, end = self.request["seen"][seq.request_id]
        for b in ids:
            h = self.bm.blocks[b].hash
            if event == Transition.STORE and h in seq.block_hashes:
                i = seq.block_hashes.index(h)
                self.written.setdefault(h, ((tenant, user), i, scope(i, BS, pub, end)))
            elif event in REUSES and h in self.written:
                writer, i, sc = self.written[h]
                if not may_share(sc, writer, (tenant, user)):
                    self.leaks.append((writer, (tenant, user), i, sc))


def run_in_engine(key_layout) -> tuple[list[int], list[int], ScopeLog]:
    """Run :func:`workload` on an engine keyed by ``key_layout``: (cached tokens, prompt tokens, log)."""
    request: dict = {}
    llm = use_key_layout(tiny_llm(enable_prefix_caching=True, verify_hits=False, hash_algo="hmac-sha256",
                                  engine_secret=ENGINE_SECRET, num_blocks=512), key_layout, ENGINE_SECRET, request)
    log = ScopeLog(llm, request)
    cached, sizes = [], []
    for tenant, user, prompt, pub, end in workload():
        request.update(user=user, public_len=pub, tenant_end=end)
        cached.append(llm.generate([list(prompt)], GREEDY, tenant=tenant)[0].num_cached_tokens)
        sizes.append(len(prompt))
    return cached, sizes, log


@functools.lru_cache(maxsize=None)
def reference_hit_rate() -> float:
    """The reference layout's hit rate on :func:`workload` (deterministic: computed once)."""
    with single_thread():
        cached, sizes, _ = run_in_engine(reference_key_layout)
    return sum(cached) / sum(sizes)


def _over_keying(key_layout) -> str:
    """Why an isolating layout hits less than the reference: which allowed sharing it gave up."""
    n, pub, end = 47, SYSTEM_LEN, SYSTEM_LEN + DOC_LEN
    got = {ident: _layout(key_layout, ident, n, pub, end) for ident in (("acme", "alice"), ("acme", "bob"),
                                                                        ("globex", "alice"))}
    for i in range(n // BS):
        sc = scope(i, BS, pub, end)
        if sc == "public" and got[("acme", "alice")][i] != got[("globex", "alice")][i]:
            return f"public block {i} gets a different key in each tenant (bug class: over-keying the public part)"
        if sc == "tenant" and got[("acme", "alice")][i] != got[("acme", "bob")][i]:
            return (f"per-tenant block {i} gets a different key for each user of the tenant (bug class: over-keying "
                    "the tenant part)")
    return "some block a request may share gets a key that nobody else shares (bug class: over-keying)"


@grader("design first: for every block, who may share it?  Then derive each scope's key on the server, from the "
        "engine secret, over typed fields.")
def check_key_layout(key_layout) -> str:
    """Exercise 2d: isolation both ways (direct calls, then inside the engine), then the hit rate."""
    check_contract(key_layout)
    compared = check_isolation_direct(key_layout)
    cached, sizes, log = run_in_engine(key_layout)
    if log.leaks:
        writer, reader, i, sc = log.leaks[0]
        raise CheckFailed(f"in the engine, {who(reader)} hit block {i} of {who(writer)}'s prompt, a per-{sc} block "
                          f"({len(log.leaks)} such hits)", _ISOLATION_HINT)
    rate, ref = sum(cached) / sum(sizes), reference_hit_rate()
    score = f"hit rate {rate:.3f} (reference {ref:.3f})"
    expect(rate <= ref + TOLERANCE, f"{score}: more hits than a layout that shares everything isolation allows, so "
           "some block is shared beyond its scope", _ISOLATION_HINT)
    expect(rate >= ref - TOLERANCE, f"{score}: isolated, but {_over_keying(key_layout)}",
           "isolation is half the job: a block that every user of a tenant (or everyone) may share should be "
           "keyed so that they do.  Which scopes did your layout make stricter than they need to be?")
    return (f"{compared} block keys of {len(IDENTITIES)} identities isolate by scope; {len(cached)} requests in the "
            f"engine, no hit outside its scope; {score}")
