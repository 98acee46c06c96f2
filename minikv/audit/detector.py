"""Operator-side analysis of the JSONL audit trail (format: docs/ARCHITECTURE.md).

A timing audit (``minikv.audit.timing``) is what an *outsider* can do.  The operator sees more:
every cache hit with the tenant that stored the block, and keyed fingerprints of every prompt's
block-aligned prefixes.  Two patterns matter.

1. **Cross-tenant hits** -- a ``hit`` event whose ``owner_tenant`` differs from the requesting
   ``tenant`` on a block that is not inside an operator-declared shared prefix (``public``).
   Under per-tenant isolation this must never happen; every occurrence is a reuse of another
   tenant's KV state, i.e. exactly the side channel Gu et al. measured from outside.  A ``hit``
   without a ``public`` field is treated as private (fail towards reporting).

2. **Probing** -- PromptPeek (Wu et al., NDSS 2025) and InputSnatch (Zheng et al., 2024) recover
   a victim's prompt one piece at a time: the attacker sends the known prefix followed by each
   candidate for the next token(s) and watches which candidate comes back fast.  In the trail
   this looks like one tenant sending many requests that

   * share the same block-aligned prefix (same ``prefix_fps`` up to some depth D >= 1),
   * end within one block after it (no request has more than D + 1 full blocks): what varies
     is only the *next* tokens, not a whole new question,
   * are mutually distinct (different ``tail_fp``) -- a retry loop re-sending one prompt is not
     an enumeration,
   * have near-identical lengths (``num_prompt_tokens`` spread of at most one block).

   We flag a tenant when at least ``threshold`` (default 8) of its requests form such a group,
   taking the deepest qualifying depth.  The finding also says whether other tenants sent the
   same prefix (fingerprints are tenant-independent), which points at the likely victim.

Why this does not flag ordinary traffic: 50 tenants sharing one system prompt each send a few
requests, so no single tenant reaches the threshold; and ordinary questions after a system prompt
differ over many blocks and have varied lengths.

Limits, honestly: an attacker can stay under the threshold per tenant by spreading probes over
many accounts (a cross-tenant variant of the grouping would catch that but also flags popular
shared prompts), pad candidates to different lengths, or probe slowly (there is no time
window).  A legitimate tenant that sends many very short (< 1 block) distinct messages of equal
length after a fixed prompt -- a classifier API, say -- looks exactly like an enumeration and
will be flagged.  Prompts shorter than one block carry no prefix fingerprint and are invisible.
The detector is a triage tool for an operator, not proof of intent.
"""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Iterable

DEFAULT_BLOCK_SIZE = 16


@dataclass(frozen=True)
class Finding:
    kind: str  # "cross_tenant_hit" | "probing"
    tenant: str | None  # the tenant whose behaviour is flagged (the reader, for hits)
    detail: str
    request_ids: tuple[str, ...]


def load_trail(path: str | os.PathLike) -> list[dict]:
    """Parse a JSONL trail; blank lines are skipped, malformed ones raise ValueError with the line."""
    events = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                ev = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({exc.msg})") from None
            if not isinstance(ev, dict) or "event" not in ev:
                raise ValueError(f"{path}:{lineno}: expected an object with an 'event' field")
            events.append(ev)
    return events


def infer_block_size(requests: Iterable[dict]) -> int | None:
    """Largest block size consistent with every request's (num_prompt_tokens, len(prefix_fps)).

    ``len(prefix_fps) == num_prompt_tokens // block_size``, so each request with k >= 1 full
    blocks bounds the block size to (n / (k + 1), n / k].  Returns None without such requests or
    when they disagree (then the caller falls back to a default).
    """
    lo, hi = 0, None
    for r in requests:
        n, k = r.get("num_prompt_tokens"), len(r.get("prefix_fps") or ())
        if not isinstance(n, int) or k < 1:
            continue
        lo = max(lo, n // (k + 1) + 1)
        hi = n // k if hi is None else min(hi, n // k)
    return hi if hi is not None and hi >= lo else None


def _cross_tenant_hits(events: list[dict]) -> list[Finding]:
    pairs: dict[tuple, list] = defaultdict(list)
    for ev in events:
        if ev.get("event") != "hit" or ev.get("public", False):
            continue
        if ev.get("owner_tenant") != ev.get("tenant"):
            pairs[(ev.get("tenant"), ev.get("owner_tenant"))].append(ev.get("request_id"))
    out = []
    for (tenant, owner), rids in pairs.items():
        uniq = tuple(dict.fromkeys(rids))
        out.append(Finding("cross_tenant_hit", tenant,
                           f"{len(rids)} private block hit(s) by tenant {tenant!r} on blocks stored by "
                           f"tenant {owner!r} across {len(uniq)} request(s)", uniq))
    return out


def _probing(requests: list[dict], threshold: int, block_size: int) -> list[Finding]:
    by_tenant: dict = defaultdict(list)
    for r in requests:
        by_tenant[r.get("tenant")].append(r)
    # Which tenants sent each prefix fingerprint: lets a finding name the other parties.
    senders: dict[str, set] = defaultdict(set)
    for r in requests:
        for fp in r.get("prefix_fps") or ():
            senders[fp].add(r.get("tenant"))
    out = []
    for tenant, reqs in by_tenant.items():
        if len(reqs) < threshold:
            continue
        groups: dict[tuple[int, str], list[int]] = defaultdict(list)
        for i, r in enumerate(reqs):
            for depth, fp in enumerate(r.get("prefix_fps") or (), 1):
                groups[(depth, fp)].append(i)
        flagged: set[int] = set()
        for (depth, fp), idx in sorted(groups.items(), key=lambda kv: -kv[0][0]):
            if len(idx) < threshold or flagged.intersection(idx):
                continue
            # Keep only requests that end within a block of the shared prefix ("next tokens"),
            # then the largest group of them with near-identical lengths.  Dropping outliers,
            # rather than the whole group, means one long decoy request cannot hide the probes.
            members = [reqs[i] for i in idx if len(reqs[i].get("prefix_fps") or ()) <= depth + 1]
            members = _length_cluster(members, block_size)
            if len(members) < threshold:
                continue
            idx = [i for i in idx if reqs[i] in members]
            lengths = [m.get("num_prompt_tokens", 0) for m in members]
            distinct = len({m.get("tail_fp") for m in members})
            if distinct < threshold:
                continue
            flagged.update(idx)
            others = sorted(str(t) for t in senders[fp] - {tenant})
            also = f"; the same prefix was also sent by {len(others)} other tenant(s): " \
                   f"{', '.join(others[:5])}" if others else ""
            out.append(Finding(
                "probing", tenant,
                f"{len(members)} requests ({distinct} distinct) share a {depth}-block prefix and differ "
                f"only in the next tokens, lengths {min(lengths)}-{max(lengths)} tokens{also}",
                tuple(str(m.get("request_id")) for m in members)))
    return out


def _length_cluster(members: list[dict], block_size: int) -> list[dict]:
    """The largest subset whose prompt lengths fit in one ``block_size`` window."""
    ordered = sorted(members, key=lambda m: m.get("num_prompt_tokens", 0))
    best, lo = [], 0
    for hi in range(len(ordered)):
        while ordered[hi].get("num_prompt_tokens", 0) - ordered[lo].get("num_prompt_tokens", 0) > block_size:
            lo += 1
        if hi - lo + 1 > len(best):
            best = ordered[lo:hi + 1]
    return best


def detect(events: Iterable[dict], threshold: int = 8, block_size: int | None = None) -> list[Finding]:
    """Run both checks over trail events; cross-tenant hits first, then probing findings.

    ``block_size`` defaults to the value inferred from the request events (else 16).
    """
    if threshold < 2:
        raise ValueError(f"threshold must be >= 2, got {threshold}")
    events = list(events)
    requests = [e for e in events if e.get("event") == "request"]
    bs = block_size or infer_block_size(requests) or DEFAULT_BLOCK_SIZE
    return _cross_tenant_hits(events) + _probing(requests, threshold, bs)


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "no findings: no cross-tenant hits, no probing pattern"
    counts = Counter(f.kind for f in findings)
    lines = [f"{len(findings)} finding(s): " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))]
    for f in findings:
        ids = ", ".join(f.request_ids[:6]) + (" ..." if len(f.request_ids) > 6 else "")
        lines.append(f"[{f.kind}] tenant={f.tenant!r}: {f.detail}\n    requests: {ids}")
    return "\n".join(lines)
