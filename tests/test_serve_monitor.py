"""``minikv serve --selective-strategy monitor``: the audit detector, wired in by the ``minikv`` command.

The server is built from the command line exactly as ``minikv serve`` builds it (the parser of
:mod:`minikv.cli`, then :func:`minikv.serve.cli.app_from_args`) and served from a thread of this
process.  Over real HTTP, with ``cached_tokens`` as the oracle: an attacker enumerating guesses
of the token after a victim's template is flagged once it has sent the detector's threshold of
probes (8); from then on the victim's secret block is out of its reach, the flagged tenant's
own blocks are out of everyone else's, and benign tenants keep their hits -- their own and the
shared ones.  ``--selective-monitor-threshold`` and ``--selective-monitor-window`` reach the
detector: a lower threshold flags the prober before it reaches the secret, a small window lets a
prober that dilutes its probes with other requests go unseen.  tests/test_selective_monitor.py
tests the strategy itself, on the engine.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import re

import httpx
import pytest

from minikv.cli import build_parser
from minikv.serve import BackgroundServer
from minikv.serve.cli import add_serve_parser, app_from_args

BS = 16
KEYS = {"sk-victim": "victim", "sk-attacker": "attacker", "sk-bystander": "bystander"}
pytestmark = pytest.mark.filterwarnings("ignore::minikv.UnsafeSettingWarning")  # monitor is listed UNSAFE
MONITOR = ["--enable-prefix-caching", "--cache-isolation", "selective", "--selective-strategy", "monitor"]


def serve_args(keys_file, model, *flags):
    return build_parser().parse_args(["serve", "--model", str(model), "--api-keys", str(keys_file),
                                      "--num-blocks", "1024", "--block-size", str(BS), "--seed", "0",
                                      "--report-cached-tokens", *flags])


@pytest.fixture(scope="module")
def keys_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("serve_monitor") / "keys.json"
    path.write_text(json.dumps(KEYS))
    return path


@contextlib.contextmanager
def serving(keys_file, model, *flags):
    """A server built by ``app_from_args`` from these flags, on a loopback port for the block."""
    app, _ = app_from_args(serve_args(keys_file, model, *flags))
    with BackgroundServer(app) as srv:
        yield srv


@pytest.fixture(scope="module")
def server(tiny_path, keys_file):
    with serving(keys_file, tiny_path, *MONITOR) as srv:
        yield srv


def cached(srv, tenant: str, ids: list[int]) -> int:
    """``cached_tokens`` of one completion of token ids ``ids``, sent with ``tenant``'s key."""
    key = next(k for k, t in KEYS.items() if t == tenant)
    r = httpx.post(srv.base_url + "/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"prompt": ids, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def rand(rng, n):
    return [rng.randrange(3, 250) for _ in range(n)]


def victim_and_guesses(srv, rng, n: int, secret_at: int):
    """The victim sends its prompt (a template, one secret token, a block more); returns the
    template, the prompt and ``n`` guesses of the secret, the truth the ``secret_at``-th."""
    template, secret, rest = rand(rng, 2 * BS - 1), rand(rng, 1), rand(rng, BS)
    victim_prompt = template + secret + rest
    assert cached(srv, "victim", victim_prompt + [3]) == 0
    decoys = [t for t in range(3, 250) if t != secret[0]][:n - 1]
    return template, victim_prompt, decoys[:secret_at - 1] + secret + decoys[secret_at - 1:]


def probe(srv, template, guesses, rng=None, decoys: int = 0):
    """The attacker enumerates the token after ``template`` (lesson 04's count attack), sending
    ``decoys`` unrelated prompts after each probe; per probe: (did the guess hit the victim's
    block, is the attacker flagged once that probe finished)."""
    sharing = srv.app.state.engine.sharing
    out = []
    for g in guesses:
        hit = cached(srv, "attacker", template + [g, 0]) >= 2 * BS
        out.append((hit, "attacker" in sharing.flagged_tenants))
        for _ in range(decoys):
            cached(srv, "attacker", rand(rng, 2 * BS + 1))
    return out


def refused_without_monitor(capsys, *flags) -> list[str]:
    """argparse's errors for ``flags`` given to ``generate`` and to a ``serve`` registered without
    a monitor (each must refuse them: exit status 2)."""
    bare = argparse.ArgumentParser()
    add_serve_parser(bare.add_subparsers())
    errs = []
    for parser, argv in ((build_parser(), ["generate", "hi", "--model", "m"]),
                         (bare, ["serve", "--model", "m", "--api-keys", "k"])):
        with pytest.raises(SystemExit) as exc:
            parser.parse_args([*argv, *flags])
        assert exc.value.code == 2
        errs.append(capsys.readouterr().err)
    return errs


def test_monitor_flags_a_prober_over_http_and_isolates_both_ways(server):
    sharing = server.app.state.engine.sharing
    assert sharing.name == "monitor" and type(sharing.monitor).__name__ == "DetectorMonitor"
    rng = random.Random(0)
    template, victim_prompt, guesses = victim_and_guesses(server, rng, n=16, secret_at=13)
    # Shared by default: before any flag, a benign bystander hits the victim's blocks.
    assert cached(server, "bystander", victim_prompt + [4]) == 3 * BS

    # flagged at the 8th probe (the detector's default threshold), so the 13th -- the secret -- misses
    assert probe(server, template, guesses) == [(False, False)] * 7 + [(False, True)] * 9
    assert sharing.flagged_tenants == {"attacker"} and len(sharing.flagged_prefixes) == 1
    # The whole victim prompt: the attacker hits the two blocks its own post-flag probe wrote
    # (template + secret, which it learned nothing from), never the victim's third block.
    assert cached(server, "attacker", victim_prompt + [5]) == 2 * BS

    # The benign tenants keep their hits: the victim all of its own blocks ...
    assert cached(server, "victim", victim_prompt + [6]) == 3 * BS
    # ... the bystander the shared template (not what follows the probed prefix) ...
    assert cached(server, "bystander", victim_prompt + [7]) == BS
    # ... and content nobody probed is still shared between them, both ways.
    other, again = rand(rng, 2 * BS), rand(rng, 2 * BS)
    assert cached(server, "victim", other + [3]) == 0 and cached(server, "bystander", other + [4]) == 2 * BS
    assert cached(server, "bystander", again + [3]) == 0 and cached(server, "victim", again + [4]) == 2 * BS

    # The flagged attacker's new blocks are its own: it hits them, nobody else does.  (One prompt
    # per other tenant: whoever misses computes the blocks again, shared, for the next to hit.)
    for tenant in ("bystander", "victim"):
        mine = rand(rng, 2 * BS)
        assert cached(server, "attacker", mine + [3]) == 0 and cached(server, "attacker", mine + [4]) == 2 * BS
        assert cached(server, tenant, mine + [5]) == 0


def test_bad_strategy_names_are_refused_clearly(tiny_path, keys_file, capsys):
    with pytest.raises(SystemExit) as exc:
        serve_args(keys_file, tiny_path, "--selective-strategy", "nope")
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'nope'" in err and "'k_tenants', 'monitor'" in err
    # where no monitor is wired in (``generate``, or ``serve`` registered without one) it is not offered
    assert all("invalid choice: 'monitor'" in err for err in refused_without_monitor(capsys, "--selective-strategy",
                                                                                      "monitor"))
    # a namespace built by hand reaches the engine's own check, which names the value
    args = serve_args(keys_file, tiny_path, *MONITOR)
    args.selective_strategy = "nope"
    with pytest.raises(ValueError, match=r"selective_strategy='nope' is not valid; choose one of"):
        app_from_args(args)


def test_threshold_flag_flags_the_prober_sooner(tiny_path, keys_file):
    # The same attack on two fresh servers, the secret the 5th guess: the default threshold (8)
    # answers it from the shared cache -- the secret leaks --, threshold 3 has flagged the
    # attacker at its 3rd probe.
    for flags, threshold in (([], 8), (["--selective-monitor-threshold", "3"], 3)):
        with serving(keys_file, tiny_path, *MONITOR, *flags) as srv:
            monitor = srv.app.state.engine.sharing.monitor
            assert (monitor.threshold, monitor.window) == (threshold, 256)
            template, _, guesses = victim_and_guesses(srv, random.Random(1), n=8, secret_at=5)
            got = probe(srv, template, guesses)
            assert [flagged for _, flagged in got] == [False] * (threshold - 1) + [True] * (9 - threshold)
            assert [hit for hit, _ in got] == [False] * 4 + [threshold > 5] + [False] * 3


def test_window_flag_bounds_what_counts_as_recent(tiny_path, keys_file):
    # Threshold 3 on both servers; the attacker sends two unrelated prompts after each probe, so
    # any 4 of its requests in a row hold at most 2 probes.  The default window (256) sees the
    # 3rd probe and flags it; a window of 4 never does, and the 4th guess -- the secret -- leaks.
    for window, flagged_from in ((None, 3), (4, None)):
        flags = ["--selective-monitor-threshold", "3"] + (["--selective-monitor-window", str(window)] if window else [])
        with serving(keys_file, tiny_path, *MONITOR, *flags) as srv:
            assert srv.app.state.engine.sharing.monitor.window == (window or 256)
            rng = random.Random(2)
            template, _, guesses = victim_and_guesses(srv, rng, n=6, secret_at=4)
            got = probe(srv, template, guesses, rng, decoys=2)
            assert [flagged for _, flagged in got] == [bool(flagged_from) and i >= flagged_from for i in range(1, 7)]
            assert [hit for hit, _ in got] == [False] * 3 + [window is not None] + [False] * 2


def test_bad_monitor_knobs_are_refused_with_the_value_named(tiny_path, keys_file, capsys, monkeypatch):
    for flag, value, says in (("--selective-monitor-threshold", "1", "expected an integer >= 2, got 1"),
                              ("--selective-monitor-threshold", "eight", "expected an integer, got 'eight'"),
                              ("--selective-monitor-window", "0", "expected an integer >= 2, got 0"),
                              ("--selective-monitor-window", "-5", "expected an integer >= 2, got -5")):
        with pytest.raises(SystemExit) as exc:
            serve_args(keys_file, tiny_path, *MONITOR, flag, value)
        assert exc.value.code == 2
        assert f"argument {flag}: {says}" in capsys.readouterr().err
    # only offered where the monitor is: not by ``generate``, nor by ``serve`` registered without one
    for flag in ("--selective-monitor-threshold", "--selective-monitor-window"):
        assert all(f"unrecognized arguments: {flag} 64" in err for err in refused_without_monitor(capsys, flag, "64"))
    # a window shorter than the threshold: the detector's own check, before the model is loaded
    # (building an engine here fails the test) and so before any port is opened
    import minikv.llm

    def no_model(**kwargs):
        raise AssertionError("the model was loaded before the monitor's knobs were checked")
    with monkeypatch.context() as m:
        m.setattr(minikv.llm, "LLM", no_model)
        for flags, says in ((("--selective-monitor-window", "4"), r"window must be an int >= threshold \(8\), got 4"),
                            (("--selective-monitor-threshold", "300"), r"window must be an int >= threshold \(300\), got 256"),
                            (("--selective-monitor-threshold", "6", "--selective-monitor-window", "5"),
                             r"window must be an int >= threshold \(6\), got 5")):
            with pytest.raises(ValueError, match=says):
                app_from_args(serve_args(keys_file, tiny_path, *MONITOR, *flags))
    # knobs without the monitor strategy change nothing, and the operator is told so
    app, _ = app_from_args(serve_args(keys_file, tiny_path, "--selective-monitor-threshold", "3"))
    assert app.state.engine.sharing is None
    assert "--selective-monitor-* flags have no effect unless" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [True, False])
def test_prefault_kv_makes_the_pool_resident_before_serving_and_only_when_asked(tiny_path, keys_file, monkeypatch,
                                                                                caplog, flag):
    """``--prefault-kv``: the pool is prefaulted once, by ``app_from_args`` (before a port opens),
    and the log says how and how long; without the flag it is not (the pool fills as used)."""
    import logging

    from minikv.engine.kv_pool import KVPool

    calls = []
    prefault = KVPool.prefault
    monkeypatch.setattr(KVPool, "prefault", lambda pool: calls.append(pool) or prefault(pool))
    with caplog.at_level(logging.INFO, logger="minikv.serve"):
        app, _ = app_from_args(serve_args(keys_file, tiny_path, *(["--prefault-kv"] if flag else [])))
    assert [id(p) for p in calls] == ([id(app.state.engine.pool)] if flag else [])
    logged = [r.getMessage() for r in caplog.records if "KV pool resident" in r.getMessage()]
    assert len(logged) == int(flag)
    if flag:
        assert re.fullmatch(r"KV pool resident \((madvise|touch|resident)\): \d+\.\d\d GiB in \d+\.\d\d s", logged[0]), logged
