"""``minikv serve --selective-strategy monitor``: the audit detector, wired in by the ``minikv`` command.

The server is built from the command line exactly as ``minikv serve`` builds it (the parser of
:mod:`minikv.cli`, then :func:`minikv.serve.cli.app_from_args`) and served from a thread of this
process.  Over real HTTP, with ``cached_tokens`` as the oracle: an attacker enumerating guesses
of the token after a victim's template is flagged once it has sent the detector's threshold of
probes (8); from then on the victim's secret block is out of its reach, the flagged tenant's
own blocks are out of everyone else's, and benign tenants keep their hits -- their own and the
shared ones.  tests/test_selective_monitor.py tests the strategy itself, on the engine.
"""
from __future__ import annotations

import argparse
import json
import random

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


@pytest.fixture(scope="module")
def server(tiny_path, keys_file):
    app, _ = app_from_args(serve_args(keys_file, tiny_path, *MONITOR))
    with BackgroundServer(app) as srv:
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


def test_monitor_flags_a_prober_over_http_and_isolates_both_ways(server):
    sharing = server.app.state.engine.sharing
    assert sharing.name == "monitor" and type(sharing.monitor).__name__ == "DetectorMonitor"
    rng = random.Random(0)
    template, secret, rest = rand(rng, 2 * BS - 1), rand(rng, 1), rand(rng, BS)
    victim_prompt = template + secret + rest
    assert cached(server, "victim", victim_prompt + [3]) == 0
    # Shared by default: before any flag, a benign bystander hits the victim's blocks.
    assert cached(server, "bystander", victim_prompt + [4]) == 3 * BS

    # The attacker enumerates the token after the template, the truth 13th (lesson 04's count attack).
    decoys = [t for t in range(3, 250) if t != secret[0]][:15]
    guesses = decoys[:12] + secret + decoys[12:]
    hits = [cached(server, "attacker", template + [g, 0]) >= 2 * BS for g in guesses]
    assert hits == [False] * 16  # flagged at the 8th probe, so the 13th -- the secret -- misses
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
    for argv in (["generate", "hi", "--model", "m", "--selective-strategy", "monitor"],):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert "invalid choice: 'monitor'" in capsys.readouterr().err
    bare = argparse.ArgumentParser()
    add_serve_parser(bare.add_subparsers())
    with pytest.raises(SystemExit):
        bare.parse_args(["serve", "--model", "m", "--api-keys", "k", "--selective-strategy", "monitor"])
    assert "invalid choice: 'monitor'" in capsys.readouterr().err
    # a namespace built by hand reaches the engine's own check, which names the value
    args = serve_args(keys_file, tiny_path, *MONITOR)
    args.selective_strategy = "nope"
    with pytest.raises(ValueError, match=r"selective_strategy='nope' is not valid; choose one of"):
        app_from_args(args)
