"""Operator-side analysis of the JSONL audit trail (format: docs/ARCHITECTURE.md).

A timing audit (``minikv.audit.timing``) is what an *outsider* can do.  The operator sees more:
every cache hit with the tenant that stored the block, and keyed fingerprints of every prompt's
block-aligned prefixes.  Three patterns matter.

1. **Cross-tenant hits** -- a ``hit`` event whose ``owner_tenant`` differs from the requesting
   ``tenant`` on a block that is not inside an operator-declared shared prefix (``public``).
   Under per-tenant isolation this must never happen; every occurrence is a reuse of another
   tenant's KV state, i.e. exactly the side channel Gu et al. measured from outside.  An
   ``adopt`` event (a block computed in the same step as another request's copy, then swapped
   for that copy at commit) is the same reuse found later, and counts the same.  A ``hit`` or
   ``adopt`` without a ``public`` field is treated as private (fail towards reporting).

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

3. **Eviction pressure** -- a tenant whose allocations keep evicting other tenants' cached blocks
   (prime-and-probe, cache flushing); the rule and its limits are in ``minikv.audit.eviction``.

Both trail levels work (docs/ARCHITECTURE.md, "Audit trail").  At ``"request"`` level each
request is one ``summary`` record carrying what rules 1-3 need (``cross_tenant_hits`` and
``evicted_owners`` pairs, ``prefix_fps``, ``tail_fp``); at ``"block"`` level the ``request``,
``hit`` and ``evict`` events do.  A request is named by ``(engine, request_id)``: forks of one
engine write into one file and number their requests from 0 each, so a finding writes
``<request_id>@<engine>`` whenever a request id occurs under more than one engine tag.

Reading: :func:`load_trail` reads a live trail together with its rotated, gzip-compressed
files (oldest first); :func:`load_trails` takes several paths or glob patterns.
"""
from __future__ import annotations

import glob
import gzip
import json
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from ..engine.lifecycle import REUSE_RECORDS
from .eviction import eviction_pressure
from .rotation import trail_files

DEFAULT_BLOCK_SIZE = 16
DEFAULT_MIN_EVICTIONS = 32  # other tenants' blocks one tenant must evict before rule 3 looks at it
REQUEST_EVENTS = ("request", "summary")  # one per request: "summary" at request level, "request" at block level


@dataclass(frozen=True)
class Finding:
    kind: str  # "cross_tenant_hit" | "probing" | "eviction_pressure"
    tenant: str | None  # the tenant whose behaviour is flagged (the reader, for hits)
    detail: str
    request_ids: tuple[str, ...]
    prefix_fp: str | None = None  # probing: the fingerprint of the prefix being enumerated


def load_trail(path: str | os.PathLike, *, rotated: bool = True) -> list[dict]:
    """Parse a JSONL trail; blank lines are skipped, malformed ones raise ValueError with the line.

    ``path`` is the live file: its rotated files (``path.N``, ``path.N.gz``) are read first,
    oldest first, unless ``rotated=False``.  A path ending in ``.gz`` is decompressed; a rotated
    file given by name is read alone."""
    path = Path(path)
    files = trail_files(path) if rotated and not _ROTATED.search(path.name) else [path]
    if not files:
        raise FileNotFoundError(f"no audit trail at {path} (nor rotated files {path.name}.N[.gz])")
    return [ev for f in files for ev in _read_one(f, required=f == path)]


def load_trails(patterns: Iterable[str | os.PathLike]) -> list[dict]:
    """Events of several trails: each pattern is a path or a glob (``trails/*.jsonl``); a live
    path brings its rotated files.  Each file is read once, a trail's files oldest first."""
    files: list[Path] = []
    rotated: set[Path] = set()  # found by listing, not named: may be pruned before we read them
    for pat in patterns:
        matches = sorted(glob.glob(str(pat))) if any(c in str(pat) for c in "*?[") else [str(pat)]
        if not matches:
            raise FileNotFoundError(f"no audit trail matches {pat}")
        for m in map(Path, matches):
            found = [m] if _ROTATED.search(m.name) else trail_files(m)
            if not found:
                raise FileNotFoundError(f"no audit trail at {m}")
            rotated.update(f for f in found if f != m)
            files.extend(f for f in found if f not in files)
    return [ev for f in files for ev in _read_one(f, required=f not in rotated)]


_ROTATED = re.compile(r"\.\d+(\.gz)?$")


def _read_one(path: Path, required: bool = True) -> list[dict]:
    """One file's events.  A rotated file found by listing may have been compressed (``.N``
    became ``.N.gz``) or pruned since; the first is read instead, the second skipped."""
    if not path.exists() and not path.name.endswith(".gz") and path.with_name(path.name + ".gz").exists():
        path = path.with_name(path.name + ".gz")
    if not required and not path.exists():
        return []
    opener = gzip.open if path.name.endswith(".gz") else open
    events = []
    with opener(path, "rt", encoding="utf-8") as fh:
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


def request_labeler(events: list[dict]):
    """``label(event) -> str`` naming its request: the request id, qualified as
    ``<request_id>@<engine>`` only when that id occurs under more than one engine tag."""
    engines: dict = defaultdict(set)
    for ev in events:
        if ev.get("request_id") is not None:
            engines[ev["request_id"]].add(ev.get("engine"))

    def label(ev: dict) -> str:
        rid = ev.get("request_id")
        return f"{rid}@{ev.get('engine')}" if len(engines.get(rid, ())) > 1 else str(rid)
    return label


def _cross_tenant_hits(events: list[dict], label) -> list[Finding]:
    pairs: dict[tuple, list] = defaultdict(list)
    for ev in events:
        if ev.get("event") == "summary":  # request level: [owner, count] pairs, public excluded
            for owner, n in ev.get("cross_tenant_hits") or ():
                pairs[(ev.get("tenant"), owner)].extend([label(ev)] * int(n))
        if ev.get("event") not in REUSE_RECORDS or ev.get("public", False):  # a hit or an adoption
            continue
        if ev.get("owner_tenant") != ev.get("tenant"):
            pairs[(ev.get("tenant"), ev.get("owner_tenant"))].append(label(ev))
    out = []
    for (tenant, owner), rids in pairs.items():
        uniq = tuple(dict.fromkeys(rids))
        out.append(Finding("cross_tenant_hit", tenant,
                           f"{len(rids)} private block reuse(s) (hits or adoptions) by tenant {tenant!r} on blocks stored by "
                           f"tenant {owner!r} across {len(uniq)} request(s)", uniq))
    return out


def _probing(requests: list[dict], threshold: int, block_size: int, label) -> list[Finding]:
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
                tuple(label(m) for m in members), prefix_fp=fp))
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


def detect(events: Iterable[dict], threshold: int = 8, block_size: int | None = None,
           min_evictions: int = DEFAULT_MIN_EVICTIONS) -> list[Finding]:
    """Run the three checks over trail events (either level, v1 or v2): cross-tenant hits
    first, then probing, then eviction pressure.

    ``threshold``: requests per probing group.  ``block_size`` defaults to the value inferred
    from the request records (else 16).  ``min_evictions``: other tenants' blocks a tenant must
    have evicted before eviction pressure can flag it.
    """
    for name, value, least in (("threshold", threshold, 2), ("min_evictions", min_evictions, 1)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
        if value < least:
            raise ValueError(f"{name} must be >= {least}, got {value}")
    events = list(events)
    label = request_labeler(events)
    requests = [e for e in events if e.get("event") in REQUEST_EVENTS]
    bs = block_size or infer_block_size(requests) or DEFAULT_BLOCK_SIZE
    return (_cross_tenant_hits(events, label) + _probing(requests, threshold, bs, label)
            + eviction_pressure(events, label, min_evictions, Finding))


def format_findings(findings: list[Finding]) -> str:
    if not findings:
        return "no findings: no cross-tenant hits, no probing pattern, no eviction pressure"
    counts = Counter(f.kind for f in findings)
    lines = [f"{len(findings)} finding(s): " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items()))]
    for f in findings:
        ids = ", ".join(f.request_ids[:6]) + (" ..." if len(f.request_ids) > 6 else "")
        lines.append(f"[{f.kind}] tenant={f.tenant!r}: {f.detail}\n    requests: {ids}")
    return "\n".join(lines)
