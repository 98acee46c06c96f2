"""Grader of lab L4 (lesson 04): beat the exhaustive search with a ranked guesser.

The oracle is L1's (``cached_tokens`` on a shared cache, blocks of 2 byte tokens), but the victims'
secrets are text drawn from a known **language model**: a character bigram model (:func:`prior`), the
lab's stand-in for lesson 04's SmolLM2 ranking.  SmolLM2 itself would cost seconds per ranking on a
2-core CPU, so the grader owns a small model whose table travels on the lab card (``card["prior"]``:
``prior[prev][c]`` is the probability that character ``c`` follows ``prev``); the victims' secrets
are sampled from exactly that table, so it is a calibrated prior, as a good model is for real text.

One grade starts one server (:mod:`.lab_server_prior`) holding :data:`RUNS` victims, each behind
its own template and attacker key.  A graded run's secrets are drawn inside that server from
``os.urandom`` and never written anywhere the learner's code can read: fixed seeds would be in this
very file, and a learner could replay their secrets padded with enough probes to pass the side-door
check.  Every figure is computed on the same secrets, so the reference always scores 1.00x and a
learner's score moves only as much as their own cost does from secret to secret.  The lesson and the
tests pass :data:`SEEDS` (``seeds=``), so their outputs are reproducible.  The learner's function runs sealed, once per victim, with that
victim's card.  The score is the **median probes per token** over the victims, printed beside two
figures the grader computes exactly from the revealed secrets:

* the reference (:func:`ranked_cost`): each block's fillings probed in order of their probability
  under the prior, given the text before the block;
* the exhaustive search (:func:`exhaustive_cost`): fillings in the alphabet's order, L1's baseline.

A pass recovers every secret, confirms it through the oracle (some probe hit the victim's last secret
block), and costs at most :data:`TOLERANCE` times what a ranking by the prior spends at worst on the same
secrets (:func:`dearest_ranked_cost`, summed: a median of five secrets lets a ranking that reads half the
model through on a lucky draw).  Fewer probes than blocks on
the median secret is refused as a side door: a block costs less than its own probe only when a probe that
tested the block before it also carried its right filling, and under this prior the reference's first try
is right for every block of a secret on about 1 secret in 180.
"""
from __future__ import annotations

import itertools
import statistics

from ._lab import HiddenServer, refuse, run_graded
from ._report import expect, grader

ALPHABET = "aehinorst "
SECRET_LEN, BLOCK_SIZE, QUOTA = 6, 2, 24
SUFFIX = ". Keep it safe."
#: the lesson's and the tests' secrets, one per victim (a graded run draws fresh ones instead)
SEEDS = (11, 12, 13, 14, 15)
RUNS = len(SEEDS)
#: the pass band: at most this many times :func:`dearest_ranked_cost` summed over the victims -- what a ranking
#: by the prior spends at worst on the same secrets, whatever order it gives fillings of equal probability.
#: So every right ranking passes on every draw, and no slack is needed for tie orders; a wrong key (the
#: first character alone, no context) pays for the part of the model it never reads, and passes only on a
#: draw of five secrets whose blocks its order happens to get right.
TOLERANCE = 1.0
#: a median at or above this fraction of the exhaustive search's is "not using the prior"
UNRANKED = 0.8
#: the text the bigram model is counted on (its characters are exactly ALPHABET)
CORPUS = ("the rain in the north is the rest on the sea at the shore then the stone stair near the hat on his "
          "horse her sister ate a hot tea in the east at three on the other shore there is a star in the heart "
          "at the earth so this is not that one as the train into the station rants on another tenth hit the "
          "senior at the inn near the oasis sits there it is her son in a toast to the ten notes there the "
          "tenor sits on a stone seat near the shore to rest")


def prior() -> dict[str, dict[str, float]]:
    """``{prev: {c: P(c | prev)}}`` over :data:`ALPHABET`, rounded to 4 decimals: bigram counts of
    :data:`CORPUS` (a space before and after it) plus 0.25 for every pair, so every filling is possible."""
    counts = {a: {b: 0.25 for b in ALPHABET} for a in ALPHABET}
    text = " " + CORPUS + " "
    for x, y in zip(text, text[1:]):
        counts[x][y] += 1
    return {a: {b: round(v / sum(row.values()), 4) for b, v in row.items()} for a, row in counts.items()}


def prefix_of(run: int) -> str:
    """Victim ``run``'s known prefix: distinct per victim, even length (the secret starts a block)."""
    return f"Note {run}: "


def draw_secret(seed: int, table: dict | None = None) -> str:
    """:data:`SECRET_LEN` characters sampled from the bigram chain, starting after a space."""
    import numpy as np

    table, rng, prev, out = table or prior(), np.random.default_rng(seed), " ", ""
    for _ in range(SECRET_LEN):
        p = np.array([table[prev][c] for c in ALPHABET])
        prev = ALPHABET[rng.choice(len(ALPHABET), p=p / p.sum())]
        out += prev
    return out


def _blocks(card: dict, secret: str):
    """(text before the block, the secret's characters in it) for each block the secret touches."""
    bs, start, done = card["block_size"], len(card["prefix"]), 0
    while done < len(secret):
        pos = start + done
        u = min((pos // bs + 1) * bs - pos, len(secret) - done)
        yield card["prefix"] + secret[:done], secret[done:done + u]
        done += u


def _probability(table: dict, before: str, filling: str) -> float:
    p, prev = 1.0, before[-1]
    for c in filling:
        p *= table.get(prev, {}).get(c, 0.0)
        prev = c
    return p


def ranked_cost(card: dict, secret: str) -> int:
    """Probes of the reference guesser for ``secret``: per block, 1 + the rank of the true filling
    among all fillings sorted by prior probability (ties in the alphabet's order)."""
    a, total = card["alphabet"], 0
    for before, fill in _blocks(card, secret):
        key = (-_probability(card["prior"], before, fill), [a.index(c) for c in fill])
        total += 1 + sum((-_probability(card["prior"], before, g), [a.index(c) for c in g]) < key
                         for g in map("".join, itertools.product(a, repeat=len(fill))))
    return total


def dearest_ranked_cost(card: dict, secret: str) -> int:
    """The most a ranking by the prior can spend on ``secret``: per block, the fillings at least as probable
    as the true one, itself included (all its ties tried first).  Probabilities within a relative 1e-9
    count as equal: a product and a sum of logs order such fillings differently."""
    a, total = card["alphabet"], 0
    for before, fill in _blocks(card, secret):
        p = _probability(card["prior"], before, fill) * (1 - 1e-9)
        total += sum(_probability(card["prior"], before, g) >= p
                     for g in map("".join, itertools.product(a, repeat=len(fill))))
    return total


def exhaustive_cost(card: dict, secret: str) -> int:
    """Probes of L1's exhaustive search for ``secret``: per block, 1 + the true filling's index in
    the alphabet's order."""
    a, total = card["alphabet"], 0
    for _, fill in _blocks(card, secret):
        total += 1 + sum(a.index(c) * len(a) ** (len(fill) - 1 - i) for i, c in enumerate(fill))
    return total


def _verdict(guess, card: dict, key: dict) -> None:
    n, secret = card["secret_len"], key["secret"]
    expect(isinstance(guess, str) and len(guess) == n,
           f"guess returned {guess!r}; it must return a str of {n} characters",
           "return the recovered characters only, without the prefix or suffix")
    expect(key["requests"] > 0, "your guesser never asked the oracle", "open OracleClient(card) and probe")
    if guess != secret:
        first = next(i for i in range(n) if guess[i] != secret[i])
        why = f"recovered {guess!r}, the secret was {secret!r} (first wrong character at position {first})"
        expect(not key["self_primed"], why + f"; {key['self_primed']} of your {key['requests']} answers came "
               "from your own earlier probes (self-priming)", "never send one probe twice")
        expect(key["max_victim_cached"] > key["known_cached"], why + "; no probe ever hit a victim block past "
               "the known prefix", "the server always computes the last prompt token: what must follow the "
               "block a probe tests?")
        expect(False, why + " (bug class: stops early -- returned characters no probe confirmed)",
               "keep probing a block until a filling hits, for every block of the secret")
    end = -(-(len(card["prefix"]) + n) // card["block_size"]) * card["block_size"]
    expect(key["max_victim_cached"] >= end, f"returned the right secret {secret!r}, but no probe ever hit the "
           f"victim's blocks up to token {end} (deepest hit: {key['max_victim_cached']}): the oracle never "
           "confirmed it, so it came through a side door (bug class: side door -- not an attack on the cache)",
           "every character you return must be confirmed by a cached_tokens answer")


def run_all(fn, timeout: float, seeds=None) -> tuple[list, list[dict], list[dict]]:
    """(answers, cards, answer keys) of one server's :data:`RUNS` victims, each attacked sealed;
    ``seeds``: one per victim, or None for fresh secrets drawn inside the server."""
    why = refuse(fn)
    expect(why is None, str(why), "write the guesser in its exercises/ file with OracleClient alone")
    args = ("--seeds", ",".join(map(str, seeds))) if seeds is not None else ()
    with HiddenServer("minikv.grading.lab_server_prior", *args) as srv:
        cards, guesses = srv.info["cards"], []
        for card in cards:
            guess, _ = run_graded(fn, [card], timeout,
                                  error_hint="run it in the lesson against the demo server and read the traceback",
                                  timeout_hint="a search that never stops usually re-probes the same block forever")
            guesses.append(guess)
        keys = srv.reveal()["runs"]
    return guesses, cards, keys


@grader("order each block's fillings by the prior; see the lab's docstring")
def check_ranked_guesser(guess_secret, *, timeout: float = 120.0, seeds=None) -> str:
    guesses, cards, keys = run_all(guess_secret, timeout, seeds)
    mine, ref, exh, probes, dearest = [], [], [], [], []
    for guess, card, key in zip(guesses, cards, keys):
        _verdict(guess, card, key)
        n = card["secret_len"]
        mine.append(key["requests"] / n)
        ref.append(ranked_cost(card, key["secret"]) / n)
        dearest.append(dearest_ranked_cost(card, key["secret"]))
        exh.append(exhaustive_cost(card, key["secret"]) / n)
        probes.append(key["requests"])
    m, r, e = statistics.median(mine), statistics.median(ref), statistics.median(exh)
    blocks = len(list(_blocks(cards[0], keys[0]["secret"])))
    figures = f"median {m:.2f} probes/token (reference {r:.2f}, exhaustive {e:.2f})"
    expect(statistics.median(probes) >= blocks, f"recovered every secret with a {figures}: fewer probes than the "
           f"{blocks} blocks of a secret on most secrets, which no search through the oracle does under this prior, "
           "so the answers came through a side door (bug class: side door -- not an attack on the cache)",
           "attack through OracleClient alone: every answer must come from cached_tokens.")
    expect(m <= e, f"recovered every secret, {figures}: dearer than the exhaustive search, so the likeliest "
           "fillings come last (bug class: ranks in reverse)", "which end of your ordering is the likeliest filling?")
    expect(m < UNRANKED * e, f"recovered every secret, {figures}: about what an exhaustive search pays (bug class: "
           "not using the prior)", "the card carries a model of the victim's text: what does it say each block "
           "most likely holds?")
    total = sum(probes) / sum(dearest)
    expect(total <= TOLERANCE, f"recovered every secret, {figures}: {total:.2f}x the most a ranking by the model "
           f"spends on the same {len(cards)} secrets, over the {TOLERANCE}x band (bug class: wrong ranking key)",
           "which probability orders your candidates: of one character alone, or of what the block holds, and "
           "given which text?")
    return f"recovered {len(cards)} secrets of {cards[0]['secret_len']} characters: {figures}; score {r / m:.2f}x"
