"""A capstone mutant kept in its own file: it imports :mod:`minikv.attacks.collisions` (as the
reference audit does), which the attack labs forbid, and the lab graders check the imports of
the whole file that defines a function."""
from __future__ import annotations


def _cached(http, url, key, prompt) -> int:
    r = http.post(f"{url}/completions", headers={"Authorization": f"Bearer {key}"},
                  json={"model": "tiny", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def audit_collision_across_tenants(fleet):
    """Crafts lesson 06's poly twin of a fresh block, but plants the original from one tenant and
    sends the twin from another: on a tenant-keyed node the key changes the twin's hash, so the
    collision never lands and the weak-hash node passes (only the isolation audit and the
    public-prefix probe are left out; the finding that matters here is the missed weak hash)."""
    import os

    import httpx

    from minikv.attacks.collisions import poly_collision

    (alice, _), (bob, _) = list(fleet["api_keys"].items())[:2]
    out = []
    with httpx.Client(timeout=120) as http:
        for url in fleet["nodes"]:
            bs = http.get(url[:-3] + "/fleet/node").json()["block_size"]
            rng = int.from_bytes(os.urandom(4), "big")
            block = [100 + (rng >> i) % 90 for i in range(bs)]
            twin = list(poly_collision(block, vocab_size=259))
            _cached(http, url, alice, block + [50, 51])
            if _cached(http, url, bob, twin + [50, 51]) >= bs:
                out.append({"node": url, "kind": "weak_hash"})
    return out
