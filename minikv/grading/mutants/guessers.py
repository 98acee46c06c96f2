"""Wrong ranked guessers for lab L4 (lesson 04): the grader must reject each and name its bug class.

``L4_MUTANTS`` lists ``(name, implementation, what is wrong)`` (re-exported as ``LAB_MUTANTS["L4"]`` by
:mod:`.labs`); ``L4_DIAGNOSES`` the words each verdict must contain.  Graders run learner code in a
fresh process, so every mutant is a module-level function.
"""
from __future__ import annotations

import itertools

from minikv.audit.oracle_client import OracleClient

from ._table import entries


def _next_block(card, found: str) -> tuple[str, int, int, str]:
    """(prompt so far, end of the block holding the next unknown, unknowns in it, its known rest)."""
    bs, n, prefix, suffix = card["block_size"], card["secret_len"], card["prefix"], card["suffix"]
    start = len(prefix) + len(found)
    end = (start // bs + 1) * bs
    u = min(end - start, n - len(found))
    return prefix + found, end, u, suffix[:end - start - u]

def _ranked_search(card, order):
    """Block by block like L1's reference, trying each block's fillings in ``order(before, fillings)``."""
    found = ""
    with OracleClient(card) as oracle:
        while len(found) < card["secret_len"]:
            head, end, u, tail = _next_block(card, found)
            fillings = ["".join(g) for g in itertools.product(card["alphabet"], repeat=u)]
            for g in order(head, fillings):
                if oracle.cached_tokens(head + g + tail + "#") >= end:
                    found += g
                    break
    return found


def _chain(prior, before, filling):
    p, prev = 1.0, before[-1]
    for c in filling:
        p, prev = p * prior[prev][c], c
    return p


def guesser_exhaustive(card):
    """Recovers every secret, but tries fillings in the alphabet's order (L1's search): the prior on
    the card is never read, so it pays what an exhaustive search pays."""
    return _ranked_search(card, lambda before, fillings: fillings)


def guesser_reverse(card):
    """Sorts by the prior but the wrong way round (ascending): the likeliest filling comes last, so it
    pays more than an exhaustive search."""
    return _ranked_search(card, lambda before, fillings: sorted(fillings, key=lambda g: _chain(card["prior"], before, g)))


def guesser_unigram(card):
    """Ranks by how common each character is overall (a column sum of the bigram table), ignoring the
    character before it: a wrong key, better than exhaustive but far from the model's order."""
    freq = {c: sum(row[c] for row in card["prior"].values()) for c in card["alphabet"]}

    def key(g):
        p = 1.0
        for c in g:
            p *= freq[c]
        return -p
    return _ranked_search(card, lambda before, fillings: sorted(fillings, key=key))


def guesser_first_char_only(card):
    """Ranks a block's fillings by the probability of their FIRST character alone (given the text before):
    right for blocks of one unknown, but the second character of a two-character block is tried in the
    alphabet's order, so every block pays for the half of the model it never reads."""
    return _ranked_search(card, lambda before, fillings: sorted(
        fillings, key=lambda g: -card["prior"][before[-1]][g[0]]))


def guesser_ties_reversed(card):
    """NEGATIVE CONTROL (correct): the model's order, with fillings of equal probability taken in the
    reverse of the alphabet's order -- a right ranking that is not the reference's; the grader must
    ACCEPT it."""
    a = card["alphabet"]
    return _ranked_search(card, lambda before, fillings: sorted(
        fillings, key=lambda g: (-_chain(card["prior"], before, g), [-a.index(c) for c in g])))


def guesser_stale_context(card):
    """Scores every block as if it followed the prefix (the context is never updated with what was
    recovered): right for the first block only."""
    return _ranked_search(card, lambda before, fillings: sorted(
        fillings, key=lambda g: -_chain(card["prior"], card["prefix"], g)))


def guesser_depth_first(card):
    """Enumerates a block depth-first, one character at a time in the model's order (lesson 04's
    enumeration): a likely second character behind an unlikely first one comes late."""
    prior, alphabet = card["prior"], card["alphabet"]

    def dfs(prev, u):
        if u == 0:
            return [""]
        return [c + rest for c in sorted(alphabet, key=lambda c: -prior[prev][c]) for rest in dfs(c, u - 1)]
    return _ranked_search(card, lambda before, fillings: dfs(before[-1], len(fillings[0])))


def guesser_stops_early(card):
    """Confirms the first block through the oracle, then trusts the model for the rest (its most
    likely next characters, never probed): the model alone usually gets the text wrong."""
    prior, n = card["prior"], card["secret_len"]
    first = _ranked_search({**card, "secret_len": card["block_size"]},
                           lambda before, fillings: sorted(fillings, key=lambda g: -_chain(prior, before, g)))
    while len(first) < n:
        first += max(card["alphabet"], key=lambda c: prior[first[-1]][c])
    return first


def _replayed(card) -> str:
    """The secret this victim had in an earlier grade: the grader's fixed seeds, read from its source."""
    from minikv.grading import labs_prior

    return labs_prior.draw_secret(labs_prior.SEEDS[int(card["prefix"].split()[1].rstrip(":"))])


def guesser_replays_unconfirmed(card):
    """Returns the secret of an earlier grade (fixed seeds, read from the grader's source) after one
    probe that confirms nothing: the oracle never saw the secret's blocks."""
    with OracleClient(card) as oracle:
        oracle.cached_tokens(card["prefix"] + "#")
    return _replayed(card)


def guesser_replays_confirmed(card):
    """Replays an earlier grade's secret and confirms it with one probe: one probe for three blocks,
    a cost no search through the oracle reaches on most secrets."""
    secret = _replayed(card)
    with OracleClient(card) as oracle:
        oracle.cached_tokens(card["prefix"] + secret + card["suffix"][:1] + "#")
    return secret


L4_MUTANTS = entries(("exhaustive", guesser_exhaustive), ("reverse", guesser_reverse), ("unigram", guesser_unigram),
                     ("stale_context", guesser_stale_context), ("depth_first", guesser_depth_first),
                     ("stops_early", guesser_stops_early), ("replays_unconfirmed", guesser_replays_unconfirmed),
                     ("replays_confirmed", guesser_replays_confirmed), ("first_char_only", guesser_first_char_only))

#: L4 mutant -> words its verdict must contain (the bug class it names)
L4_DIAGNOSES = {"exhaustive": "not using the prior", "reverse": "ranks in reverse", "unigram": "wrong ranking key",
                "stale_context": "wrong ranking key", "depth_first": "wrong ranking key", "stops_early": "stops early",
                "replays_unconfirmed": "side door", "replays_confirmed": "side door", "first_char_only": "wrong ranking key"}
