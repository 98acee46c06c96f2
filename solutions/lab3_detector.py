"""Lab L3 (lesson 09): write the operator's probing detector.

You run the server.  Your audit trail (``audit_log=...``, request level) holds one ``summary``
record per request: ``tenant``, ``num_prompt_tokens``, ``prefix_fps`` (keyed fingerprints of
every block-aligned prefix of the prompt: ``prefix_fps[d-1]`` names its first ``d`` blocks, and
equal fingerprints mean equal content, whoever sent it) and ``tail_fp`` (a fingerprint of the
whole prompt).  No prompt text: the trail must not become a second copy of your users' secrets.

An attacker extracting a victim's prompt (lab L1) sends many requests that share the victim's
prefix and differ only in the *next* block.  Flag a tenant when at least ``threshold`` of its
requests

* share the same first ``d`` blocks (same ``prefix_fps[d-1]``) for some depth ``d >= 1``,
* end within one block after that prefix (at most ``d + 1`` full blocks),
* are mutually distinct (different ``tail_fp``), and
* have lengths within one block of each other.

The grader draws two trails at grade time from fresh seeds -- attackers among victims and four
kinds of benign traffic that a careless rule flags -- and compares your detection rate and false
positives with the course's reference detector.  Off limits: ``minikv.audit.detector`` (the
reference), ``minikv.attacks``, ``minikv.security``, ``solutions``.
"""
from __future__ import annotations

from collections import defaultdict


def detect_probing(records: list[dict], block_size: int, threshold: int = 8) -> set[str]:
    """The tenants whose requests form an enumeration; ``records`` are trail records (dicts).

    Only ``summary`` records (request level) carry the fields above; skip every other event.

    Stuck?  ``make hint EX=L3`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    by_tenant = defaultdict(list)
    for r in records:
        if r.get("event") == "summary" and r.get("prefix_fps"):
            by_tenant[r.get("tenant")].append(r)
    flagged = set()
    for tenant, reqs in by_tenant.items():
        for d in range(1, max(len(r["prefix_fps"]) for r in reqs) + 1):
            groups = defaultdict(dict)                    # prefix fp -> {tail fp: length}
            for r in reqs:
                if d <= len(r["prefix_fps"]) <= d + 1:    # ends within one block after the prefix
                    groups[r["prefix_fps"][d - 1]][r["tail_fp"]] = r["num_prompt_tokens"]
            for lengths in groups.values():               # distinct tails only: a retry is not a probe
                ls = sorted(lengths.values())
                widest = max(sum(1 for y in ls if x <= y <= x + block_size) for x in ls)
                if widest >= threshold:
                    flagged.add(tenant)
    return flagged
    # END SOLUTION
