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

A fifth, ``cmdline``, goes round the child's tampering detector (``ls`` and ``cat`` read the lab
server's ``/proc/<pid>/cmdline`` for it, so no ``open`` of ``/proc`` is seen; the child's Landlock
reads, which close ``/proc``, stop them) and would derive L1's secret from a
``--seed`` there, padding its probes past the side-door checks.  Graded runs pass no seed (the lab
server draws every secret itself), so it finds none and fails like any wrong guess; against a server
started with a seed, as the lessons start theirs, it recovers the secret, so the attack is real.
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

CMDLINE = _hidden("""
    import os, subprocess
    import numpy as np
    from minikv.audit.oracle_client import OracleClient
    def extract_secret(card):
        a, n, seen, candidates = card["alphabet"], card["secret_len"], False, []
        listed = subprocess.run(["ls", "/proc"], capture_output=True, text=True).stdout.split()
        for pid in filter(str.isdigit, listed):
            argv = subprocess.run(["cat", f"/proc/{pid}/cmdline"], capture_output=True).stdout.split(b"\\0")
            if b"minikv.grading.lab_server" not in argv:
                continue
            seen = True
            if b"--seed" in argv:  # lab_server.draw_secret, redone with numpy alone
                rng = np.random.default_rng(int(argv[argv.index(b"--seed") + 1]))
                candidates.append("".join(a[i] for i in rng.integers(0, len(a), n)))
        with OracleClient(card) as oracle:
            # several servers run at once in a parallel gradebook: the oracle says which is ours
            for secret in candidates:
                if oracle.cached_tokens(card["prefix"] + secret + "#") >= len(card["prefix"]) + n - 1:
                    for i in range(16):  # enough probes to pass for a search
                        oracle.cached_tokens(card["prefix"] + secret[: 1 + i % 4] + "#" * (i + 1))
                    return secret
            if seen:  # the server is there, but no seed: one probe, a guess
                oracle.cached_tokens(card["prefix"] + "#")
                return a[0] * n
        return ""  # not even the servers' command lines were readable
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
               "monkeypatch": ("ex5_timing_stats.py", stubs["ex5_timing_stats.py"] + MONKEYPATCH),
               "cmdline": ("lab1_prefix_oracle.py", CMDLINE)}
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
    assert "listed /proc" in msg or "/mem" in msg or "/maps" in msg or "/cmdline" in msg, msg
    assert "recovered" not in msg.split("tampering")[0]  # never graded as a recovered secret


def test_a_seed_on_the_lab_servers_command_line_would_be_the_secret_and_graded_runs_pass_none(gradebook):
    rows, table = gradebook
    msg = rows["cmdline"].messages["L1"]
    assert rows["cmdline"].results["L1"] is False and table["cmdline"]["L1"] == "0", msg
    # ls and cat ran in the sealed child, out of its detector's sight, but Landlock closes /proc to
    # them: no server found, no seed, nothing recovered (and graded runs pass no seed anyway)
    assert rows["cmdline"].statuses["L1"] == "failed" and "extract returned ''" in msg, msg
    # the same code against a server with a seed on its command line (how lessons start theirs)
    from minikv.grading._lab import HiddenServer
    ns = {}
    exec(compile(CMDLINE, "<cmdline>", "exec"), ns)
    with HiddenServer("minikv.grading.lab_server", "--mode", "count", "--seed", "5") as srv:
        guess = ns["extract_secret"](srv.info)
        key = srv.reveal()
    assert guess == key["secret"] and key["requests"] >= 14, (guess, key)


# -- the walls themselves, one submission at a time -------------------------------------------------

_CHILD = r"""
import json, os, sys
out = {}
for name, path in (("inside", sys.argv[1]), ("outside", sys.argv[2])):
    try:
        with open(path, "w") as f:
            f.write("overwritten by learner code")
        out[name] = "wrote"
    except OSError as exc:
        out[name] = f"refused {exc.errno}"
try:
    os.kill(int(sys.argv[3]), 0)  # signal 0: only asks whether this process could signal the grader
    out["signal"] = "allowed"
except OSError as exc:
    out["signal"] = f"refused {exc.errno}"
print(json.dumps(out))
"""


def _child_as_sealed(tmp_path, writable):
    import functools
    import json
    import os
    import subprocess
    import sys

    from minikv.grading._sandbox import _limits

    (tmp_path / "mine").mkdir(exist_ok=True)
    canary = tmp_path / "grader_owned.py"
    canary.write_text("ORIGINAL = True\n")
    p = subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "mine" / "scratch.txt"), str(canary), str(os.getpid())],
                       preexec_fn=functools.partial(_limits, writable), capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout), canary.read_text()


def test_a_sealed_child_cannot_write_outside_its_folder_nor_signal_its_grader(tmp_path):
    from minikv.grading._sandbox import landlock_abi

    if landlock_abi() == 0:
        pytest.skip("this kernel has no Landlock (Linux 5.13+): `minikv grade` says so in its isolation line")
    seen, canary = _child_as_sealed(tmp_path, str(tmp_path / "mine"))
    assert seen["inside"] == "wrote", seen  # its own temporary folder stays usable
    assert seen["outside"].startswith("refused") and canary == "ORIGINAL = True\n", seen
    if landlock_abi() >= 6:
        assert seen["signal"].startswith("refused"), seen


def test_without_landlock_a_uid0_child_could_rewrite_the_graders_files(tmp_path):
    # the control: the same child with every capability dropped but no Landlock.  As uid 0 it still
    # owns root's files, so it rewrites one: the gap the ruleset closes (as a second user, DAC does)
    import os

    if os.geteuid() != 0:
        pytest.skip("the gap is a uid-0 child's; this grader is not root")
    seen, canary = _child_as_sealed(tmp_path, None)
    assert seen["outside"] == "wrote" and canary.startswith("overwritten"), seen


_READER = r"""
import json, os, subprocess, sys
out = {}
for name, path in json.loads(sys.argv[1]).items():
    try:
        with open(path, "rb") as f:
            f.read(1)
        out[name] = "read"
    except OSError as exc:
        out[name] = f"refused {exc.errno}"
try:
    subprocess.run(["true"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    out["devnull"] = "wrote"
except OSError as exc:
    out["devnull"] = f"refused {exc.errno}"
print(json.dumps(out))
"""


def test_a_sealed_child_reads_only_the_interpreter_the_given_modules_and_its_own_folder(tmp_path):
    """Landlock's read rights (:mod:`minikv.grading._reads`): solutions/, the reference modules, the
    graders, a neighbour's staged file and other processes' /proc entries are closed; the given
    modules, the interpreter's libraries and the child's own folder stay open, and /dev/null
    takes writes (a tool run with ``stderr=subprocess.DEVNULL``)."""
    import functools
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from minikv.grading import _reads, runner, sealed_run
    from minikv.grading._sandbox import _limits, landlock_abi

    if landlock_abi() == 0:
        pytest.skip("this kernel has no Landlock (Linux 5.13+): `minikv grade` says so in its isolation line")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "work.py").write_text("x = 1\n")
    neighbour = tmp_path / "neighbour.py"
    neighbour.write_text("x = 2\n")
    minikv = _reads.MINIKV
    paths = {"own": mine / "work.py", "solutions": SOLUTIONS / "ex1_chained_hash.py", "neighbour": neighbour,
             "security": minikv / "security" / "hashing.py", "stats": minikv / "audit" / "stats.py",
             "grader": minikv / "grading" / "stats.py", "proc": f"/proc/{os.getpid()}/cmdline",
             "harness": minikv / "grading" / "harness.py", "trail": minikv / "audit" / "trail.py",
             "stdlib": Path(json.__file__), "engine": minikv / "engine" / "sampling.py"}
    reads = _reads.read_rules(_reads.closed_paths(sealed_run.closed_modules(runner.EXERCISES[0])))
    p = subprocess.run([sys.executable, "-c", _READER, json.dumps({k: str(v) for k, v in paths.items()})],
                       preexec_fn=functools.partial(_limits, str(mine), reads), capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    seen = json.loads(p.stdout)
    opened = {k for k, v in seen.items() if v in ("read", "wrote")}
    assert opened == {"own", "harness", "trail", "stdlib", "engine", "devnull"}, seen


def test_a_graded_lab_server_counts_only_its_own_attackers_requests():
    """Another submission's code can find a lab server's port (a scan of loopback is enough), so a
    graded server draws its own attacker key and counts only requests that carry it: the public
    key of the lessons, or none, adds nothing to the count its grade reads."""
    import httpx

    from minikv.grading._lab import HiddenServer
    from minikv.grading.lab_server import ATTACKER_KEY

    with HiddenServer("minikv.grading.lab_server", "--mode", "count") as srv:
        card = srv.info
        assert card["api_key"] != ATTACKER_KEY and len(card["api_key"]) > 24
        body = {"model": card["model"], "prompt": card["prefix"] + "0#", "max_tokens": 1}
        codes = [httpx.post(card["base_url"] + "/completions", json=body, timeout=60,
                            headers={"Authorization": f"Bearer {key}"}).status_code
                 for key in (ATTACKER_KEY, card["api_key"], "sk-lab-someone-else")]
        key = srv.reveal()
    assert codes == [401, 200, 401] and key["requests"] == 1, (codes, key)


def test_bytecode_beside_the_graders_closes_theirs_and_leaves_the_harness_readable():
    """A ``minikv/grading/__pycache__`` left by an earlier run must not close the harness's own
    bytecode: the sealed child imports the harness, and Python looks for its ``.pyc`` first, so a
    closed ``__pycache__`` folder made every right 3b submission read as tampering."""
    import os
    import py_compile

    from minikv.grading import _reads
    grading = _reads.MINIKV / "grading"
    py_compile.compile(str(grading / "hashing.py"), doraise=True)  # the folder exists, as after any run
    cache = grading / "__pycache__"
    closed = _reads.closed_paths(["minikv.security.scrub"])
    assert os.path.realpath(cache) not in closed
    assert _reads.is_closed(str(cache / "hashing.cpython-311.pyc"), closed)  # a grader's bytecode: closed
    assert not _reads.is_closed(str(cache / "harness.cpython-311.pyc"), closed)  # the harness's: open
    assert _reads.is_closed(str(grading / "hashing.py"), closed)
