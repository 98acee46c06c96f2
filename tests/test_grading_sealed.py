"""Sealed grading (issue 37): four submissions that tampered with the old in-process gradebook.

Each attack hides its code in a string run by the standard ``code`` module, which the syntax gate
cannot see, so only the sealing stops it:

* ``exit_hook``: an exit hook that forges the result (a file beside the grader, the grader's own
  stdout through ``/proc``), on an unimplemented 1a;
* ``tenants``: shrinks ``minikv.grading.tenant_keys.TENANTS`` so that a ``str(tenant)`` key (the
  None/"None" collision) would pass 2a;
* ``proc_mem``: L1 by reading the lab server's secret from ``/proc/<pid>/mem``;
* ``monkeypatch``: replaces the 5a grader with one that always passes.

Each must score 0 on what it touched, with status ``tampering`` and a message that says so, while
the reference solutions score full marks on the same checks in the same gradebook run.
"""
from __future__ import annotations

import csv
import textwrap

import pytest

from minikv.grading.gradebook import WEIGHTS, grade_folder
from minikv.grading.make_exercises import SOLUTIONS, generate

IDS = ["1a", "2a", "5a", "L1"]


def _hidden(code: str) -> str:
    """Module text that runs ``code`` through ``code.InteractiveInterpreter`` (invisible to the gate)."""
    return ("import code\n\n_ns = {}\ncode.InteractiveInterpreter(_ns).runsource(" + repr(textwrap.dedent(code))
            + ", '<hidden>', 'exec')\n")


EXIT_HOOK = _hidden("""
    import atexit, json, os
    def _forge():
        forged = json.dumps({"results": {"1a": True}, "messages": {}, "statuses": {}, "error": ""})
        for path in ("../result.json", f"/proc/{os.getppid()}/fd/1"):
            try:
                with open(path, "w") as f:
                    f.write("\\n@@MINIKV-RESULT@@" + forged + "\\n")
            except OSError:
                pass
    atexit.register(_forge)
""")

TENANTS = _hidden("""
    import minikv.grading.tenant_keys as tk
    tk.TENANTS[:] = ["alice", "bob"]
""") + textwrap.dedent('''
    import hashlib
    import hmac


    def derive_tenant_key(engine_secret, tenant):
        if not isinstance(engine_secret, bytes):
            raise TypeError("bytes")
        if len(engine_secret) < 16:
            raise ValueError("short")
        return hmac.digest(engine_secret, str(tenant).encode(), hashlib.sha256)
''')

PROC_MEM = _hidden("""
    import os, re
    def extract_secret(card):
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if b"lab_server" not in open(f"/proc/{pid}/cmdline", "rb").read():
                    continue
                maps = open(f"/proc/{pid}/maps").read().splitlines()
                with open(f"/proc/{pid}/mem", "rb") as mem:
                    for line in maps:
                        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                        mem.seek(lo)
                        chunk = mem.read(min(hi - lo, 1 << 24))
                        m = re.search(re.escape(card["prefix"].encode()) + b"(.{%d})" % card["secret_len"], chunk)
                        if m:
                            return m.group(1).decode()
            except (OSError, ValueError):
                continue
        return card["alphabet"][0] * card["secret_len"]
""") + "\nextract_secret = _ns['extract_secret']\n"

MONKEYPATCH = _hidden("""
    import minikv.grading.stats as s
    s.check_ks_test = lambda *a, **k: True
""")


@pytest.fixture(scope="module")
def gradebook(tmp_path_factory):
    root = tmp_path_factory.mktemp("sealed")
    stubs = generate()
    attacks = {"exit_hook": ("ex1_chained_hash.py", stubs["ex1_chained_hash.py"] + EXIT_HOOK),
               "tenants": ("ex2_tenant_keys.py", stubs["ex2_tenant_keys.py"].split("def derive_tenant_key")[0]
                           + TENANTS),
               "proc_mem": ("lab1_prefix_oracle.py", PROC_MEM),
               "monkeypatch": ("ex5_timing_stats.py", stubs["ex5_timing_stats.py"] + MONKEYPATCH)}
    for student, (name, text) in attacks.items():
        (root / student).mkdir()
        (root / student / name).write_text(text, encoding="utf-8")
    (root / "reference").mkdir()
    for path in SOLUTIONS.glob("*.py"):
        (root / "reference" / path.name).write_text(path.read_text(encoding="utf-8"), encoding="utf-8")
    rows = {r.student: r for r in grade_folder(root, ids=IDS, progress=lambda *_: None)}
    with open(root / "gradebook.csv", encoding="utf-8") as f:
        table = {r["student"]: r for r in csv.DictReader(f)}
    return rows, table


@pytest.mark.parametrize("student,ex_id", [("exit_hook", "1a"), ("tenants", "2a"), ("proc_mem", "L1"),
                                           ("monkeypatch", "5a")])
def test_a_tampering_submission_scores_zero_and_is_named(gradebook, student, ex_id):
    rows, table = gradebook
    row = rows[student]
    assert row.results[ex_id] is False, row.messages[ex_id]
    assert row.statuses[ex_id] == "tampering", row.messages[ex_id]
    assert "tampering" in row.messages[ex_id]
    assert table[student][ex_id] == "0" and table[student]["status"] == "tampering"
    assert f"{ex_id}:tampering" in table[student]["not_passed"]


def test_the_reference_solutions_score_full_marks_beside_them(gradebook):
    rows, table = gradebook
    assert rows["reference"].status == "passed", rows["reference"].messages
    assert int(table["reference"]["points"]) == sum(WEIGHTS[e] for e in IDS) == int(table["reference"]["max_points"])
    assert float(table["reference"]["L1_score"]) > 0


def test_the_secret_stayed_out_of_reach(gradebook):
    rows, _ = gradebook
    msg = rows["proc_mem"].messages["L1"]
    assert "/mem" in msg or "/maps" in msg or "/cmdline" in msg, msg
    assert "recovered" not in msg.split("tampering")[0]  # never graded as a recovered secret
