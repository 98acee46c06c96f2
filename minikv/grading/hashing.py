"""Graders for exercise 1 (1a ``check_encode_fields``, 1b ``check_chained_hash``), and the
engine run that every hashing grader of exercises 1 and 2 ends with.

A block's cache key stands for "this exact prefix, for this tenant".  That holds only if the
bytes hashed are an injective encoding of (parent, tokens, extra, tenant_key): SHA-256 cannot
tell apart inputs that were already equal before hashing.  So the checks attack the encoding
with :data:`TRICKY_FIELDS` / :data:`TRICKY_BLOCKS` -- moved boundaries, digits run together,
``None`` vs empty, types confused -- each a pair that real engines have collided on.

Direct calls can prove a hasher is injective, but only an engine shows whether the cache it
drives isolates tenants.  So every hashing grader ends by installing the learner's code in a
real engine, running :data:`WORKLOAD` (a public system prompt, private documents, the anonymous
tenant, the tenant named ``''``, blocks moved to the front of a prompt) and comparing what was
cached with minikv's own reference (``sha256``, ``hmac-sha256``) on exactly the same requests --
in *both* directions: no cross-tenant hit, and the same-tenant hits a working cache must have.

Engine runs use ``verify_hits=False``: the engine's hit verification is a second wall that
would hide a hasher bug, and these checks test the first wall alone.  Tests call the
``engine_stage_*`` functions on their own to prove the engine run catches each mutant by itself.
"""
from __future__ import annotations

import functools
import hashlib
import itertools

from ..security.encoding import encode_fields as ref_encode_fields
from ..security.hashing import BLOCK_DOMAIN
from ._report import CheckFailed, call_safely, expect, grader, single_thread
from .engines import ENGINE_SECRET, GREEDY, HitLog, tiny_llm, use_block_keys, use_key_derivation

SYSTEM = list(range(40, 50))   # 10 tokens: blocks 0-1 public, block 2 straddles the prefix end
DOC = list(range(60, 72))      # 12 tokens of a tenant's private document
LEAD = [80, 81, 82, 83]        # one block ...
MOVED = list(range(90, 98))    # ... and two blocks that later start a prompt (contamination test)


def _q(i: int) -> list[int]:
    return [120 + 3 * i, 121 + 3 * i, 122 + 3 * i]


#: (tenant, prompt) run one after another; see the comments for what a correct engine does.
WORKLOAD = [
    ("alice", SYSTEM + DOC + _q(0)),   # first request: nothing cached
    ("alice", SYSTEM + DOC + _q(1)),   # same tenant, same prefix: 5 full blocks hit (20 tokens)
    ("bob", SYSTEM + DOC + _q(2)),     # another tenant: only the 2 public blocks (8 tokens)
    (None, SYSTEM + DOC + _q(3)),      # the anonymous tenant: only the public blocks
    ("carol", LEAD + MOVED + _q(4)),   # carol: a lead block, then two blocks ...
    ("carol", MOVED + _q(7)),          # ... sent again at the start: chained keys must miss
    ("", SYSTEM + DOC + _q(5)),        # tenant "" is not the anonymous tenant: public blocks only
    ("bob", SYSTEM + DOC + _q(6)),     # bob again: his own blocks hit
]


def tenant_name(t) -> str:
    return "None (anonymous)" if t is None else ("'' (empty name)" if t == "" else repr(t))


def run_workload(llm, workload=WORKLOAD) -> tuple[list[int], HitLog]:
    """Cached-token count of every request of ``workload``, and the hit log."""
    log = HitLog(llm.engine)
    cached = [llm.generate([prompt], GREEDY, tenant=tenant)[0].num_cached_tokens for tenant, prompt in workload]
    return cached, log


def compare_with_reference(cached: list[int], log: HitLog, ref_cached: list[int], hint: str,
                           workload=WORKLOAD) -> None:
    """Both directions: no cross-tenant hit, same-tenant hits happen, and every request's
    cached-token count equals the reference engine's."""
    if log.cross:
        who = sorted({(h[0], h[1]) for h in log.cross}, key=str)
        pairs = ", ".join(f"{tenant_name(a)} hit {tenant_name(b)}'s private block" for a, b in who)
        raise CheckFailed(f"cross-tenant cache hits in the engine: {pairs} ({len(log.cross)} block hits)", hint)
    expect(log.same, "no request ever hit its own tenant's cache: isolation that never hits is not isolation, "
           "it is a cache that does not work", hint)
    for i, ((tenant, prompt), got, want) in enumerate(zip(workload, cached, list(ref_cached))):
        expect(got == want,
               f"request {i + 1} ({tenant_name(tenant)}, {len(prompt)} tokens) had {got} cached tokens, "
               f"the reference engine {want}", hint)


# --------------------------------------------------------------------------- engine stages
# Each runs the learner's code inside a real engine on WORKLOAD and raises CheckFailed on any
# difference from the engine's reference.  The graders call them after the direct-call checks;
# tests call them alone to prove the engine run catches each mutant by itself.

def _engine(**kwargs):
    return tiny_llm(enable_prefix_caching=True, verify_hits=False, shared_prefixes=[SYSTEM],
                    engine_secret=ENGINE_SECRET, **kwargs)


@functools.lru_cache(maxsize=None)
def reference_cached(hash_algo: str = "sha256") -> tuple[int, ...]:
    """Cached tokens per WORKLOAD request on minikv's own engine (deterministic, so computed once)."""
    with single_thread():
        return tuple(run_workload(_engine(hash_algo=hash_algo))[0])


@single_thread()
def engine_stage_hasher(hasher, reference_algo: str) -> tuple[list[int], HitLog]:
    """``LLM(block_hasher=hasher)`` must cache exactly what ``hash_algo=reference_algo`` caches."""
    cached, log = run_workload(_engine(block_hasher=hasher))
    ref_cached = reference_cached(reference_algo)
    compare_with_reference(cached, log, ref_cached,
                           "a hit needs the same parent, tokens, extra and tenant key, and the tenant key must enter "
                           "every block: bob may hit only the public system-prompt blocks, and blocks sent again at "
                           "the start of a prompt must miss (their parent differs).")
    return cached, log


@single_thread()
def engine_stage_key_derivation(derive_tenant_key) -> tuple[list[int], HitLog]:
    """An engine deriving tenant keys with the learner's function must cache what minikv's does."""
    cached, log = run_workload(use_key_derivation(_engine(), derive_tenant_key, ENGINE_SECRET))
    ref_cached = reference_cached("sha256")
    compare_with_reference(cached, log, ref_cached,
                           "every tenant (including None and '') needs its own key, derived from the secret.")
    return cached, log


@single_thread()
def engine_stage_block_keys(block_keys) -> tuple[list[int], HitLog]:
    """An engine computing its chains with the learner's ``block_keys`` must cache what minikv's does."""
    cached, log = run_workload(use_block_keys(_engine(hash_algo="hmac-sha256"), block_keys))
    ref_cached = reference_cached("hmac-sha256")
    compare_with_reference(cached, log, ref_cached, "the tenant key must reach every private block's key.")
    return cached, log


# =========================================================================== exercise 1

KEY_A, KEY_B = b"A" * 32, b"B" * 32

#: (fields_a, fields_b, why they must differ)
TRICKY_FIELDS = [
    (("a|b",), ("a", "b"), "a name containing the separator: joining fields with '|' makes 'a|b' two fields"),
    (("a|str:b",), ("a", "b"), "a name containing the separator AND a type prefix: 'str:a|str:b' either way"),
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
    ((True,), (1,), "True vs 1 (bug class: bool encoded like int -- a flag and a number are different keys, "
     "though bool is a subclass of int)"),
    ((False,), (0,), "False vs 0 (bug class: bool encoded like int)"),
    (((1, True),), ((1, 1),), "True vs 1 inside a sequence (bug class: bool encoded like int)"),
    (("caf\u00e9",), ("caf",), "'café' vs 'caf' (bug class: lossy text encoding -- a character was dropped)"),
    (("\u00e9",), ("?",), "'é' vs '?' (bug class: lossy text encoding -- a character was replaced)"),
    (("\u00e9",), ("\u00e8",), "'é' vs 'è' (bug class: lossy text encoding -- two characters became one)"),
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
               "encode text so that every character survives: errors='ignore' or 'replace', or a codec that "
               "cannot represent a character, merges different names." if "lossy" in why else
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
    expect(len(h0) == 32, f"{label} returned {len(h0)} bytes; the contract is the full 32-byte SHA-256 digest, never "
           "truncated (bug class: truncated key)", "how many bytes does a birthday search need to try before two "
           "keys of n bytes collide?  Return the whole digest.")
    expect(hasher(*base) == h0, f"{label} gave two different keys for the same block",
           "keys must be deterministic, or a prefix never hits its own cache.")
    variants = {
        "parent": (b"\x01" * 32, (1, 2, 3, 4), (), None),
        "tokens": (None, (1, 2, 3, 5), (), None),
        "extra": (None, (1, 2, 3, 4), ("lora-a",), None),
        "tenant_key": (None, (1, 2, 3, 4), (), KEY_A),
    }
    for field, args in variants.items():
        bug = {"parent": "unchained key", "tokens": "tokens not hashed", "extra": "extra keys dropped",
               "tenant_key": "tenant key never reaches the hash"}[field]
        expect(hasher(*args) != h0, f"changing only `{field}` did not change the key (bug class: {bug})",
               f"the key must cover `{field}`" + (
                   ": chaining (the parent's key) makes a key stand for the whole prefix." if field == "parent"
                   else "."))
    expect(hasher(b"\x01" * 32, (1, 2, 3, 4), (), None) != hasher(b"\x02" * 32, (1, 2, 3, 4), (), None),
           "two different parents gave the same key for the same tokens",
           "hash the parent key into the block key (chaining).")
    for _, a, b, why in TRICKY_BLOCKS:
        expect(hasher(*a) != hasher(*b), why, "encode (parent, tokens, extra, tenant_key) with your typed, "
               "length-prefixed encode_fields before hashing.")


#: (parent, tokens) the contract refuses with TypeError, and what is wrong with them
BAD_FIELDS = [("not-a-key", (1, 2, 3, 4), "a str parent"), (7, (1, 2, 3, 4), "an int parent"),
              (None, (1, True, 3, 4), "the token True (a bool)"), (None, (1, 2.0, 3, 4), "the token 2.0 (a float)"),
              (None, (1, "2", 3, 4), "the token '2' (a str)")]


def check_refuses_bad_fields(hasher) -> None:
    """The contract's refusals: a parent that is not a key and a token that is not an int raise
    TypeError, and the message names the bad value (a caller must see what it passed)."""
    for parent, tokens, what in BAD_FIELDS:
        _, exc = call_safely(hasher, parent, tokens, (), None)
        expect(isinstance(exc, TypeError), f"chained_block_hash accepted {what} "
               f"({'returned a key' if exc is None else 'raised ' + type(exc).__name__}); the contract says "
               "TypeError (bug class: keys for values that are not block fields)",
               "a key for a value the engine never produces hides the caller's bug, and True would key like 1: "
               "check the types of parent and of every token before hashing.")
        bad = parent if isinstance(parent, (str, int)) and parent is not None else next(
            t for t in tokens if isinstance(t, bool) or not isinstance(t, int))
        expect(any(text in str(exc) for text in (repr(bad), str(bad), type(bad).__name__)),
               f"chained_block_hash raised TypeError for {what}, but its message {str(exc)!r} does not name the "
               "bad value (bug class: an error that does not say what was wrong)",
               "put the offending value (or its type) in the message.")


def check_label_first(hasher, encode_fields) -> None:
    """The contract puts ``BLOCK_DOMAIN`` at the START of the hashed message.  Where the layout is the
    learner's, only layouts recognisably built with the label elsewhere are refused."""
    for parent, tokens, extra, key in [(None, (1, 2, 3, 4), (), None), (b"p" * 32, (7, 8), ("x",), KEY_A)]:
        got = hasher(parent, tokens, extra, key)
        for enc in {encode_fields, ref_encode_fields}:
            fields = enc(parent, tuple(tokens), tuple(extra), key)
            late = {hashlib.sha256(enc(parent, tuple(tokens), tuple(extra), key, BLOCK_DOMAIN)).digest(),
                    hashlib.sha256(fields + BLOCK_DOMAIN.encode()).digest(),
                    hashlib.sha256(fields + enc(BLOCK_DOMAIN)).digest()}
            expect(got not in late, "the domain label is hashed AFTER the fields, not at the start of the message "
                   "(bug class: domain label not first)",
                   "the contract says the message starts with the label: a reader (or a second hash built on the "
                   "same fields) must know the message's purpose before any field.")


@grader("a key must stand for the whole prefix, for one domain: chained, typed, domain-separated, full digest.")
def check_chained_hash(chained_block_hash, encode_fields=None) -> str:
    """Exercise 1b: properties on direct calls, then inside a real engine against ``sha256``
    (whose hasher is this very construction: ``minikv.security.hashing.Sha256Hasher``)."""
    check_block_hash_properties(chained_block_hash, "chained_block_hash")
    if encode_fields is not None:  # domain separation, checked against the learner's own encoding
        for parent, tokens, extra, key in [(None, (1, 2, 3, 4), (), None), (b"p" * 32, (7, 8), ("x",), KEY_A)]:
            for plain in (encode_fields(parent, tokens, extra, key), encode_fields(parent, tuple(tokens), extra, key)):
                expect(chained_block_hash(parent, tokens, extra, key) != hashlib.sha256(plain).digest(),
                       "the key is the plain sha256 of the encoded fields: it is not domain-separated",
                       "could your key equal a SHA-256 that minikv computes over the same fields for another "
                       "purpose?  What in the message rules that out?  (bug class: no domain separation)")
        check_label_first(chained_block_hash, encode_fields)
    check_refuses_bad_fields(chained_block_hash)
    cached, log = engine_stage_hasher(chained_block_hash, "sha256")
    return (f"typed and chained; in the engine {len(WORKLOAD)} requests cached exactly what sha256 caches "
            f"({sum(cached)} tokens, 0 cross-tenant)")
