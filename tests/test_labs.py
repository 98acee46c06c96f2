"""The attack labs (L1 count oracle, L2 timing oracle, L3 probing detector, L4 ranked guesser): each grader accepts
the reference solution, rejects the untouched stub and every mutant, and names the right class
of bug.  Attack labs run a victim's server in a subprocess and the attack in another one.

Seeds are fixed here so a failure can be replayed; ``make grade`` draws fresh ones.
"""
from __future__ import annotations

import itertools
import math
import re

import pytest

import exercises.lab1_prefix_oracle as ex1
import exercises.lab3_detector as ex3
import exercises.lab4_ranked_guesser as ex4
import solutions.lab1_prefix_oracle as sol1
import solutions.lab2_timing as sol2
import solutions.lab3_detector as sol3
import solutions.lab4_ranked_guesser as sol4
from minikv.grading import labs_detector, labs_oracle, labs_prior
from minikv.grading._lab import forbidden_imports
from minikv.grading.mutants import labs as mutants


def run(check, fn, capsys, **kw):
    ok = check(fn, **kw)
    return ok, capsys.readouterr().out


def test_exhaustive_baseline_matches_the_layout():
    card = dict(block_size=2, secret_len=4, alphabet="0123456789", prefix="Vault PIN: ")
    # blocks: 1 unknown (after 'Vault PIN:' + ' '), then 2, then 1 (+ the suffix's first char)
    assert labs_oracle.exhaustive_probes(card) == ((11 / 2) + (101 / 2) + (11 / 2), 120)
    assert labs_oracle.exhaustive_probes({**card, "prefix": "PIN:"}) == (2 * 101 / 2, 200)


def test_l1_solution_passes_and_reports_its_score(capsys):
    ok, out = run(labs_oracle.check_oracle_attack, sol1.extract_secret, capsys, seed=11)
    assert ok, out
    assert "per token" in out and "exhaustive search" in out


def test_l1_stub_fails_as_not_implemented(capsys):
    ok, out = run(labs_oracle.check_oracle_attack, ex1.extract_secret, capsys, seed=11)
    assert not ok and "not implemented yet" in out


@pytest.mark.parametrize("name,fn,why", [
    ("no_filler", mutants.oracle_no_filler, "last prompt token"),
    ("double_check", mutants.oracle_double_check, "self-priming"),
    ("hard_coded", mutants.oracle_hard_coded, "the secret was"),
    ("char_by_char", mutants.oracle_char_by_char, "character by character"),
    ("threshold_one_block_low", mutants.oracle_threshold_one_block_low, "hit threshold one block too low"),
])
def test_l1_rejects_mutants_with_the_right_diagnosis(name, fn, why, capsys):
    ok, out = run(labs_oracle.check_oracle_attack, fn, capsys, seed=11)
    assert not ok, out
    assert why in out, out


def test_timing_solution_recovers_the_secret_at_the_published_cost(capsys):
    """Through the real lab server, two secrets: each recovered with no answer from the reference's own
    entries, at its usual cost (TIMING_REFERENCE_PPT) or above it when a wrong candidate keeps up, never
    below.  (The median over many secrets is the usual cost: the simulation test below.)"""
    usual = labs_oracle.TIMING_REFERENCE_PPT
    for seed in (3, 4):
        ok, out = run(labs_oracle.check_timing_attack, sol2.extract_secret_by_timing, capsys, seed=seed)
        assert ok, out
        assert "0 answers self-primed" in out, out
        ppt = float(re.search(r"with (\d+\.\d+) probes per token", out).group(1))
        assert usual <= ppt <= labs_oracle.TIMING_BUDGET * usual, out


def _simulated_timing_attack(extract, seed: int) -> tuple[bool, int]:
    """``extract`` against an in-process stand-in of the lab's ttft server: the same VirtualClock,
    layout and flushes, no engine (a hit is decided by comparing text with the victim's), so
    thousands of secrets take seconds.  (recovered?, requests)."""
    import numpy as np
    from contextlib import contextmanager
    from minikv.grading import lab_server as ls

    rng = np.random.default_rng(seed)
    secret = ls.draw_secret(rng)
    victim = ls.PREFIX + secret + ls.SUFFIX
    clock, bs = ls.VirtualClock(seed=seed + 1), ls.BLOCK_SIZE
    sent = [0]

    class Oracle:
        def ttft_ms(self, text):
            sent[0] += 1
            same = 0
            while same < min(len(text), len(victim)) and text[same] == victim[same]:
                same += 1
            cached = min(same // bs * bs, (len(text) - 1) // bs * bs)  # whole blocks, never the last token
            return clock.ttft_ms(len(text) - cached)

    @contextmanager
    def client(card):
        yield Oracle()

    card = {"block_size": bs, "secret_len": ls.SECRET_LEN, "alphabet": ls.ALPHABET, "prefix": ls.PREFIX,
            "suffix": ls.SUFFIX, "quota_blocks": ls.QUOTA,
            "virtual_clock": {"per_token_ms": clock.per_token_ms, "noise_ms": clock.noise_ms}}
    orig = sol2.OracleClient
    sol2.OracleClient = client
    try:
        return extract(card) == secret, sent[0]
    finally:
        sol2.OracleClient = orig


def test_timing_solution_is_reliable_over_many_secrets():
    """CI grades the reference on fresh secrets every run, so it must be (nearly) never wrong: 300 seeded
    secrets on the lab's virtual clock, every one recovered, at the published cost or a little above."""
    costs = []
    for seed in range(300):
        ok, cost = _simulated_timing_attack(sol2.extract_secret_by_timing, 1000 + seed)
        assert ok, f"seed {1000 + seed}: the reference recovered a wrong secret"
        costs.append(cost)
    usual = round(labs_oracle.TIMING_REFERENCE_PPT * 4)
    assert min(costs) == usual and sorted(costs)[len(costs) // 2] == usual, sorted(costs)[:5]
    assert max(costs) <= labs_oracle.TIMING_BUDGET * usual, max(costs)


@pytest.mark.parametrize("name,fn,why", [
    ("back_to_back", mutants.timing_back_to_back, "self-priming"),
    ("rounds_no_flush", mutants.timing_rounds_no_flush, "self-priming"),
    ("hard_coded", mutants.timing_hard_coded, "the secret was"),
])
def test_l2_rejects_mutants_with_the_right_diagnosis(name, fn, why, capsys):
    ok, out = run(labs_oracle.check_timing_attack, fn, capsys, seed=3)
    assert not ok, out
    assert why in out, out


def test_the_information_floor_and_the_mid_block_probe():
    """L1's floor is log2 of each block's candidates (one probe answers one candidate); a probe is a
    character-by-character guess when it stops inside the block it tests or re-tests a candidate."""
    from minikv.grading import lab_server
    card = {"block_size": 2, "secret_len": 4, "alphabet": "0123456789", "prefix": "Vault PIN: "}
    assert labs_oracle._blocks(card) == [1, 2, 1]  # unknown digits per block
    assert labs_oracle.information_floor(card) == pytest.approx(4 * math.log2(10))
    card["block_size"] = 4  # the prefix ends mid-block: 1 unknown, then 3
    assert labs_oracle._blocks(card) == [1, 3]
    victim, seen = "Vault PIN: 4821. Keep it safe.", {}
    assert lab_server.BLOCK_SIZE == 2
    block_wise = ["Vault PIN: 3#", "Vault PIN: 4#", "Vault PIN: 480.", "Vault PIN: 482.", "Vault PIN: 4821#"]
    assert [lab_server._mid_block(p, victim, seen) for p in block_wise] == [False] * 5
    assert lab_server._mid_block("Vault PIN: 4", victim, seen) is False  # ends on a boundary: counted apart
    assert lab_server._mid_block("Vault PIN: 48", victim, seen) is True  # stops inside block [12, 14)
    assert lab_server._mid_block("Vault PIN: 47", victim, seen) is True  # re-tests candidate '4' of [10, 12)
    assert labs_oracle.RUNS >= 5


def test_a_graded_lab_run_serves_fresh_secrets_from_one_server_with_no_seed_on_its_command_line():
    """The rounds protocol (lab_server.main): one server, a fresh secret per round, drawn inside it.
    Nothing about a secret may sit on the server's command line: /proc/<pid>/cmdline is readable by
    every process, the learner's sealed child included, and a seed there would be the secret."""
    from minikv.grading._lab import HiddenServer
    from minikv.audit.oracle_client import OracleClient
    with HiddenServer("minikv.grading.lab_server", "--mode", "count", "--rounds", "3") as srv:
        cmdline = open(f"/proc/{srv.proc.pid}/cmdline", "rb").read().split(b"\0")
        assert b"--seed" not in cmdline, cmdline
        cards, keys = [], []
        for i in range(3):
            cards.append(srv.info)
            with OracleClient(srv.info) as oracle:
                oracle.cached_tokens(srv.info["prefix"] + "0#")
            keys.append(srv.reveal() if i == 2 else srv.next_round())
    assert [c["round"] for c in cards] == [1, 2, 3] and len({c["base_url"] for c in cards}) == 3
    assert [k["requests"] for k in keys] == [1, 1, 1]  # each round counts its own attacker only
    assert len({k["secret"] for k in keys}) >= 2  # 3 draws of 10**4 secrets: a repeat is a 3e-4 fluke
    assert all(len(k["secret"]) == 4 and k["secret"].isdigit() for k in keys)


def test_l1_score_is_against_an_exhaustive_search_on_the_same_secrets(capsys):
    """A graded run (fresh secrets): the reference *is* the exhaustive search in the alphabet's order,
    so it scores exactly 1.00x whatever the draw (SCORE_BANDS)."""
    card = dict(block_size=2, secret_len=4, alphabet="0123456789", prefix="Vault PIN: ")
    assert labs_oracle.exhaustive_cost(card, "0000") == 3 and labs_oracle.exhaustive_cost(card, "9999") == 120
    assert labs_oracle.exhaustive_cost(card, "1230") == 2 + 24 + 1
    ok, out = run(labs_oracle.check_oracle_attack, sol1.extract_secret, capsys)
    assert ok, out
    assert "median of 5 secrets" in out and "score 1.00x against an exhaustive search on the same secrets" in out
    assert labs_oracle.SCORE_BANDS["L1"] == (1.0, 1.0)


def test_every_lab_check_has_at_least_three_mutants():
    assert {lab: len(cases) >= 3 for lab, cases in mutants.LAB_MUTANTS.items()} == \
        {"L1": True, "L2": True, "L3": True, "L4": True, "C": True}


def test_forbidden_imports_are_refused(tmp_path, monkeypatch, capsys):
    mod = tmp_path / "cheat_lab.py"
    mod.write_text("from minikv.attacks.prefix_oracle import recover_secret_by_count\n"
                   "import solutions.lab1_prefix_oracle\n"
                   "def extract_secret(card):\n    return '0000'\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import cheat_lab
    assert forbidden_imports(cheat_lab.extract_secret) == ["minikv.attacks.prefix_oracle",
                                                           "solutions.lab1_prefix_oracle"]
    ok, out = run(labs_oracle.check_oracle_attack, cheat_lab.extract_secret, capsys, seed=1)
    assert not ok and "which the grader forbids" in out and "reference oracle attack" in out


def test_notebook_functions_are_refused_with_a_reason(capsys):
    def extract_secret(card):
        return "0000"
    ok, out = run(labs_oracle.check_oracle_attack, extract_secret, capsys, seed=1)
    assert not ok and "exercises/ file" in out


# ----------------------------------------------------------------------------- L3 detector
def test_mixed_trail_roles_and_reference():
    records, roles = labs_detector.mixed_trail(7)
    kinds = set(roles.values())
    assert {"victim", "attacker", "benign:retry", "benign:chat", "benign:faq", "benign:popular"} <= kinds
    caught, attackers, fp, benign = labs_detector.score(labs_detector.reference_flags(records), roles)
    assert attackers >= 2 and caught == attackers and fp == 0  # the reference is the bar: it must be met
    assert labs_detector.workload(7)[1] != labs_detector.workload(8)[1]  # names/roles change with the seed


def test_l3_solution_passes_and_stub_fails(capsys):
    ok, out = run(labs_detector.check_detector, sol3.detect_probing, capsys, seeds=[1, 2])
    assert ok, out
    assert "false positives" in out and "reference" in out
    ok, out = run(labs_detector.check_detector, ex3.detect_probing, capsys, seeds=[1])
    assert not ok and "not implemented yet" in out


@pytest.mark.parametrize("name,fn,why", [
    ("counts_requests", mutants.detect_counts_requests, "retry loop"),
    ("across_tenants", mutants.detect_across_tenants, "per tenant"),
    ("prefix_only", mutants.detect_prefix_only, "within one block"),
    ("exact_prefix", mutants.detect_exact_prefix, "attackers, the reference catches"),
    ("more_than_threshold", mutants.detect_more_than_threshold, "the threshold boundary"),
    ("flags_victim", mutants.detect_flags_victim, "(victim)"),
])
def test_l3_rejects_mutants_with_the_right_diagnosis(name, fn, why, capsys):
    ok, out = run(labs_detector.check_detector, fn, capsys, seeds=[1, 2])
    assert not ok, out
    assert why in out, out


# ----------------------------------------------------------------------------- L4 ranked guesser
def test_l4_prior_and_costs_are_exact():
    """The bigram table is a distribution per context; the secrets of the fixed seeds never change; the
    reference and exhaustive figures are 1 + the true filling's rank in each order, block by block."""
    table = labs_prior.prior()
    assert set(table) == set(labs_prior.ALPHABET)
    assert all(abs(sum(row.values()) - 1) < 1e-3 and min(row.values()) > 0 for row in table.values())
    assert labs_prior.draw_secret(11) == labs_prior.draw_secret(11) == "e sea "
    card = {"prefix": "Note 0: ", "block_size": 2, "alphabet": labs_prior.ALPHABET, "prior": table}
    # "aa" is the alphabet's first filling; " " is its last character
    assert labs_prior.exhaustive_cost(card, "aa") == 1 and labs_prior.exhaustive_cost(card, "a ") == 10
    assert labs_prior.exhaustive_cost(card, "aaaa") == 2 and labs_prior.exhaustive_cost(card, "  ") == 100
    likeliest = max(("".join(p) for p in itertools.product(labs_prior.ALPHABET, repeat=2)),
                    key=lambda g: table[" "][g[0]] * table[g[0]][g[1]])
    assert labs_prior.ranked_cost(card, likeliest) == 1
    # a block with one unknown (the prefix ends mid-block): the ranking is over single characters
    first = max(labs_prior.ALPHABET, key=lambda c: table[" "][c])
    assert next(labs_prior._blocks({**card, "prefix": "Note 0:  "}, "abc"))[1] == "a"
    assert labs_prior.ranked_cost({**card, "prefix": "Note 0:  "}, first) == 1  # 9 characters


def test_l4_solution_passes_at_the_reference_figure(capsys):
    ok, out = run(labs_prior.check_ranked_guesser, sol4.guess_secret, capsys)  # fresh secrets, as graded
    assert ok, out
    m = re.search(r"median (\d+\.\d+) probes/token \(reference (\d+\.\d+), exhaustive (\d+\.\d+)\)", out)
    assert m and m.group(1) == m.group(2), out  # on whatever secrets were drawn, the reference's own figure
    assert "score 1.00x" in out


def test_l4_stub_fails_as_not_implemented(capsys):
    ok, out = run(labs_prior.check_ranked_guesser, ex4.guess_secret, capsys)
    assert not ok and "not implemented yet" in out


@pytest.mark.parametrize("name,fn,doc", mutants.LAB_MUTANTS["L4"], ids=[n for n, _, _ in mutants.LAB_MUTANTS["L4"]])
def test_l4_rejects_mutants_with_the_right_diagnosis(name, fn, doc, capsys):
    ok, out = run(labs_prior.check_ranked_guesser, fn, capsys, seeds=labs_prior.SEEDS)  # the seeds their figures were measured on
    assert not ok, out
    assert out.startswith("❌ check_ranked_guesser failed: ") and mutants.L4_DIAGNOSES[name] in out, out


#: five secrets on which the first-character ranking's MEDIAN cost is 1.48x the reference's (inside a 1.5x band
#: on medians) while its total is 3.3x: a lucky draw of the kind a graded run can make
FIRST_CHAR_LUCKY = (17, 70, 154, 325, 378)


def test_l4_band_rejects_a_first_character_ranking_on_a_lucky_draw(capsys):
    """The band is on the probes summed over the victims: on secrets where the median let the first-character
    ranking through, it is rejected as a wrong ranking key; the reference on the same secrets scores 1.00x."""
    first_char = dict((n, f) for n, f, _ in mutants.LAB_MUTANTS["L4"])["first_char_only"]
    ok, out = run(labs_prior.check_ranked_guesser, first_char, capsys, seeds=FIRST_CHAR_LUCKY)
    assert not ok and "wrong ranking key" in out, out
    m = re.search(r"median (\d+\.\d+) probes/token \(reference (\d+\.\d+)", out)
    assert m and float(m.group(1)) <= 1.5 * float(m.group(2)), out  # the draw is lucky: medians alone let it by
    ok, out = run(labs_prior.check_ranked_guesser, sol4.guess_secret, capsys, seeds=FIRST_CHAR_LUCKY)
    assert ok and "score 1.00x" in out, out


@pytest.mark.parametrize("seeds", [labs_prior.SEEDS, FIRST_CHAR_LUCKY], ids=["SEEDS", "lucky"])
def test_l4_band_accepts_a_right_ranking_that_is_not_the_reference(seeds, capsys):
    """Fillings of equal probability may come in any order: the band leaves room for that."""
    from minikv.grading.mutants.guessers import guesser_ties_reversed
    ok, out = run(labs_prior.check_ranked_guesser, guesser_ties_reversed, capsys, seeds=seeds)
    assert ok, out
