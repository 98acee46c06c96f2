"""Grader of the capstone (lesson 12): audit a mystery fleet, compare with its answer key.

A fresh fleet (:mod:`minikv.grading.mystery_fleet`, new seed from ``os.urandom``, every kind on it
at least once: :func:`~.mystery_fleet.draw_graded_fleet`) runs in a subprocess behind HTTP; the
learner's ``audit_fleet(fleet)`` runs in another fresh process that receives only the fleet card (URLs and keys).  When it returns, the fleet prints its answer key
and the number of requests each node served.  Feedback is one line per finding:

* ``found``        -- the right kind on the right node;
* ``missed``       -- a misconfigured node not reported (or reported with another kind);
* ``false alarm``  -- a report for a clean node, or the wrong kind for a misconfigured one.

The grade passes when everything is found and nothing is a false alarm.
"""
from __future__ import annotations

from . import guard
from ._lab import HiddenServer, refuse, run_graded
from ._report import expect, grader
from .mystery_fleet import KINDS

CAPSTONE_RULES = {**guard.FORBIDDEN, "minikv.grading": "minikv.grading holds the fleet and its answer key",
                  "solutions": "solutions/ holds the reference audit"}


def compare(findings: list[dict], key: list[dict], nodes: list[str]) -> tuple[list[str], int, int]:
    """(feedback lines in node order, missed, false alarms)."""
    got = {(f["node"], f["kind"]) for f in findings}
    want = {(f["node"], f["kind"]) for f in key}
    lines, missed, false = [], 0, 0
    for i, node in enumerate(nodes):
        for n, kind in sorted(want | got):
            if n != node:
                continue
            if (n, kind) in want and (n, kind) in got:
                lines.append(f"  node {i} {node}: {kind:<20} found")
            elif (n, kind) in want:
                missed += 1
                lines.append(f"  node {i} {node}: {kind:<20} MISSED")
            else:
                false += 1
                lines.append(f"  node {i} {node}: {kind:<20} FALSE ALARM")
        if not any(n == node for n, _ in want | got):
            lines.append(f"  node {i} {node}: {'(clean)':<20} ok, nothing reported")
    return lines, missed, false


def run_capstone(audit_fleet, seed: int | None = None, timeout: float = 300.0):
    """(findings, fleet card, answer key, seconds) of one sealed audit of a fresh fleet.  Without a
    ``seed`` (a grade) the fleet carries every kind (:func:`~.mystery_fleet.draw_graded_fleet`), so
    no kind's test can go unexamined; a seed (lessons, tests) gives the lessons' draw, a random subset."""
    why = refuse(audit_fleet, CAPSTONE_RULES)
    expect(why is None, str(why), "audit with the public tools (minikv audit ..., minikv.audit.isolation_server, "
           "minikv.attacks.collisions) and HTTP only, in exercises/capstone_audit.py")
    args = ["--seed", str(seed)] if seed is not None else ["--graded"]
    with HiddenServer("minikv.grading.mystery_fleet", *args) as fleet:
        findings, took = run_graded(audit_fleet, [fleet.info], timeout,
                                    error_hint="run it in lesson 12 against the demo fleet first",
                                    timeout_hint="how many requests does each of your tests send per node, and which could send fewer?")
        key = fleet.reveal()
    return findings, fleet.info, key, took


@grader("audit every node: private prompts across tenants, the public prefix, a crafted collision, a shared salt")
def check_capstone(audit_fleet, *, seed: int | None = None, timeout: float = 300.0) -> str:
    findings, card, key, took = run_capstone(audit_fleet, seed, timeout)
    nodes = card["nodes"]
    expect(isinstance(findings, list) and all(isinstance(f, dict) and f.get("node") in nodes
                                              and f.get("kind") in KINDS for f in findings),
           f"audit_fleet returned {str(findings)[:120]}",
           f"return a list of {{'node': <a URL of fleet['nodes']>, 'kind': <one of {', '.join(KINDS)}>}}")
    lines, missed, false = compare(findings, key["findings"], nodes)
    print("\n".join(lines))
    requests = sum(key["requests"].values())
    cost = f"the audit took {took:.1f} s and {requests} requests over {len(nodes)} nodes"
    expect(missed == 0 and false == 0, f"{missed} missed, {false} false alarm(s); {cost}",
           "compare what each test shows on a node you know: lesson 12 runs each test on a demo fleet")
    return f"{len(key['findings'])} of {len(key['findings'])} misconfigurations found, 0 false alarms; {cost}"
