"""Trail rotation (size, time, gzip, disk cap) and reading rotated trails back (load_trail, CLI).

No test sleeps: time-based rotation runs on a fake clock.
"""
from __future__ import annotations

import gzip
import json
import math

import pytest

from minikv.audit.cli import main as audit_main
from minikv.audit.detector import detect, load_trail, load_trails
from minikv.audit.rotation import RotatingFile, open_shared, release_shared, rotated_files, trail_files
from minikv.audit.trail import AuditTrail


class Clock:
    def __init__(self, now: float = 1_700_000_000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def line(i: int, pad: int = 30) -> str:
    return json.dumps({"t": i, "event": "x", "i": i, "pad": "p" * pad}) + "\n"


def read_all(live) -> list[str]:
    out = []
    for f in trail_files(live):
        opener = gzip.open if f.name.endswith(".gz") else open
        with opener(f, "rt", encoding="utf-8") as fh:
            out.extend(fh.read().splitlines(keepends=True))
    return out


def test_size_rotation_compresses_and_keeps_every_line_in_order(tmp_path):
    live = tmp_path / "trail.jsonl"
    w = RotatingFile(live, max_bytes=200, max_files=100, rotate_interval_s=None)
    lines = [line(i) for i in range(20)]
    for ln in lines:
        w.write(ln)
    w.close()
    rotated = rotated_files(live)
    assert len(rotated) >= 5
    assert [n for n, _ in rotated] == list(range(1, len(rotated) + 1))  # numbers only grow
    assert all(p.name.endswith(".gz") for _, p in rotated)  # compressed, no plain leftovers
    for _, p in rotated:
        assert len(gzip.decompress(p.read_bytes())) <= 200
    assert read_all(live) == lines


def test_a_line_longer_than_max_bytes_is_never_split(tmp_path):
    live = tmp_path / "t.jsonl"
    w = RotatingFile(live, max_bytes=100, rotate_interval_s=None)
    big = line(1, pad=300)
    for ln in (line(0), big, line(2)):
        w.write(ln)
    w.close()
    assert read_all(live) == [line(0), big, line(2)]
    assert gzip.decompress(rotated_files(live)[1][1].read_bytes()).decode() == big


def test_time_rotation_on_a_fake_clock_and_no_empty_files_when_idle(tmp_path):
    clock, live = Clock(), tmp_path / "t.jsonl"
    w = RotatingFile(live, rotate_interval_s=60, clock=clock)
    w.write(line(0))
    clock.now += 59
    w.write(line(1))
    assert rotated_files(live) == []
    clock.now += 1
    w.write(line(2))  # the file is 60 s old: rotate first
    w.wait()
    assert len(rotated_files(live)) == 1
    clock.now += 3600  # idle for an hour: nothing is written, nothing rotates
    assert w.rotate() is not None and w.rotate() is None  # an empty live file is not rotated
    w.close()
    assert read_all(live) == [line(0), line(1), line(2)]
    assert len(rotated_files(live)) == 2


def test_disk_cap_deletes_the_oldest_files(tmp_path):
    live = tmp_path / "t.jsonl"
    w = RotatingFile(live, max_bytes=120, max_files=2, rotate_interval_s=None)
    for i in range(12):
        w.write(line(i))
    w.close()
    kept = rotated_files(live)
    assert len(kept) == 2
    assert [n for n, _ in kept] == [n for n, _ in kept][-2:] and kept[0][0] > 1  # the newest two
    assert read_all(live)[-1] == line(11)

    capped = tmp_path / "c.jsonl"
    w = RotatingFile(capped, max_bytes=120, max_files=100, max_total_bytes=300, rotate_interval_s=None)
    for i in range(30):
        w.write(line(i, pad=60))
    w.close()
    total = sum(p.stat().st_size for p in trail_files(capped))
    assert total <= 300 and read_all(capped)[-1] == line(29, pad=60)


def test_leftover_uncompressed_rotated_file_is_compressed_at_start(tmp_path):
    live = tmp_path / "t.jsonl"
    (tmp_path / "t.jsonl.3").write_text(line(0))  # a crash interrupted compression
    w = RotatingFile(live)
    w.write(line(1))
    w.close()
    assert [p.name for _, p in rotated_files(live)] == ["t.jsonl.3.gz"]
    assert read_all(live) == [line(0), line(1)]
    w2 = RotatingFile(live, max_bytes=10)  # the next rotation continues the numbering
    w2.write(line(2))
    w2.close()
    assert [n for n, _ in rotated_files(live)] == [3, 4]


@pytest.mark.parametrize("kw, err", [
    (dict(max_bytes=0), ValueError), (dict(max_bytes="64"), TypeError), (dict(max_bytes=True), TypeError),
    (dict(max_files=-1), ValueError), (dict(max_total_bytes=0), ValueError),
    (dict(rotate_interval_s=0), ValueError), (dict(rotate_interval_s=math.nan), ValueError),
    (dict(rotate_interval_s="1h"), TypeError)])
def test_bad_rotation_settings_name_the_value(tmp_path, kw, err):
    name = next(iter(kw))
    with pytest.raises(err, match=name):
        RotatingFile(tmp_path / "t.jsonl", **kw)


def test_one_writer_per_path_in_a_process(tmp_path):
    live = tmp_path / "t.jsonl"
    a = open_shared(live, max_bytes=1000)
    b = open_shared(str(live), max_bytes=1000)
    assert a is b
    with pytest.raises(ValueError, match="already open"):
        open_shared(live, max_bytes=2000)
    release_shared(a)
    b.write(line(0))  # still open: one user left
    release_shared(b)
    with pytest.raises(ValueError, match="closed"):
        b.write(line(1))
    c = open_shared(live)
    assert c is not a  # a fresh writer after the last user closed
    release_shared(c)
    with pytest.raises(TypeError, match="max_files"):
        AuditTrail(live, b"k" * 32, 16, max_filez=3)


def test_load_trail_reads_rotated_and_compressed_files_oldest_first(tmp_path):
    live = tmp_path / "trail.jsonl"
    w = RotatingFile(live, max_bytes=150, rotate_interval_s=None)
    for i in range(10):
        w.write(line(i))
    w.close()
    assert len(rotated_files(live)) >= 3
    assert [e["i"] for e in load_trail(live)] == list(range(10))
    live_only = [e["i"] for e in load_trail(live, rotated=False)]
    assert live_only == list(range(10 - len(live_only), 10)) and len(live_only) < 10
    first = rotated_files(live)[0][1]
    assert [e["i"] for e in load_trail(first)][0] == 0  # one rotated file, by name, alone
    with pytest.raises(FileNotFoundError):
        load_trail(tmp_path / "missing.jsonl")


def test_load_trails_takes_several_paths_and_globs_once_each(tmp_path):
    for name in ("a", "b"):
        w = RotatingFile(tmp_path / f"{name}.jsonl", max_bytes=150, rotate_interval_s=None)
        for i in range(6):
            w.write(line(i))
        w.close()
    a = [e["i"] for e in load_trails([tmp_path / "a.jsonl"])]
    both = load_trails([str(tmp_path / "*.jsonl"), tmp_path / "a.jsonl", str(tmp_path / "a.jsonl.*")])
    assert a == list(range(6)) and len(both) == 12
    with pytest.raises(FileNotFoundError, match="matches"):
        load_trails([str(tmp_path / "nope*.jsonl")])


def _probe_events(n: int) -> list[dict]:
    """mallory sends n same-length continuations of one 2-block prefix (request level)."""
    prefix = ["aa" * 8, "bb" * 8]
    return [{"t": i, "event": "summary", "v": 2, "engine": "e1", "request_id": str(i), "tenant": "mallory",
             "num_prompt_tokens": 33, "prefix_fps": prefix, "tail_fp": f"{i:016x}", "cross_tenant_hits": [],
             "evicted_owners": []} for i in range(n)]


def test_cli_detect_finds_a_pattern_spread_over_rotated_files(tmp_path, capsys):
    live = tmp_path / "trail.jsonl"
    w = RotatingFile(live, max_bytes=600, rotate_interval_s=None)
    for ev in _probe_events(10):
        w.write(json.dumps(ev) + "\n")
    w.close()
    assert len(rotated_files(live)) >= 3
    assert all(len(load_trail(p, rotated=False)) < 8 for p in trail_files(live))  # no file alone shows it
    assert audit_main(["audit", "detect", str(live), "--fail-on-findings"]) == 2
    assert "[probing] tenant='mallory'" in capsys.readouterr().out
    assert audit_main(["audit", "detect", str(tmp_path / "trail.jsonl.*"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["kind"] == "probing"
    assert audit_main(["audit", "detect", str(tmp_path / "absent.jsonl")]) == 1
    assert [f.kind for f in detect(load_trail(live))] == ["probing"]
