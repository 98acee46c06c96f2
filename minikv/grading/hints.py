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
    "3c": ["keys only", "V forgotten", "min(ids)", "max(ids)", "a slice", "range(", "k_cache[:, ids] = 0",
           "consecutive"],
    "3b": ["decide by the transition", "never by why", "must be kept", "on the way into the free list",
           "(free, evict)", "Transition.FREE", "zero either", "('free', 'evict')", "('allocate')",
           "out of the free list", "through 'free'", "the same 'evict' row", "as a hit does: keep it"],
    "3d": ["zero on allocation", "b in self.used", "self.used.update", "a fresh pool is zeros",
           "never zero on free", "ever had an owner", "last moment"],
    "L1": ["for each filling", "one more character", "never send one probe twice", ">= the block's end",
           "itertools.product", "'#'"],
    "1b": ["hashlib.sha256", "BLOCK_DOMAIN", "followed by all four fields", "keep the whole digest",
           "domain label", ".digest()", "[:16]", "never truncate"],
    "2b": ["hmac.digest", "HMAC keyed with", "keyed with tenant_key", "derived from the secret in __init__",
           "is this a tenant block", "_shared_key if", "tenant_key is not None", "SHARED_LABEL"],
    "3a": ["index_fill", "dim 1", "dim=1", "advanced indexing", "returns a copy", "one indexed operation",
           "[:, ids] = 0", "[:, idx]"],
    "4b": ["wave 1 primes", "one llm.generate call", "re-sends each tenant's own", "copies another tenant's",
           "classify by construction", "out.num_cached_tokens", "tenant=[", "private random documents"],
    "C": ["rounds=1", "fails on shared_cache and tenant_key_dropped", "len(public) // bs", "cross_tenant_hit findings",
          "every request under one tenant", "poly twin of a fresh block", "poly_collision(", "must not be served",
          "secret, salt)", "same salt from both tenants", "bob sends the same salt"],
    "2d": ["(i + 1) * block_size", "last token", "its end", "from the tenant's key", "tenant_key if",
           "hmac.digest(tenant_key", "USER_LABEL, user", "user_key = hmac"],
    "L4": ["likeliest first", "joint probability", "chain rule", "product of", "fillings.sort", "-probability(",
           "descending", "given everything you have recovered", "whole block's filling"],
    "L2": ["second-fastest", "sorted(xs)[1]", "best + margin", "half the gap", "fastest half", "min()"],
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
    "1b": ["The key names a whole prefix, not one block: what did the K/V of this block depend on?  List "
           "every input, and for each one ask what goes wrong (lesson 06) when two requests that differ only "
           "in it get the same key.",
           "Lesson 07's section 3 has two ingredients besides your 1a encoding.  Could your key ever equal a "
           "SHA-256 that minikv computes elsewhere over the same fields (a tenant key, an audit fingerprint)?  "
           "What does the module give you that rules this out?  And look at the `trunc32` row of lesson 06's "
           "section 3: what made that key weak, and does yours share the weakness?  Which inputs does the "
           "docstring say to refuse?",
           "    <refuse a parent that is neither None nor bytes, and tokens that are not ints (a bool is an int!)>\n"
           "    message = encode_fields(..., parent, tuple(tokens), tuple(extra), tenant_key)   # what comes first?\n"
           "    return ...   # which function of the message, and how much of its output?"],
    "2a": ["Who must be able to compute a tenant's key, and who must not?  Suppose a client knows every "
           "tenant's name: which input of your function does it lack?",
           "Lesson 07's section 4 names a keyed construction, and the glossary's HMAC entry says why gluing a "
           "secret onto a message before hashing is not enough.  Which construction is it -- what is its "
           "key, what is its message?  And how does your 1a encoding keep None, \"\" and \"None\" apart?",
           "    <refuse a secret that is not bytes (TypeError), or too short (ValueError)>\n"
           "    message = encode_fields(TENANT_LABEL, tenant)\n"
           "    return ...   # the construction the contract names, keyed by engine_secret"],
    "2b": ["Where must the tenant key enter the block key: the first block only, or every block?  "
           "Think of a prompt that starts with a public system prompt nobody keys.  And a block with no "
           "tenant key at all: could a client who guesses its tokens compute its key?",
           "Lesson 07's section 5 runs a hasher that keys the first block only, behind a public prefix: which "
           "of mallory's guesses hit, and why?  Section 4 built a key nobody without the secret can compute: "
           "which construction, and could the same idea protect blocks that have no tenant key?  Finally, could "
           "a tenant block and a shared block with the same parent and tokens ever get the same key?  What in "
           "your message rules that out?",
           "    def __init__(self, engine_secret):\n"
           "        <refuse a short secret>\n"
           "        self._shared_key = ...   # derived once: from what, with which label?\n"
           "    def __call__(self, parent, tokens, extra, tenant_key):\n"
           "        key = ...                # which key for THIS block?\n"
           "        message = encode_fields(BLOCK_LABEL, parent, tuple(tokens), tuple(extra), ...)  # one more field\n"
           "        return ...               # the keyed construction of 2a"],
    "2c": ["The engine keys every block after the operator's public prefix.  Which blocks does your "
           "loop key, and does each block know the key of the one before it?",
           "Walk the FULL blocks in order; carry the previous key as the parent; a block is public "
           "only if it lies ENTIRELY inside public_len (a block that straddles the end is private).",
           "    parent = None\n"
           "    for i in range(len(token_ids) // block_size):\n"
           "        public = (i + 1) * block_size <= public_len\n"
           "        parent = hasher(parent, <block i's tokens>, (), None if public else tenant_key)\n"
           "        ..."],
    "3c": ["Print `smoke_test`'s source (lesson 08's cell tagged `smoke-test` does).  Which block, which layer "
           "and which tensor does it look "
           "at after the call, and what does it never look at?  Now list every promise 3a's contract makes: "
           "which of them can a zero_blocks break without the smoke test noticing?",
           "Run 3a's grader on a few broken versions in a cell and read the bug class it names for each.  Which "
           "of those classes would survive the smoke test's one block, one layer and one tensor?  Which promise "
           "concerns blocks you were *not* asked to zero, and which concerns the part of a block the smoke "
           "test never reads?  And would your mutant still run on an empty list?",
           "    def sneaky_zero_blocks_a(pool, block_ids):\n"
           "        ...   # right where smoke_test looks, wrong somewhere it never looks\n"
           "    def sneaky_zero_blocks_b(pool, block_ids):\n"
           "        ...   # break a different promise of 3a's contract\n"
           "(both must run without raising on [], on one id, and on several)"],
    "2d": ["Before any code, fill a table: one row per part of the prompt (public, tenant, user), and for "
           "each, who may share a block of it?  Then: which of your keys has exactly that set of sharers?  And "
           "a block that holds the last public tokens and the first tenant tokens: whose row does it belong to?",
           "Your 2a already gives one key per tenant.  What must a user's key depend on so that 'bob' of one "
           "tenant and 'bob' of another never meet, and None, '' and 'None' stay three users?  Which tool from "
           "1a keeps the fields apart?  If your layout is isolated but its hit rate is low, which sharers did you "
           "lock out?  (Section 6's 2c walk decides public or not per block: reread how.)",
           "    <type checks; a user needs a tenant; boundaries in order>\n"
           "    tenant_key = derive_tenant_key(engine_secret, tenant)\n"
           "    user_key = ...      # a MAC over the typed user name, bound to this tenant: keyed with what?\n"
           "    for i in range(n_tokens // block_size):\n"
           "        <which part holds the block's strictest token?>  ->  None, tenant_key or user_key"],
    "3a": ["The pool is [layers, blocks, slots, heads, dim]: which dimension names a block?  And does "
           "your operation change the pool's tensors, or a copy of them?  How would you find out in two lines?",
           "Build a small pool in a cell (2 layers, 4 blocks, filled with ones), zero blocks [1, 3] your way and "
           "print it.  Did the pool change?  If not, what did your indexing expression hand you, and what did "
           "your operation change?  In the PyTorch docs, which in-place methods (the ones ending in `_`) take a "
           "dimension and a tensor of indices?  And what should an empty list of ids cost?",
           "    idx = torch.as_tensor(ids, dtype=torch.long, device=pool.k_cache.device)\n"
           "    for cache in (pool.k_cache, pool.v_cache):\n"
           "        ...   # ONE in-place write along the block dimension\n"
           "(what must an empty list do?)"],
    "3b": ["Read the LIFECYCLE table (lesson 08's cell tagged `lifecycle-table`).  For each row, ask: after this "
           "transition, who reads this block next -- and did they write its bytes?",
           "Lesson 08's cell tagged `placement-finished-only` runs a realistic rule that fails: which request "
           "does it fail on, and what about that request misled it?  Do preempted and aborted requests give "
           "their blocks back through rows of their own, or through rows every request uses?  What "
           "does that tell you about which of your two arguments a decision can rely on?  Then, for each "
           "row: would zeroing there destroy something a reader is about to reuse?",
           "    transition = Transition(transition)   # a name that is no transition: ValueError\n"
           "    if transition in (...):               # the rows that hand old bytes to a new reader\n"
           "        return ZERO\n"
           "    return KEEP"],
    "3d": ["Print the budget check's score for minikv's two safe scrubbers (lesson 08's cell tagged "
           "`budget-safe-scrubbers` runs them as planners).  "
           "Each one is over budget: which blocks did each zero that nobody needed zeroed?  What was in them "
           "when it zeroed them?",
           "A block must be zero before someone who did not write it reads it.  At which event of LIFECYCLE is "
           "that reader known for sure, and what would your planner need to remember, from earlier events, "
           "to know whether a block handed over then can hold anything at all?  Which paths of 3b must that "
           "memory survive?",
           "    def __init__(self):\n"
           "        self.<memory> = set()          # what you must know about each block\n"
           "    def plan(self, transition, block_ids):\n"
           "        if transition == ...:           # the one event where a new reader is certain\n"
           "            out = [...]                 # only the blocks that can hold old K/V\n"
           "            ...                         # update the memory: who writes them now?\n"
           "            return out\n"
           "        ...                             # (tiers: 'onload' writes a block too)\n"
           "        return []"],
    "4a": ["An audit that can never fail proves nothing.  What does '0 cross-tenant hits' mean when "
           "the audit never saw ANY hit?",
           "Three verdicts, tested in order: any cross-tenant cached token is a failure (a leak is a "
           "leak); otherwise no same-tenant hit means the audit could not see hits (inconclusive); "
           "only then pass.",
           "    if cross > 0: return FAIL\n    if same <= 0: return ...\n    return PASS"],
    "4b": ["For every cached token your audit counts, can you say whose cache it came from without asking "
           "the engine?  Which of your requests could only ever hit its own tenant's blocks, which only another "
           "tenant's, and what must have been sent before them?  And do requests of different tenants ever run "
           "in the same engine step?",
           "Lesson 08's section 7 gives the audit's design rules (black box, concurrent): reread them.  How "
           "can one `llm.generate` call carry the requests of several tenants (read its signature)?  How do you "
           "make documents that share no block with anything else in the cache?  What does a `RequestOutput` "
           "tell a client about its hits?",
           "    docs = {t: fresh(doc_blocks * bs) for t in tenants}\n"
           "    wave1 = [(\"cross\", t, docs[t] + fresh(bs)) for t in tenants]\n"
           "    wave2 = [...]             # which requests, of which kind?\n"
           "    for wave in (wave1, wave2):\n"
           "        outs = ...            # how do the tenants share steps?\n"
           "        for (kind, _, _), out in zip(wave, outs): cached[kind] += ..."],
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
           "Lesson 04's section 7 probes the demo server: when does cached_tokens move?  Why is the "
           "last token of a prompt never served from cache, and what must a probe therefore hold after "
           "the part it tests?  And what does the server answer the second time you send one text?",
           "    start = len(prefix) + len(found); end = (start // bs + 1) * bs\n"
           "    u = min(end - start, n - len(found))     # unknown characters in this block\n"
           "    for g in itertools.product(alphabet, repeat=u):\n"
           "        probe = ...                           # what must follow the candidate?\n"
           "        if oracle.cached_tokens(probe) >= end: ..."],
    "L4": ["Your L1 search tried a block's fillings in the alphabet's order.  If you had to bet on which "
           "filling the victim sent, which would you try first, and what on the card tells you?  How many probes "
           "does a block cost you when the right filling is the k-th one you try?",
           "Lesson 04's section 3 asks SmolLM2 how likely each next token is, and section 4 probes candidates "
           "in the model's order.  Here card['prior'] plays the model, one character at a time.  A block holds "
           "two characters: how likely is a pair, and on what does its second character depend?  What does "
           "its first character depend on, once you have recovered the block before it?",
           "    fillings = [''.join(g) for g in itertools.product(alphabet, repeat=u)]\n"
           "    def likelihood(before, filling):\n"
           "        ...                                  # what does the model say about this filling?\n"
           "    for guess in <fillings, in which order?>:\n"
           "        if oracle.cached_tokens(prefix + found + guess + tail + '#') >= block_end: ..."],
    "L2": ["Send each candidate twice in a row and compare: why is the second answer always fast?  "
           "Then send one candidate ten times, spaced out, and plot the answers: what does the noise "
           "look like, and what do the rare slow answers look like?",
           "Lesson 04's section 7 shows, on the virtual clock, a hit's saving and the noise around it.  How "
           "many samples of a candidate do you need before a few unlucky ones (or one lucky one) stop "
           "deciding its fate?  Which summary of those samples is moved by a spike, and which is not?  "
           "When is it safe to stop sampling a candidate for good?",
           "    while len(alive) > 1:\n"
           "        for g in alive: samples[g].append(oracle.ttft_ms(prefix + found + g + tail + '#'))\n"
           "        oracle.ttft_ms(random_letters((quota + 1) * bs + 1))   # why this line?\n"
           "        rounds += 1\n"
           "        if rounds >= ...:                # enough samples to judge?\n"
           "            alive = [g for g in alive if ...]   # keep whom?"],
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
    "C": ["Lesson 12 worked one kind through: a probe, its control, and a second source where two kinds answer "
          "the probe alike.  For each other kind, what can one tenant (or two together) make that node do that a "
          "clean node never does?  Which of your probes fire on more than one kind, and in what order must they "
          "run so that every node gets exactly one kind, and a clean node none?  For `client_salt_key`: what "
          "must you see on the *same* tenant first for a miss to mean anything?",
          "Node 0 of the demo fails the isolation audit, yet its trail shows no cross-tenant hit: what does each "
          "trail line say about who sent the request?  Behind the public prefix (lesson 07, section 5), how many "
          "of bob's cached tokens are intended?  Work it out from `/fleet/node`, not from the prompt.  Lesson 06 "
          "crafts two blocks with one `poly` hash: what does a clean node that uses `poly` with verification on "
          "do with the second, and what must your test therefore not count as a finding?",
          "    report = audit_server(url, fleet[\"api_keys\"], model=card[\"model\"], ...)\n"
          "    if report.verdict == \"fail\":\n"
          "        return ...          # which of two kinds?  ask the trail\n"
          "    <a probe behind the public prefix>   # how many tokens may bob get?\n"
          "    <a probe with a crafted twin>        # what does a verifying node serve?\n"
          "    <a probe with a cache_salt>          # its same-tenant control first\n"
          "    return None"],
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
