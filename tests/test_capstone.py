"""The capstone (lesson 12): the mystery fleet, its grader, the reference audit.

A fleet runs in a subprocess behind HTTP; the audit runs in another one.  Seed 6 draws all four
misconfigurations (on nodes 0, 1, 2 and 4), so one run proves the reference audit finds each kind
and raises no false alarm on the clean node; ``make grade`` draws fresh seeds.
"""
from __future__ import annotations

import re

import pytest

import exercises.capstone_audit as ex
import solutions.capstone_audit as sol
from minikv.grading import capstone
from minikv.grading.mutants.labs import LAB_MUTANTS
from minikv.grading.mystery_fleet import KINDS, draw_fleet

ALL_FOUR = 6


def test_draw_fleet_is_a_random_subset_on_random_nodes():
    fleets = [draw_fleet(s) for s in range(60)]
    assert [n["kind"] for n in draw_fleet(ALL_FOUR)] == ["tenant_key_dropped", "first_block_only",
                                                        "shared_cache", None, "weak_hash"]
    for nodes in fleets:
        kinds = [n["kind"] for n in nodes if n["kind"]]
        assert 1 <= len(kinds) == len(set(kinds)) <= len(KINDS)  # one node per kind, at least one kind
    assert {len([n for n in f if n["kind"]]) for f in fleets} == {1, 2, 3, 4}
    for kind in KINDS:  # every kind lands on several different nodes across seeds
        assert len({[n["kind"] for n in f].index(kind) for f in fleets if kind in [n["kind"] for n in f]}) >= 3
    with pytest.raises(ValueError, match="num_nodes must be >= 4"):
        draw_fleet(0, num_nodes=3)


def test_compare_reports_found_missed_and_false_alarms():
    nodes = ["u0", "u1", "u2"]
    key = [{"node": "u0", "kind": "shared_cache"}, {"node": "u1", "kind": "weak_hash"}]
    got = [{"node": "u0", "kind": "shared_cache"}, {"node": "u1", "kind": "tenant_key_dropped"},
           {"node": "u2", "kind": "weak_hash"}]
    lines, missed, false = capstone.compare(got, key, nodes)
    assert (missed, false) == (1, 2)
    text = "\n".join(lines)
    assert "u0: shared_cache         found" in text and "u1: weak_hash            MISSED" in text
    assert "u1: tenant_key_dropped   FALSE ALARM" in text and "u2: weak_hash            FALSE ALARM" in text


def test_reference_audit_finds_all_four_kinds(capsys):
    ok = capstone.check_capstone(sol.audit_fleet, seed=ALL_FOUR)
    out = capsys.readouterr().out
    assert ok, out
    assert len(re.findall(r" found$", out, re.M)) == 4 and "(clean)              ok" in out
    assert "4 of 4 misconfigurations found, 0 false alarms" in out and "requests over 5 nodes" in out


def test_stub_fails_as_not_implemented(capsys):
    assert not capstone.check_capstone(ex.audit_fleet, seed=1)
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("name,fn,why", [
    ("isolation_only", LAB_MUTANTS["C"][0][1], "tenant_key_dropped   MISSED"),
    ("public_hits_are_leaks", LAB_MUTANTS["C"][1][1], "FALSE ALARM"),
    ("collision_across_tenants", LAB_MUTANTS["C"][2][1], "weak_hash            MISSED"),
])
def test_mutant_audits_get_per_finding_feedback(name, fn, why, capsys):
    assert not capstone.check_capstone(fn, seed=ALL_FOUR)
    out = capsys.readouterr().out
    assert why in out and "missed" in out, out
