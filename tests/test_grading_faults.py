"""When the grader's own machinery fails, the learner is not blamed and the gradebook says "error".

A CI run failed the capstone's reference audit with "your code raised TimeoutExpired": the mystery
fleet, stalled in ``import torch`` beside a busy vLLM pinned to core 0 (``_lab.HiddenServer.reveal``
says why), had not stopped within 60 s of the audit, and the clean-up's own 10 s wait then raised
over the real error.  The audit was fine.
"""
from __future__ import annotations

import textwrap

import pytest

from minikv.grading import _lab, capstone, runner
from minikv.grading._report import GraderFault, expect, grader
from minikv.serve.background import stop_all


@grader("hint")
def check_thing(mode: str) -> str:
    if mode == "fault":
        raise GraderFault("the lab server did not stop within 1 s")
    expect(mode == "ok", "wrong answer", "fix it")
    return "fine"


def test_a_grader_fault_is_no_verdict_on_the_code_and_is_recorded(capsys):
    assert check_thing("fault") is False
    out = capsys.readouterr().out
    assert "could not grade: the lab server did not stop within 1 s" in out
    assert "your code" not in out.split("Hint")[0] and "not a verdict on your code" in out
    assert check_thing.last_fault == "the lab server did not stop within 1 s"
    # the next call starts clean: a fault never sticks to a later verdict
    assert check_thing("ok") is True and check_thing.last_fault is None
    assert check_thing("bad") is False and check_thing.last_fault is None


@pytest.fixture
def deaf_server(tmp_path, monkeypatch):
    """A "lab server" that prints its card and then ignores its stdin closing."""
    (tmp_path / "deaf_lab.py").write_text(textwrap.dedent("""
        import json, time
        print(json.dumps({"nodes": []}), flush=True)
        time.sleep(600)
    """))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "deaf_lab"


def test_a_server_that_will_not_stop_is_a_grader_fault_and_is_killed(deaf_server):
    srv = _lab.HiddenServer(deaf_server)
    assert srv.info == {"nodes": []}
    with pytest.raises(GraderFault, match=r"did not stop within 1 s"):
        srv.reveal(timeout=1)
    assert srv.proc.poll() is not None, "the server was left running"
    srv.close()  # closing again is harmless and raises nothing


def test_a_server_that_dies_on_start_is_a_grader_fault(tmp_path, monkeypatch):
    (tmp_path / "dead_lab.py").write_text("import sys; sys.exit('no port for you')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    with pytest.raises(GraderFault, match=r"dead_lab did not start \(exit 1\): no port for you"):
        _lab.HiddenServer("dead_lab")


def test_the_gradebook_status_of_a_grader_fault_is_error(deaf_server, monkeypatch, capsys):
    """The capstone's fleet replaced by one that never stops: the reference audit is graded
    "error" (regrade), not "failed", and the message names the fleet, not the audit."""
    real = _lab.HiddenServer

    class Stubborn(real):
        def __init__(self, module, *args, **kw):
            super().__init__(deaf_server)

        def reveal(self, timeout=180.0):
            return super().reveal(timeout=1)

    monkeypatch.setattr(capstone, "HiddenServer", Stubborn)
    monkeypatch.setattr(capstone, "run_graded", lambda fn, args, *a, **k: ([], 0.1))  # the audit: found nothing
    ex = next(e for e in runner.EXERCISES if e.id == "C")
    ok, text, status = runner.grade_one_status(ex, "solutions", quiet=True)
    assert (ok, status) == (False, "error"), text
    assert "check_capstone could not grade: the lab server did not stop within 1 s" in text


def test_a_fault_of_an_earlier_grade_never_marks_a_later_one(tmp_path, monkeypatch):
    """A check that cannot even start (the learner's module does not import) is "failed", even
    right after the same check recorded a fault: the status is this grade's, never the last one's."""
    ex = next(e for e in runner.EXERCISES if e.id == "C")
    pkg = tmp_path / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / f"{ex.module}.py").write_text("raise ImportError('this module is broken on purpose')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(ex.check, "last_fault", "the lab server did not stop within 1 s")  # an earlier grade's
    ok, text, status = runner.grade_one_status(ex, "brokenpkg", quiet=True)
    assert (ok, status) == (False, "failed"), text
    assert "cannot import brokenpkg" in text and "broken on purpose" in text


class _Recorder:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def signal_stop(self):
        self.log.append(("signal", self.name))

    def stop(self, timeout=30.0):
        self.log.append(("join", self.name))


def test_stop_all_signals_every_server_before_waiting_for_any():
    log: list = []
    stop_all([_Recorder(log, i) for i in range(3)])
    assert log == [("signal", 0), ("signal", 1), ("signal", 2), ("join", 0), ("join", 1), ("join", 2)]


def test_a_fleet_stops_and_prints_its_key_when_its_stdin_closes():
    with _lab.HiddenServer("minikv.grading.mystery_fleet", "--seed", "25") as fleet:
        assert len(fleet.info["nodes"]) == 5
        key = fleet.reveal()
    assert [f["kind"] for f in key["findings"]] == ["client_salt_key", "weak_hash", "tenant_key_dropped",
                                                    "shared_cache", "first_block_only"]
    assert set(key["requests"]) == set(fleet.info["nodes"]) and fleet.proc.returncode == 0
