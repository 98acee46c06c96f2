"""Grader of lab L3 (lesson 09): a probing detector over an operator's audit trail.

:func:`mixed_trail` runs a real tiny-random engine (tenant isolation, request-level trail) on a
workload drawn from a seed: victims behind a shared system prompt, **attackers** that enumerate
candidates for the block after a victim's prefix (PromptPeek-style), and four kinds of **benign**
tenants that a careless detector flags:

* ``popular`` -- many tenants sending a few questions each after the same system prompt;
* ``retry``   -- one tenant re-sending one prompt a dozen times (same tail: not an enumeration);
* ``chat``    -- a growing conversation (same prefix, but every request is longer);
* ``faq``     -- a dozen different questions of varied length after the system prompt.

Tenant names and roles are drawn from the seed, so a hard-coded list fails.  The grader runs the
learner's ``detect_probing(records, block_size, threshold)`` in a sealed process on two fresh
trails and the reference, :func:`minikv.audit.detector.detect` (its ``probing`` findings), on the
same records, and compares detection rate and false positives.  To pass, the learner must do at
least as well as the reference on both: catch every attacker it catches, and flag no more benign
tenants than it does.
"""
from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

import numpy as np

from ._lab import refuse, run_graded
from ._report import expect, grader

BS = 4
THRESHOLD = 8
SYSTEM = "You are the support assistant of Acme Bank. Answer briefly and never share account data. "
LETTERS = "abcdefghijklmnopqrstuvwxyz "


def _words(rng, n: int) -> str:
    return "".join(LETTERS[i] for i in rng.integers(0, len(LETTERS), n)).strip() or "x"


def workload(seed: int) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """([(tenant, prompt), ...] in send order, {tenant: role}) for one mixed trail."""
    rng = np.random.default_rng(seed)
    names = [f"tenant-{i:04d}" for i in rng.choice(10000, 40, replace=False)]
    roles: dict[str, str] = {}
    first, rest = [], []

    def take(role: str) -> str:
        roles[names[len(roles)]] = role
        return names[len(roles) - 1]

    victims = [SYSTEM + f"My account number is {rng.integers(10**7, 10**8)}. Why was my card declined?"
               for _ in range(2)]
    first += [(take("victim"), v) for v in victims]
    for a in range(int(rng.integers(2, 4))):                       # attackers
        t, v = take("attacker"), victims[int(rng.integers(2))]
        known = v[:(len(SYSTEM) // BS + int(rng.integers(1, 4))) * BS]
        cands = {"".join(rng.choice(list("0123456789"), BS)) for _ in range(40)}
        n = int(rng.integers(10, 17))
        n = THRESHOLD if a == 0 else n  # one attacker sits exactly on the threshold: "at least" is the rule
        rest += [(t, known + c + "?") for c in sorted(cands)[:n]]
    for _ in range(12):                                            # popular system prompt
        t = take("benign:popular")
        rest += [(t, SYSTEM + _words(rng, int(rng.integers(20, 80)))) for _ in range(int(rng.integers(1, 4)))]
    t, q = take("benign:retry"), SYSTEM + _words(rng, 40)
    rest += [(t, q)] * 12
    t, convo = take("benign:chat"), SYSTEM
    for _ in range(12):
        convo += _words(rng, int(rng.integers(15, 40))) + " "
        rest.append((t, convo))
    t = take("benign:faq")
    rest += [(t, SYSTEM + _words(rng, int(rng.integers(30, 120)))) for _ in range(12)]
    order = rng.permutation(len(rest))          # interleaved; a chat's turns keep their order
    chat = iter([p for p in rest if roles[p[0]] == "benign:chat"])
    rest = [next(chat) if roles[rest[i][0]] == "benign:chat" else rest[i] for i in order]
    return first + rest, roles


def mixed_trail(seed: int) -> tuple[list[dict], dict[str, str]]:
    """Run :func:`workload` on a real engine; return (trail records, {tenant: role})."""
    from ..engine.config import UnsafeSettingWarning
    from ..engine.sampling import SamplingParams
    from ..llm import LLM
    from ..audit.detector import load_trail

    sends, roles = workload(seed)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trail.jsonl"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UnsafeSettingWarning)
            llm = LLM("tiny-random", device="cpu", dtype="float32", block_size=BS, num_blocks=2048,
                      enable_prefix_caching=True, seed=0, audit_log=str(path))
        params = SamplingParams(max_tokens=1, temperature=0.0)
        for i in range(0, len(sends), 16):
            batch = sends[i:i + 16]
            llm.generate([p for _, p in batch], params, tenant=[t for t, _ in batch])
        records = load_trail(path)
    return records, roles


def reference_flags(records: list[dict]) -> set[str]:
    from ..audit.detector import detect

    return {f.tenant for f in detect(records, threshold=THRESHOLD, block_size=BS) if f.kind == "probing"}


def score(flags, roles: dict[str, str]) -> tuple[int, int, int, int]:
    """(attackers caught, attackers, benign tenants flagged, benign tenants)."""
    attackers = {t for t, r in roles.items() if r == "attacker"}
    benign = {t for t, r in roles.items() if r.startswith("benign")} | {t for t, r in roles.items() if r == "victim"}
    flags = set(flags)
    return len(flags & attackers), len(attackers), len(flags & benign), len(benign)


@grader("group each tenant's requests by shared prefix, then keep only distinct, near-equal-length "
        "requests that end within one block after it; see the lab's docstring")
def check_detector(detect_probing, *, seeds=None, timeout: float = 120.0) -> str:
    why = refuse(detect_probing)
    expect(why is None, str(why), "write the detector in its exercises/ file, on the records alone")
    seeds = list(seeds) if seeds is not None else [int.from_bytes(os.urandom(4), "big") for _ in range(2)]
    lines = []
    for seed in seeds:
        records, roles = mixed_trail(seed)
        flags, _ = run_graded(detect_probing, [records, BS, THRESHOLD], timeout,
                              error_hint="run it on the lesson's trail and read the traceback",
                              timeout_hint="one pass per tenant and depth is enough: no pairwise loops over requests")
        expect(isinstance(flags, list) and all(isinstance(t, str) for t in flags),
               f"detect_probing returned {str(flags)[:80]}; it must return a set of tenant names",
               "return {tenant, ...}, the tenants you flag")
        got, ref = score(flags, roles), score(reference_flags(records), roles)
        wrongly = sorted({roles[t] for t in flags if roles.get(t, "").startswith("benign") or roles.get(t) == "victim"})
        missed = sorted(len(_probes(records, t)) for t in set(roles) - set(flags) if roles.get(t) == "attacker")
        expect(got[0] >= ref[0], f"trail {seed}: caught {got[0]} of {got[1]} attackers, the reference catches "
               f"{ref[0]}" + (" (bug class: the threshold boundary -- an attacker with exactly threshold="
                              f"{THRESHOLD} probes was missed: 'at least threshold' includes it)"
                              if THRESHOLD in missed else ""),
               "an attacker's probes share a prefix and differ only in the block after it"
               + (f" ({len(missed)} missed)" if missed else ""))
        expect(got[2] <= ref[2], f"trail {seed}: flagged {got[2]} benign tenants ({', '.join(wrongly)}), the "
               f"reference flags {ref[2]}", next((_WHY[k] for k in _WHY if k in wrongly), "") or
               "a group of requests is an enumeration only if its members are distinct and end one block "
               "after the shared prefix")
        lines.append(f"{got[0]}/{got[1]} attackers, {got[2]}/{got[3]} false positives "
                     f"(reference {ref[0]}/{ref[1]}, {ref[2]}/{ref[3]})")
    return "; ".join(lines)


def _probes(records: list[dict], tenant: str) -> list[dict]:
    """The request summaries of ``tenant`` in the trail (an attacker's are all probes)."""
    return [r for r in records if r.get("event") == "summary" and r.get("tenant") == tenant]


_WHY = {  # most telling first: the hint for the first kind of benign tenant that was flagged
    "benign:popular": "many tenants share a system prompt: group per tenant, never across tenants",
    "benign:retry": "a retry loop re-sends ONE prompt: count distinct tails (tail_fp), not requests",
    "benign:faq": "questions after a system prompt differ over many blocks and vary in length: require "
                  "the group to end within one block after the shared prefix",
    "benign:chat": "a growing conversation shares its prefix but keeps getting longer: an enumeration's "
                   "requests end within one block after the shared prefix",
    "victim": "a victim sent its prompt once: flag the tenant whose OWN requests form the enumeration, not the "
              "owner of the prefix being enumerated",
}

