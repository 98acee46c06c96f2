"""Graders of the two extraction labs (lesson 04): L1 count oracle, L2 timing oracle.

Each grade starts a victim's server in a subprocess (:mod:`minikv.grading.lab_server`) with a
secret drawn from ``os.urandom`` *at grade time*, runs the learner's function in another fresh
process that receives only the lab card (URL, key, template: :func:`~._lab.run_sealed`), then
closes the server, which prints the secret and what it saw: how many requests the attacker sent,
how many answers came from the attacker's *own* cache entries (self-priming), and the deepest
cache hit on the victim's blocks.  A hard-coded answer fails; so does reading the engine: there
is none in the learner's process.

Scores are probes per recovered token, printed beside a baseline:

* L1: an exhaustive block-by-block search (:func:`exhaustive_probes`): a block with ``u``
  unknown characters costs ``(a**u + 1) / 2`` probes on average over an alphabet of ``a``,
  ``a**u`` at worst.  More than the worst case fails: the search repeats itself.
* L2: the reference solution's cost, measured (:data:`TIMING_REFERENCE_PPT`).  More than
  :data:`TIMING_BUDGET` times that fails.

A graded run (no ``seed``) attacks :data:`RUNS` fresh secrets, all served in turn by one lab server
that draws each itself, and must recover every one.  L1's score is the median over the secrets of
:func:`~.labs_prior.exhaustive_cost` (what an exhaustive search in the alphabet's order spends on
*that* secret) over the learner's probes: the luck of the draw cancels, so the reference scores
1.00x every time and a re-grade of the same code moves only as much as its own cost does from secret
to secret (:data:`SCORE_BANDS`).  Beside it the message prints the exhaustive search's expected and
worst cost per token (:func:`exhaustive_probes`).  L1 refuses, as impossible without a side door, a
run that recovers a secret with fewer probes than the blocks it spans, and a median below the
secrets' information (:func:`information_floor`: log2 of each block's candidates, one probe
answering one candidate).
"""
from __future__ import annotations

import math
import statistics
from contextlib import closing

from ._lab import HiddenServer, refuse, run_graded
from ._report import expect, grader
from .labs_prior import _blocks as blocks_of, exhaustive_cost  # L1's baseline on one secret: L4 prints it too

#: probes per token of solutions/lab2_timing.py on the lab's layout when every wrong candidate trails by
#: round 6 (blocks of 10, 100 and 10 candidates, six rounds and a flush each: 738 requests for 4 characters).
#: That is its usual cost; a wrong candidate that keeps up longer adds rounds (in 30,000 simulated secrets on
#: the virtual clock: mean 748, 99th percentile 832, at most 1,056 requests; none recovered wrong).
TIMING_REFERENCE_PPT = 738 / 4
TIMING_BUDGET = 4.0
#: secrets per graded run (served in turn by one lab server)
RUNS = 5
#: The band a re-grade of unchanged reference code stays in.  L1: the reference is the exhaustive search
#: its score divides by, on the same secrets, so 1.00x exactly (before the score compared against the
#: *expected* cost, four grades of the reference gave 1.23x, 1.43x, 1.46x and 2.67x and a fifth 0.85x: five
#: uniform draws narrow an exhaustive search's cost only so far).  L2: 738 requests on most secrets (1.00x),
#: more when a wrong candidate keeps up (the simulation's 99th percentile, 832, is 0.89x).
SCORE_BANDS = {"L1": (1.0, 1.0), "L2": (0.89, 1.0)}


def _blocks(card: dict) -> list[int]:
    """The number of unknown characters in each block the secret touches (labs_prior's block walk:
    the secret's characters do not matter, only its length)."""
    return [len(fill) for _, fill in blocks_of(card, "?" * card["secret_len"])]


def information_floor(card: dict) -> float:
    """The probes the secret's information needs on average: ``log2(a**u)`` for each block with
    ``u`` unknown characters, since one probe answers for one candidate of one block.  A lucky run
    can beat it; the median of :data:`RUNS` fresh secrets does so only by a fluke (the reference's
    exhaustive search needs (a**u + 1) / 2 per block on average, far above it)."""
    return sum(u * math.log2(len(card["alphabet"])) for u in _blocks(card))


def exhaustive_probes(card: dict) -> tuple[float, int]:
    """(expected, worst) probes of an exhaustive block-by-block search for ``card``'s layout."""
    expected, worst = 0.0, 0
    for u in _blocks(card):
        a = len(card["alphabet"]) ** u
        expected += (a + 1) / 2
        worst += a
    return expected, worst


def lab_runs(fn, mode: str, timeout: float, seed: int | None = None):
    """Yield (learner's answer, lab card, server's answer key, seconds) for each secret of a graded
    run: :data:`RUNS` of them (one for a fixed ``seed``), all from one lab server, which draws each
    secret itself after the previous attack is over (``--rounds``: no seed on its command line, which
    every process can read).  Stop iterating (or raise) and the server is killed."""
    why = refuse(fn)
    expect(why is None, str(why), "write the attack in its exercises/ file with OracleClient alone")
    rounds = RUNS if seed is None else 1
    args = ["--mode", mode, "--rounds", str(rounds)] + (["--seed", str(seed)] if seed is not None else [])
    with HiddenServer("minikv.grading.lab_server", *args) as srv:
        for i in range(rounds):
            card = srv.info
            guess, took = run_graded(fn, [card], timeout,
                                     error_hint="run it in the lesson against the demo server and read the traceback",
                                     timeout_hint="a search that never stops usually re-probes the same block forever")
            key = srv.reveal() if i == rounds - 1 else srv.next_round()
            yield guess, card, key, took


def _verdict(guess, card: dict, key: dict, lab: str) -> None:
    n, secret = card["secret_len"], key["secret"]
    expect(isinstance(guess, str) and len(guess) == n,
           f"extract returned {guess!r}; it must return a str of {n} characters",
           "return the recovered characters only, without the prefix or suffix")
    expect(key["requests"] > 0, "your attack never asked the oracle", "open OracleClient(card) and probe")
    if guess == secret:
        return
    first = next(i for i in range(n) if guess[i] != secret[i])
    why = f"recovered {guess!r}, the secret was {secret!r} (first wrong character at position {first})"
    mid = key.get("mid_block", 0)
    if lab == "L1" and mid and (mid + key["ends_on_block"]) * 2 >= key["requests"]:
        expect(False, why + f"; {mid + key['ends_on_block']} of your {key['requests']} probes stop inside or at the "
               "end of the character they test, never covering a whole block and going on (bug class: guessing "
               "character by character, ignoring blocks)",
               "what does the cache store a key for: one token, or a whole block?  Which probes can it answer?")
    if key["ends_on_block"] * 2 >= key["requests"] and key["max_victim_cached"] <= key["known_cached"]:
        expect(False, why + f"; {key['ends_on_block']} of your {key['requests']} probes end exactly where "
               "the block they test ends, and no probe ever hit a victim block past the known prefix",
               "the server always computes the last prompt token: what must a probe hold after the "
               "block it tests?")
    spans = len(_blocks(card))
    if lab == "L1" and spans > 1 and key["requests"] == spans:
        expect(False, why + f"; your attack took the first probe of each of the {spans} blocks as a hit, though "
               "that probe's cached tokens need not reach the end of the block it tests (bug class: hit threshold "
               "one block too low -- the known blocks before it pass the test alone)",
               "which cached_tokens count proves that the tested block itself was a hit, and not only the blocks "
               "before it?")
    if key["self_primed"]:
        expect(False, why + f"; {key['self_primed']} of your {key['requests']} answers came from your own "
               "earlier probes (self-priming)",
               "a text you already sent is in the shared cache as *your* entry: never trust a repeat "
               f"until {card['quota_blocks']} newer blocks of yours have pushed it out")
    if key["max_victim_cached"] <= key["known_cached"]:
        expect(False, why + "; no probe ever hit a victim block past the known prefix",
               "the server always computes the last prompt token: what must a probe hold after the "
               "block it tests?")
    expect(False, why, "check which characters share a block with the known prefix or suffix"
           if lab == "L1" else "take more samples per candidate before you drop any")


@grader("recover the secret block by block with cached_tokens; see the lab's docstring")
def check_oracle_attack(extract_secret, *, seed: int | None = None, timeout: float = 120.0) -> str:
    scores, per_token, took_all = [], [], 0.0
    with closing(lab_runs(extract_secret, "count", timeout, seed)) as runs:
        for guess, card, key, took in runs:
            _verdict(guess, card, key, "L1")
            expected, worst = exhaustive_probes(card)
            n, probes = card["secret_len"], key["requests"]
            expect(probes >= len(_blocks(card)), f"recovered the secret with {probes} probe(s), fewer than the "
                   f"{len(_blocks(card))} blocks it spans (each needs at least one probe that hits): impossible "
                   "through the oracle, so the answer came through a side door (bug class: side door -- not an "
                   "attack on the cache)", "attack through OracleClient alone: every answer must come from "
                   "cached_tokens.")
            expect(probes <= worst, f"recovered the secret, but with {probes} probes: an exhaustive search needs "
                   f"at most {worst}", "never send the same probe twice, and stop at the first hit")
            scores.append(exhaustive_cost(card, key["secret"]) / probes)
            per_token.append(probes / n)
            took_all += took
    floor = information_floor(card)
    expect(len(per_token) < RUNS or statistics.median(per_token) * n >= floor,
           f"recovered every secret with a median of {statistics.median(per_token) * n:.0f} probes, below the "
           f"{floor:.1f} the secrets' information needs (log2 of each block's candidates): no search through "
           "the oracle does that over several secrets, so the answers came through a side door (bug class: side "
           "door -- not an attack on the cache)", "attack through OracleClient alone: every answer must come "
           "from cached_tokens.")
    runs = f"median of {len(scores)} secrets; " if len(scores) > 1 else ""
    return (f"recovered {n} characters with {statistics.median(per_token):.1f} probes per token ({runs}exhaustive "
            f"search over such secrets: {expected / n:.1f} expected, {worst / n:.1f} worst; score "
            f"{statistics.median(scores):.2f}x against an exhaustive search on the same secrets), {took_all:.1f} s")


@grader("interleave repeats so that no probe is re-sent before it aged out; see the lab's docstring")
def check_timing_attack(extract_secret_by_timing, *, seed: int | None = None, timeout: float = 240.0) -> str:
    scores, per_token, primed, took_all = [], [], 0, 0.0
    with closing(lab_runs(extract_secret_by_timing, "ttft", timeout, seed)) as runs:
        for guess, card, key, took in runs:
            _verdict(guess, card, key, "L2")
            n, probes = card["secret_len"], key["requests"]
            budget = TIMING_BUDGET * TIMING_REFERENCE_PPT * n
            expect(probes <= budget, f"recovered the secret with {probes} probes, over the budget of {budget:.0f}",
                   "drop the slowest candidates after a few rounds instead of sampling all of them every time")
            scores.append(TIMING_REFERENCE_PPT * n / probes)
            per_token.append(probes / n)
            primed += key["self_primed"]
            took_all += took
    runs = f" (median of {len(scores)} secrets)" if len(scores) > 1 else ""
    return (f"recovered {n} characters from TTFT with {statistics.median(per_token):.1f} probes per token{runs} "
            f"(reference: {TIMING_REFERENCE_PPT:.0f}; score {statistics.median(scores):.2f}x), "
            f"{primed} answers self-primed, {took_all:.1f} s")
