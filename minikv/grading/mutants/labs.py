"""Wrong attacks and detectors for the labs (L1-L4): each lab grader must reject all of them
and say why.  ``LAB_MUTANTS[lab]`` lists ``(name, implementation, what is wrong)``; graders run
learner code in a fresh process, so every mutant is a module-level function.
"""
from __future__ import annotations

import itertools
from collections import defaultdict

from minikv.audit.oracle_client import OracleClient

from ._table import entries
from .guessers import L4_DIAGNOSES, L4_MUTANTS  # noqa: F401  (lab L4's guessers, in their own module)
from .guessers import _next_block  # one block walk for the L1 and L4 mutants (guessers cannot import this module)


# ============================================================================ L1 count oracle
def oracle_no_filler(card):
    """Probes end exactly at the tested block: the server always computes the last prompt token,
    so that block is never served from cache and nothing ever hits."""
    found = ""
    with OracleClient(card) as oracle:
        while len(found) < card["secret_len"]:
            head, end, u, tail = _next_block(card, found)
            for g in itertools.product(card["alphabet"], repeat=u):
                if oracle.cached_tokens(head + "".join(g) + tail) >= end:
                    found += "".join(g)
                    break
            else:
                found += card["alphabet"][0] * u
    return found


def oracle_double_check(card):
    """Re-sends every probe that missed 'to be sure': the second send hits the attacker's own
    entry from the first (self-priming), so the first candidate always 'wins'."""
    found = ""
    with OracleClient(card) as oracle:
        while len(found) < card["secret_len"]:
            head, end, u, tail = _next_block(card, found)
            for g in itertools.product(card["alphabet"], repeat=u):
                probe = head + "".join(g) + tail + "#"
                if oracle.cached_tokens(probe) >= end or oracle.cached_tokens(probe) >= end:
                    found += "".join(g)
                    break
    return found


def oracle_char_by_char(card):
    """Guesses one character at a time, ignoring blocks: a probe that stops inside a block is never
    answered from cache (keys name whole blocks), so no candidate stands out and the first letter
    'wins' (not to be mistaken for self-priming)."""
    found = ""
    with OracleClient(card) as oracle:
        while len(found) < card["secret_len"]:
            best, pick = -1, card["alphabet"][0]
            for c in card["alphabet"]:
                got = oracle.cached_tokens(card["prefix"] + found + c)
                if got > best:
                    best, pick = got, c
            found += pick
    return found


def oracle_threshold_one_block_low(card):
    """Takes a probe as a hit when its cached tokens reach the START of the block it tests (``end -
    block_size``): the known blocks before it pass that test alone, so the first candidate of every block
    'wins' (diagnosed as self-priming before, which it is not)."""
    found = ""
    with OracleClient(card) as oracle:
        while len(found) < card["secret_len"]:
            head, end, u, tail = _next_block(card, found)
            for g in itertools.product(card["alphabet"], repeat=u):
                if oracle.cached_tokens(head + "".join(g) + tail + "#") >= end - card["block_size"]:
                    found += "".join(g)
                    break
            else:
                found += card["alphabet"][0] * u
    return found


def oracle_hard_coded(card):
    """Returns the secret that worked once (a fixed answer): the grader draws a fresh one."""
    with OracleClient(card) as oracle:
        oracle.cached_tokens(card["prefix"] + "#")
    return "4821"[:card["secret_len"]]


# ============================================================================ L2 timing oracle
def timing_back_to_back(card):
    """Five samples of each candidate in a row, median: samples 2-5 hit the attacker's own entry
    from sample 1 (self-priming), so every candidate looks cached."""
    found = ""
    with OracleClient(card) as oracle:
        while len(found) < card["secret_len"]:
            head, _, u, tail = _next_block(card, found)
            best = min(("".join(g) for g in itertools.product(card["alphabet"], repeat=u)),
                       key=lambda g: sorted(oracle.ttft_ms(head + g + tail + "#") for _ in range(5))[2])
            found += best
    return found


def timing_rounds_no_flush(card):
    """Rounds over all candidates but no flush: a block with 10 candidates re-probes each one after
    only 9 others, before its first probe aged out of the attacker's quota (self-priming)."""
    found = ""
    with OracleClient(card) as oracle:
        while len(found) < card["secret_len"]:
            head, _, u, tail = _next_block(card, found)
            cands = ["".join(g) for g in itertools.product(card["alphabet"], repeat=u)]
            samples = {c: [] for c in cands}
            for _ in range(4):
                for c in cands:
                    samples[c].append(oracle.ttft_ms(head + c + tail + "#"))
            found += min(cands, key=lambda c: sorted(samples[c])[1])
    return found


def timing_hard_coded(card):
    """Times one probe, then returns the secret that worked once (a fixed answer): the grader
    draws a fresh secret every time."""
    with OracleClient(card) as oracle:
        oracle.ttft_ms(card["prefix"] + "#")
    return "4821"[:card["secret_len"]]


# ============================================================================ L3 detector
def _summaries(records):
    by = defaultdict(list)
    for r in records:
        if r.get("event") == "summary" and r.get("prefix_fps"):
            by[r.get("tenant")].append(r)
    return by


def detect_counts_requests(records, block_size, threshold=8):
    """Counts requests per (tenant, prefix) without asking whether they differ: a retry loop
    re-sending one prompt is flagged."""
    flagged = set()
    for t, reqs in _summaries(records).items():
        counts = defaultdict(int)
        for r in reqs:
            counts[r["prefix_fps"][-1] if len(r["prefix_fps"]) == 1 else r["prefix_fps"][-2]] += 1
        flagged |= {t} if max(counts.values()) >= threshold else set()
    return flagged


def detect_across_tenants(records, block_size, threshold=8):
    """Groups requests of ALL tenants by prefix: a popular system prompt looks like an attack,
    and every tenant that sent it is flagged."""
    groups = defaultdict(dict)
    for t, reqs in _summaries(records).items():
        for r in reqs:
            groups[r["prefix_fps"][0]][r["tail_fp"]] = t
    return {t for g in groups.values() if len(g) >= threshold for t in g.values()}


def detect_prefix_only(records, block_size, threshold=8):
    """Distinct requests sharing a prefix, but no bound on what follows: a long FAQ session or a
    growing chat after a system prompt is flagged."""
    flagged = set()
    for t, reqs in _summaries(records).items():
        for d in range(1, min(len(r["prefix_fps"]) for r in reqs) + 1):
            groups = defaultdict(set)
            for r in reqs:
                groups[r["prefix_fps"][d - 1]].add(r["tail_fp"])
            if any(len(g) >= threshold for g in groups.values()):
                flagged.add(t)
    return flagged


def detect_exact_prefix(records, block_size, threshold=8):
    """Groups by the WHOLE fingerprint list: an enumeration's requests differ exactly in their
    last block, so no two of them ever land in one group."""
    flagged = set()
    for t, reqs in _summaries(records).items():
        counts = defaultdict(set)
        for r in reqs:
            counts[tuple(r["prefix_fps"])].add(r["tail_fp"])
        flagged |= {t} if max(len(v) for v in counts.values()) >= threshold else set()
    return flagged


def _enumerations(records, block_size, threshold, more_than=False):
    """(tenant, depth, prefix fp) of every group of at least -- or, wrongly, more than -- ``threshold``
    distinct probes of near-equal length that end within one block after a shared prefix."""
    found = set()
    for t, reqs in _summaries(records).items():
        for d in range(1, max(len(r["prefix_fps"]) for r in reqs) + 1):
            groups = defaultdict(dict)
            for r in reqs:
                if d <= len(r["prefix_fps"]) <= d + 1:
                    groups[r["prefix_fps"][d - 1]][r["tail_fp"]] = r["num_prompt_tokens"]
            for fp, lengths in groups.items():
                ls = sorted(lengths.values())
                widest = max(sum(1 for y in ls if x <= y <= x + block_size) for x in ls)
                if (widest > threshold) if more_than else (widest >= threshold):
                    found.add((t, d, fp))
    return found


def detect_more_than_threshold(records, block_size, threshold=8):
    """The right groups, but ``> threshold`` where the rule says "at least threshold": an attacker who
    stops at exactly ``threshold`` probes walks through."""
    return {t for t, _, _ in _enumerations(records, block_size, threshold, more_than=True)}


def detect_flags_victim(records, block_size, threshold=8):
    """The right groups, but every tenant that ever sent the enumerated prefix is flagged too: the victim
    whose prompt is being probed is reported beside the attacker."""
    found = _enumerations(records, block_size, threshold)
    owners = {r["tenant"] for reqs in _summaries(records).values() for r in reqs for _, d, fp in found
              if len(r["prefix_fps"]) >= d and r["prefix_fps"][d - 1] == fp}
    return {t for t, _, _ in found} | owners


LAB_MUTANTS = {
    "L1": entries(("no_filler", oracle_no_filler), ("double_check", oracle_double_check),
                  ("hard_coded", oracle_hard_coded), ("char_by_char", oracle_char_by_char),
                  ("threshold_one_block_low", oracle_threshold_one_block_low)),
    "L2": entries(("back_to_back", timing_back_to_back), ("rounds_no_flush", timing_rounds_no_flush),
                  ("hard_coded", timing_hard_coded)),
    "L3": entries(("counts_requests", detect_counts_requests), ("across_tenants", detect_across_tenants),
                  ("prefix_only", detect_prefix_only), ("exact_prefix", detect_exact_prefix),
                  ("more_than_threshold", detect_more_than_threshold), ("flags_victim", detect_flags_victim)),
    "L4": L4_MUTANTS,
}



# ============================================================================ C capstone
def _fleet_cached(http, url, key, prompt, salt=None) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    r = http.post(f"{url}/completions", headers={"Authorization": f"Bearer {key}"}, json=body)
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def audit_isolation_only(fleet):
    """Runs the isolation audit and calls every failure 'shared_cache': never reads the trail (a
    dropped tenant key looks the same from the API), never tries the public prefix or a collision."""
    import httpx

    from minikv.audit.isolation_server import audit_server

    out = []
    with httpx.Client(timeout=120):
        for url in fleet["nodes"]:
            if audit_server(url, fleet["api_keys"], model="tiny", rounds=1, prompt_words=20).verdict == "fail":
                out.append({"node": url, "kind": "shared_cache"})
    return out


def audit_public_hits_are_leaks(fleet):
    """Treats ANY cross-tenant hit behind the public prefix as first-block keying: hits on the
    operator-declared public blocks are intended, so every node is reported."""
    import os

    import httpx

    (alice, _), (bob, _) = list(fleet["api_keys"].items())[:2]
    out = []
    with httpx.Client(timeout=120) as http:
        for url in fleet["nodes"]:
            public = http.get(url[:-3] + "/fleet/node").json()["public_prefix"]
            text = public + os.urandom(8).hex() + " private notes of alice, twice as long as a block. ?"
            _fleet_cached(http, url, alice, text)
            if _fleet_cached(http, url, bob, text) > 0:
                out.append({"node": url, "kind": "first_block_only"})
    return out


def audit_salt_per_tenant(fleet):
    """Tests the salt as a careful client uses it: alice with her salt, bob with his own.  A node that
    keys by the salt alone isolates two *different* salts perfectly, so the test can never fire:
    the leak needs the same salt from two tenants (only the salt test is run here; the finding that
    matters is the missed client_salt_key)."""
    import os

    import httpx

    (alice, _), (bob, _) = list(fleet["api_keys"].items())[:2]
    out = []
    with httpx.Client(timeout=120) as http:
        for url in fleet["nodes"]:
            text = os.urandom(8).hex() + " alice's salted notes, private, longer than a block. ?"
            for key, salt in ((alice, "alice-" + os.urandom(4).hex()), (bob, "bob-" + os.urandom(4).hex())):
                got = _fleet_cached(http, url, key, text, salt)
            if got > 0:
                out.append({"node": url, "kind": "client_salt_key"})
    return out


from .capstone_collision import audit_collision_across_tenants  # noqa: E402  (imports minikv.attacks, which the labs forbid)

LAB_MUTANTS["C"] = entries(("isolation_only", audit_isolation_only),
                           ("public_hits_are_leaks", audit_public_hits_are_leaks),
                           ("collision_across_tenants", audit_collision_across_tenants),
                           ("salt_per_tenant", audit_salt_per_tenant))
