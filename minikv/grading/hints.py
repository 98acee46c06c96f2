"""Tiered hints: ``make hint EX=2a`` prints level 1, then 2 and 3 on repeat calls.

Level 1 points at the idea, level 2 at the mechanism (names the tools, no code), level 3 -- the
only one allowed to show code -- sketches the shape of the answer.  Nothing here is the
solution: level 3 leaves the learner a line or two to think through.  The level each learner
has reached is kept per exercise in ``exercises/.hints.json`` (delete it, or pass ``--reset``,
to start over); ``--level N`` prints one level without changing it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

STATE = Path(__file__).resolve().parents[2] / "exercises" / ".hints.json"

#: exercise id -> phrases levels 1 and 2 must never contain: the rule itself, in the words the
#: old hints and the solutions' comments used (tests/test_grading_tools.py checks every hint)
FORBIDDEN_PHRASES: dict[str, list[str]] = {
    "2a": ["hmac.digest", "as the KEY", "engine secret as the", "HMAC-SHA256 with", "sha256(secret", "is not HMAC"],
    "3b": ["decide by the transition", "never by why", "must be kept", "on the way into the free list",
           "(free, evict)", "Transition.FREE", "zero either"],
    "L1": ["for each filling", "one more character", "never send one probe twice", ">= the block's end",
           "itertools.product", "'#'"],
}

#: exercise id -> [level 1, level 2, level 3]; only level 3 may contain code
HINTS: dict[str, list[str]] = {
    "1a": ["Ask of your encoding: could a decoder split the bytes back into the original fields? "
           "If two different field tuples can give the same bytes, the cache will confuse them.",
           "Each field needs two things in front of its payload: a type tag (so 1 and \"1\" differ, "
           "and None, b\"\", \"\" and 0 all differ) and a length (so a decoder knows where the field "
           "ends: 'a|bc' vs 'ab|c').  A tuple or list is a field whose payload is its items' "
           "encodings, recursively; tuple and list must encode the same.",
           "A fixed 9-byte header per field:\n"
           "    header = struct.pack(\">BQ\", tag, len(payload))\n"
           "    ints:  value.to_bytes((value.bit_length() + 8) // 8, \"big\", signed=True)\n"
           "    seqs:  payload = b\"\".join(encode_one(item) for item in value)\n"
           "Anything else: raise TypeError naming the type."],
    "1b": ["The key names a whole prefix, not one block: what did the K/V of this block depend on?  "
           "Every one of those inputs must reach the hash, unambiguously.",
           "Hash one message made of a domain label (so this digest can never equal one computed "
           "for another purpose) followed by all four fields, through your 1a encoding.  Use a real "
           "cryptographic hash and keep the whole digest; validate the types first.",
           "    message = encode_fields(<label>, parent, tuple(tokens), tuple(extra), tenant_key)\n"
           "    return hashlib.sha256(message).digest()\n"
           "Which label?  The module defines one."],
    "2a": ["Who must be able to compute a tenant's key, and who must not?  Suppose a client knows every "
           "tenant's name: which input of your function does it lack?",
           "Lesson 07's cell on tenant keys builds a keyed hash and shows why gluing a secret onto a "
           "message before hashing is not enough.  Which construction does that cell use -- what is its "
           "key, what is its message?  And how does your 1a encoding keep None, \"\" and \"None\" apart?",
           "    <refuse a secret that is not bytes (TypeError), or too short (ValueError)>\n"
           "    message = encode_fields(TENANT_LABEL, tenant)\n"
           "    return ...   # the construction the contract names, keyed by engine_secret"],
    "2b": ["Where must the tenant key enter the block key: the first block only, or every block?  "
           "Think of a prompt that starts with a public system prompt nobody keys.",
           "An HMAC keyed with tenant_key (or, for shared blocks, a key derived from the secret in "
           "__init__) over the typed (label, parent, tokens, extra, <is this a tenant block?>).",
           "    key = self._shared_key if tenant_key is None else tenant_key\n"
           "    return hmac.digest(key, encode_fields(BLOCK_LABEL, parent, ..., tenant_key is not None), \"sha256\")"],
    "2c": ["The engine keys every block after the operator's public prefix.  Which blocks does your "
           "loop key, and does each block know the key of the one before it?",
           "Walk the FULL blocks in order; carry the previous key as the parent; a block is public "
           "only if it lies ENTIRELY inside public_len (a block that straddles the end is private).",
           "    parent = None\n"
           "    for i in range(len(token_ids) // block_size):\n"
           "        public = (i + 1) * block_size <= public_len\n"
           "        parent = hasher(parent, <block i's tokens>, (), None if public else tenant_key)\n"
           "        ..."],
    "3a": ["The pool is [layers, blocks, slots, heads, dim]: which dimension names a block?  And does "
           "your operation change the pool's tensors, or a copy of them?",
           "Zero along dim 1 for every layer, in K and in V, in place, with one indexed operation per "
           "tensor.  Beware: indexing with a list or tensor (advanced indexing) returns a COPY, so an "
           "in-place op on that result changes nothing.",
           "    idx = torch.as_tensor(ids, dtype=torch.long, device=pool.k_cache.device)\n"
           "    pool.k_cache.index_fill_(1, idx, 0)   # and the same for v_cache\n"
           "(what must an empty list do?)"],
    "3b": ["Print the LIFECYCLE table (lesson 08 has a cell for it).  For each row, ask: after this "
           "transition, who reads this block next -- and did they write its bytes?",
           "Lesson 08's cells on preemption and abort trace the rows their blocks leave through.  Do "
           "those requests leave through rows of their own, or through rows every request uses?  What "
           "does that tell you about which of your two arguments a decision can rely on?  Then, for each "
           "row: would zeroing there destroy something a reader is about to reuse?",
           "    transition = Transition(transition)   # a name that is no transition: ValueError\n"
           "    if transition in (...):               # the rows that hand old bytes to a new reader\n"
           "        return ZERO\n"
           "    return KEEP"],
    "4a": ["An audit that can never fail proves nothing.  What does '0 cross-tenant hits' mean when "
           "the audit never saw ANY hit?",
           "Three verdicts, tested in order: any cross-tenant cached token is a failure (a leak is a "
           "leak); otherwise no same-tenant hit means the audit could not see hits (inconclusive); "
           "only then pass.",
           "    if cross > 0: return FAIL\n    if same <= 0: return ...\n    return PASS"],
    "4b": ["Your workload must make both kinds of hit possible: a tenant re-sending its own document "
           "(should hit), and a tenant sending another's (must not).  And isolation bugs hide inside "
           "batches: requests of different tenants must share engine steps.",
           "Private random documents per tenant; wave 1 primes them; wave 2 re-sends each tenant's own "
           "and copies another tenant's.  Queue each wave with ONE llm.generate call (lists of prompts "
           "and tenants); read out.num_cached_tokens, and classify by construction.",
           "    outs = llm.generate([p for _, _, p in wave], params, tenant=[t for _, t, _ in wave])\n"
           "    for (kind, _, _), out in zip(wave, outs): cached[kind] += out.num_cached_tokens"],
    "5a": ["Only FASTER hits are evidence of a cache.  Is your test one-sided, and in which direction?",
           "The statistic is the largest amount by which the hit sample's empirical CDF lies ABOVE the "
           "miss sample's (hits rise earlier = smaller).  Evaluate both ECDFs at every pooled value.  "
           "For the p-value, scipy.stats.ks_2samp with the matching one-sided alternative; exact or "
           "asymptotic method are both fine.",
           "    grid = np.sort(np.concatenate([h, m]))\n"
           "    F_h = np.searchsorted(np.sort(h), grid, side=\"right\") / len(h)   # same for m\n"
           "    D = max(0.0, float((F_h - F_m).max()))\n"
           "    p = stats.ks_2samp(h, m, alternative=...).pvalue"],
    "5b": ["The classifier says 'hit' for SMALLER latencies.  What fraction of (hit, miss) pairs does it "
           "order correctly -- and what is a tie worth?",
           "Compare every hit with every miss (broadcasting), count hit < miss as 1 and hit == miss as "
           "one half, divide by the number of pairs.",
           "    h, m = np.asarray(hit)[:, None], np.asarray(miss)[None, :]\n"
           "    ((h < m).sum() + 0.5 * (h == m).sum()) / ..."],
    "L1": ["What does the cache keep a key for: one character, or a whole block?  So which of your "
           "probes can it answer at all?  Print the card: where inside its block does the prefix end?",
           "Lesson 04's cell that probes the demo server shows when cached_tokens moves.  Why is the "
           "last token of a prompt never served from cache, and what must a probe therefore hold after "
           "the part it tests?  And what does the server answer the second time you send one text?",
           "    start = len(prefix) + len(found); end = (start // bs + 1) * bs\n"
           "    u = min(end - start, n - len(found))     # unknown characters in this block\n"
           "    for g in itertools.product(alphabet, repeat=u):\n"
           "        probe = ...                           # what must follow the candidate?\n"
           "        if oracle.cached_tokens(probe) >= end: ..."],
    "L2": ["Send each candidate twice in a row and compare: why is the second answer always fast?",
           "Your probe stored its block as YOUR entry.  Only re-probe a candidate after you stored "
           "quota_blocks newer blocks (one long fresh prompt of quota_blocks + 1 blocks flushes them).  "
           "Sample every candidate in rounds, then keep the fastest half; min() ignores spikes.",
           "    for r in range(rounds):\n"
           "        for g in alive: samples[g].append(oracle.ttft_ms(prefix + found + g + tail + '#'))\n"
           "        oracle.ttft_ms(random_letters((quota + 1) * bs + 1))   # flush\n"
           "    alive = sorted(alive, key=lambda g: min(samples[g]))[:len(alive) // 2]"],
    "L3": ["Group per tenant, never across tenants.  What do an enumeration's requests share, and what "
           "differs between them?",
           "For each depth d: requests whose prefix_fps[d-1] is equal AND that end within one block after "
           "it (d <= len(prefix_fps) <= d + 1).  Count distinct tail_fp only, and only lengths within one "
           "block of each other.",
           "    for d in range(1, max_depth + 1):\n"
           "        groups = defaultdict(dict)\n"
           "        for r in reqs:\n"
           "            if d <= len(r['prefix_fps']) <= d + 1:\n"
           "                groups[r['prefix_fps'][d - 1]][r['tail_fp']] = r['num_prompt_tokens']"],
    "C": ["Three tests per node: private prompts across tenants; the same private text behind the node's "
          "public prefix; a crafted collision.  Which kind does each one reveal?",
          "audit_server(url, keys, rounds=1) fails on shared_cache and tenant_key_dropped; the trail tells "
          "them apart (`minikv audit detect --json`: cross_tenant_hit findings, or every request under one "
          "tenant).  Behind the public prefix, bob may hit only len(public) // bs * bs tokens.  A poly twin "
          "of a fresh block sent by the same tenant must not be served from cache.",
          "    twin = poly_collision(block, vocab_size=259)\n"
          "    cached(alice, block + [50, 51]); hit = cached(alice, twin + [50, 51]) >= bs\n"
          "    leak = cached(bob, public + private) > len(public) // bs * bs"],
}


def _load(state: Path) -> dict:
    try:
        return json.loads(state.read_text())
    except (OSError, ValueError):
        return {}


def next_hint(ex_id: str, state: Path = STATE, level: int | None = None) -> str:
    """The next level of ``ex_id``'s hints (or exactly ``level``, without advancing)."""
    if ex_id not in HINTS:
        raise ValueError(f"no hints for exercise {ex_id!r}; exercises: {', '.join(HINTS)}")
    levels = HINTS[ex_id]
    if level is None:
        seen = _load(state)
        level = min(seen.get(ex_id, 0) + 1, len(levels))
        seen[ex_id] = level
        try:
            state.parent.mkdir(parents=True, exist_ok=True)
            state.write_text(json.dumps(seen, indent=1, sort_keys=True))
        except OSError:
            pass  # a read-only checkout still gets its hint
    elif not 1 <= level <= len(levels):
        raise ValueError(f"hint level must be 1..{len(levels)}, got {level}")
    more = (f"(run `make hint EX={ex_id}` again for level {level + 1})" if level < len(levels)
            else "(this is the last level; it shows code)")
    return f"Hint {level}/{len(levels)} for exercise {ex_id}: {levels[level - 1]}\n{more}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="make hint EX=<id>", description="tiered hints for the exercises")
    ap.add_argument("ex", nargs="?", help=f"exercise id: {', '.join(HINTS)}")
    ap.add_argument("--level", type=int, help="print this level (1-3) without advancing")
    ap.add_argument("--reset", action="store_true", help="start again from level 1")
    a = ap.parse_args(argv)
    if not a.ex:
        print(f"usage: make hint EX=<id>   (ids: {', '.join(HINTS)})")
        return 2
    if a.reset:
        seen = _load(STATE)
        seen.pop(a.ex, None)
        STATE.write_text(json.dumps(seen, indent=1, sort_keys=True)) if STATE.parent.is_dir() else None
    try:
        print(next_hint(a.ex, level=a.level))
    except ValueError as exc:
        print(exc)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
