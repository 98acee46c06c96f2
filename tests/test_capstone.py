"""The capstone (lesson 12): the mystery fleet, its grader, the reference audit.

A fleet runs in a subprocess behind HTTP; the audit runs in another one.  Seed 25 draws all five
misconfigurations (one per node), and seed 6 the four that lesson 12 shows (nodes 0, 1, 2, 4) with
a clean node 3, so two runs prove the reference audit finds each kind and raises no false alarm
on a clean node; ``make grade`` draws fresh seeds.
"""
from __future__ import annotations

import re

import pytest

import exercises.capstone_audit as ex
import solutions.capstone_audit as sol
from minikv.grading import capstone
from minikv.grading.mutants.labs import LAB_MUTANTS
from minikv.grading.mystery_fleet import GRADED_NODES, KINDS, draw_fleet, draw_graded_fleet

ALL_FOUR = 6    # lesson 12's demo fleet: the four visible kinds and a clean node
ALL_FIVE = 25   # the hidden client_salt_key too


def test_draw_fleet_is_a_random_subset_on_random_nodes():
    fleets = [draw_fleet(s) for s in range(60)]
    assert [n["kind"] for n in draw_fleet(ALL_FOUR)] == ["tenant_key_dropped", "first_block_only",
                                                        "shared_cache", None, "weak_hash"]
    for nodes in fleets:
        kinds = [n["kind"] for n in nodes if n["kind"]]
        assert 1 <= len(kinds) == len(set(kinds)) <= len(KINDS)  # one node per kind, at least one kind
    assert [n["kind"] for n in draw_fleet(ALL_FIVE)] == ["client_salt_key", "weak_hash", "tenant_key_dropped",
                                                        "shared_cache", "first_block_only"]
    assert {len([n for n in f if n["kind"]]) for f in fleets} == {1, 2, 3, 4, 5}
    for kind in KINDS:  # every kind lands on several different nodes across seeds
        assert len({[n["kind"] for n in f].index(kind) for f in fleets if kind in [n["kind"] for n in f]}) >= 3
    # the hidden kind is drawn last: adding it left every seed's visible kinds where they were
    assert [n["kind"] for n in draw_fleet(16)] == ["tenant_key_dropped", "shared_cache", None, "weak_hash",
                                                   "first_block_only"]
    assert sum("client_salt_key" in [n["kind"] for n in f] for f in fleets) >= 20
    with pytest.raises(ValueError, match="num_nodes must be >= 5"):
        draw_fleet(0, num_nodes=4)


def test_a_graded_fleet_carries_every_kind_and_a_clean_node():
    """What make grade audits: each kind at least once, so an audit missing any one test fails every
    grade, not 40% of them; 1 or 2 clean nodes, so the last kind is not named by elimination."""
    fleets = [[n["kind"] for n in draw_graded_fleet(s)] for s in range(200)]
    assert draw_graded_fleet(3) == draw_graded_fleet(3) and fleets[0] != fleets[1]
    assert GRADED_NODES == 7 and {len(f) for f in fleets} == {7}
    assert all(set(KINDS) <= set(f) for f in fleets)
    assert {f.count(None) for f in fleets} == {1, 2}
    for kind in KINDS:  # each kind on every node position somewhere in 200 fleets
        assert {i for f in fleets for i, k in enumerate(f) if k == kind} == set(range(GRADED_NODES))


def test_a_graded_run_fails_an_audit_that_never_tests_the_salt(capsys):
    """No seed: a graded fleet, drawn fresh.  The audit that lacks the cache_salt test misses
    client_salt_key on every such fleet (on lesson draws it passed whenever the kind was not drawn)."""
    fn = dict((n, f) for n, f, _ in LAB_MUTANTS["C"])["salt_per_tenant"]
    assert not capstone.check_capstone(fn)
    out = capsys.readouterr().out
    assert "client_salt_key      MISSED" in out and "requests over 7 nodes" in out, out


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


def test_reference_audit_finds_the_hidden_kind_with_the_other_four(capsys):
    ok = capstone.check_capstone(sol.audit_fleet, seed=ALL_FIVE)
    out = capsys.readouterr().out
    assert ok, out
    assert re.search(r"client_salt_key\s+found$", out, re.M), out
    assert "5 of 5 misconfigurations found, 0 false alarms" in out


def test_stub_fails_as_not_implemented(capsys):
    assert not capstone.check_capstone(ex.audit_fleet, seed=1)
    assert "not implemented yet" in capsys.readouterr().out


@pytest.mark.parametrize("name,fn,why", [
    ("isolation_only", LAB_MUTANTS["C"][0][1], "tenant_key_dropped   MISSED"),
    ("public_hits_are_leaks", LAB_MUTANTS["C"][1][1], "FALSE ALARM"),
    ("collision_across_tenants", LAB_MUTANTS["C"][2][1], "weak_hash            MISSED"),
    ("salt_per_tenant", LAB_MUTANTS["C"][3][1], "client_salt_key      MISSED"),
])
def test_mutant_audits_get_per_finding_feedback(name, fn, why, capsys):
    assert not capstone.check_capstone(fn, seed=ALL_FIVE if name == "salt_per_tenant" else ALL_FOUR)
    out = capsys.readouterr().out
    assert why in out and "missed" in out, out
