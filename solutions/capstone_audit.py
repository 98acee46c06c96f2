"""Capstone (lesson 12): audit the mystery fleet.

You are the auditor of a fleet of minikv servers.  Some are misconfigured; you do not know which,
nor how.  ``fleet`` (a dict) gives you what an auditor gets:

* ``fleet["nodes"]``: the nodes' API roots (``http://127.0.0.1:PORT/v1``);
* ``fleet["api_keys"]``: ``{key: tenant}`` for two test tenants (alice, bob);
* ``fleet["auditor_key"]``: opens each node's published audit trail;
* ``fleet["kinds"]``: the finding kinds you may report (below).

Each node also publishes ``GET <root>/fleet/node`` (its block size and its operator-declared
public prefix: cross-tenant hits *on it* are intended) and ``GET <root>/fleet/trail`` (its
request-level audit trail, JSONL; auditor key), where ``<root>`` is the URL without ``/v1``.

Return one finding per misconfigured node: ``{"node": <its URL as given>, "kind": <kind>}``.

``shared_cache``        ``cache_isolation="shared"``;
``tenant_key_dropped``  the server loses the tenant before the engine: every request reaches the hash
                        without one;
``first_block_only``    tenant keys on the first block only, behind the public prefix (lesson 07);
``weak_hash``           the ``poly`` hash with ``verify_hits=False`` (lesson 06);
``client_salt_key``     the node keys its cache by a request's ``cache_salt`` alone when one is sent
                        (vLLM's contract, but with no tenant behind the salt).

Lesson 12 works ``shared_cache`` through; the other four tests are yours to design, each with a
control that proves it could have seen what it looks for.

Use only public tools and HTTP: ``minikv audit isolation`` (``minikv.audit.isolation_server``),
``minikv audit detect`` (run the command: the detector module itself is off limits),
``minikv.attacks.collisions`` and ``httpx``.  The lab model's tokenizer is byte-level (ids 3..258
are the bytes 0..255; one ASCII character is one token), its vocabulary has 259 ids, and a prompt
may be a list of token ids.  ``make grade`` builds a fresh fleet from a new seed in another
process (seven nodes: every kind at least once, and one or two clean nodes) and checks your
findings against its answer key: found, missed, false alarm.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import httpx

from minikv.attacks.collisions import poly_collision
from minikv.audit.isolation_server import audit_server

VOCAB = 259


# BEGIN SOLUTION
def _cached(http, url, key, prompt, salt=None) -> int:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0}
    if salt is not None:  # vLLM's per-request cache_salt, as a client sends it
        body["cache_salt"] = salt
    r = http.post(f"{url}/completions", headers={"Authorization": f"Bearer {key}"}, json=body)
    r.raise_for_status()
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _trail_has_cross_tenant_hits(http, root, auditor_key) -> bool:
    trail = http.get(f"{root}/fleet/trail", headers={"Authorization": f"Bearer {auditor_key}"}).text
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trail.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            f.write(trail)
        out = subprocess.run([sys.executable, "-m", "minikv", "audit", "detect", path, "--json"],
                             capture_output=True, text=True, check=True).stdout
    return any(f["kind"] == "cross_tenant_hit" for f in json.loads(out))


def audit_node(http, url: str, fleet: dict) -> str | None:
    """The kind of misconfiguration of one node, or None."""
    root = url[:-len("/v1")] if url.endswith("/v1") else url
    card = http.get(f"{root}/fleet/node").json()
    (alice, _), (bob, _) = list(fleet["api_keys"].items())[:2]
    # 1. private prompts across tenants: the isolation audit (both directions, same-tenant control)
    report = audit_server(url, fleet["api_keys"], model=card["model"], rounds=1, prompt_words=20)
    if report.verdict == "fail":
        return "shared_cache" if _trail_has_cross_tenant_hits(http, root, fleet["auditor_key"]) \
            else "tenant_key_dropped"
    # 2. the same private text behind the public prefix: only the public blocks may hit for bob
    bs, public = card["block_size"], card["public_prefix"]
    private = public + os.urandom(16).hex() + " my private notes, not for anyone else. " * 2 + "?"
    _cached(http, url, alice, private)
    if _cached(http, url, bob, private) > len(public) // bs * bs:
        return "first_block_only"
    # 3. a crafted poly twin of a fresh block, same tenant: served from the original's entry?
    rng = int.from_bytes(os.urandom(4), "big")
    block = [100 + (rng >> i) % 90 for i in range(bs)]
    twin = list(poly_collision(block, vocab_size=VOCAB))
    _cached(http, url, alice, block + [50, 51])
    if _cached(http, url, alice, twin + [50, 51]) >= bs:
        return "weak_hash"
    # 4. (the kind no cell showed) one fresh prompt and one cache_salt, sent by alice, then by bob:
    # the salt may narrow a tenant's cache, never join two.  Control: alice's repeat must hit,
    # or a miss for bob proves nothing.
    salt, secret = os.urandom(8).hex(), os.urandom(12).hex() + " alice's salted notes, private. " * 2
    _cached(http, url, alice, secret, salt)
    if _cached(http, url, alice, secret, salt) < bs:
        raise RuntimeError(f"{url}: alice's own salted repeat did not hit; the salt test cannot see a leak")
    if _cached(http, url, bob, secret, salt) > 0:
        return "client_salt_key"
    return None
# END SOLUTION


def audit_fleet(fleet: dict) -> list[dict]:
    """Audit every node of ``fleet``; return ``[{"node": url, "kind": kind}, ...]``.

    Stuck?  ``make hint EX=C`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    findings = []
    with httpx.Client(timeout=120) as http:
        for url in fleet["nodes"]:
            kind = audit_node(http, url, fleet)
            if kind is not None:
                findings.append({"node": url, "kind": kind})
    return findings
    # END SOLUTION
