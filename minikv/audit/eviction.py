"""The detector's third rule: eviction pressure (prime-and-probe, cache flushing).

Per-tenant keys stop a tenant from *hitting* another tenant's blocks, but the pool and its LRU
are shared.  An attacker that fills the pool with its own blocks (prime), lets the victim run,
and re-sends its prompt (probe) learns how many blocks the victim's load evicted: the victim's
prompt length, or whether it is active at all.  A tenant that floods the pool with fresh content
also flushes every other tenant's cache (their hit rates, and so their latency, collapse).

What the trail shows.  Each eviction names the tenant whose allocation needed the room (the
*evictor*) and the tenant that wrote the evicted block (the *owner*): per-block ``evict`` events
at ``"block"`` level, ``evicted_owners`` pairs in each ``summary`` at ``"request"`` level.

Why raw counts are not enough.  In a full pool every new block evicts one, so over time the
blocks that tenant A takes from B and the blocks B takes from A balance out (each tenant's share
of the pool stays roughly constant).  Counting "evictions of other tenants' blocks" would flag
every tenant of a busy server.  What differs is *who is responsible for the losses*: an LRU
picks victims blind to tenants, so a tenant causes a share of everybody's losses about equal to
its share of allocations.  A flooding tenant causes most of the others' losses, while its own
losses are mostly self-inflicted (its old blocks are the least recently used ones).  So, for
each tenant T (counting only evictions attributed to a request):

* ``pressure(T)`` = others' blocks T evicted / all blocks of other tenants evicted by anyone;
* ``exposure(T)`` = T's blocks others evicted / all of T's blocks evicted by anyone.

T is flagged when it evicted at least ``min_evictions`` blocks of other tenants, ``pressure(T)
>= 0.5`` (T alone caused at least half of what the others lost) and ``pressure(T) >= 2 *
exposure(T)`` (T takes from the others far more than they take from it).  Four tenants with
similar traffic each cause about a quarter of the others' losses; two similar tenants sit near
0.5 each, and the margin keeps both unflagged; a tenant recycling only its own cache evicts
nobody else's blocks.

Limits, honestly.  A legitimately heavy tenant (most of the allocations, unique content) is
indistinguishable from a flooder: the finding means "this tenant's load is what empties the
others' caches", and the remedy is the same, a per-tenant quota.  An attacker who re-primes
only the few blocks the victim evicted produces an eviction record identical to its victim's --
each evicts exactly the other's blocks -- so no count tells them apart (the quota closes that
channel; the detector cannot see it).  Many accounts split the pressure below the threshold.
Evictions without a request (an operator's ``reset_prefix_cache``) are ignored, there is no
time window (pass a subset of the trail files for one), and a v1 trail, whose ``evict`` events
name no evictor, gives no eviction findings at all.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from typing import Callable

PRESSURE_SHARE = 0.5   # T caused at least this share of the blocks other tenants lost ...
PRESSURE_MARGIN = 2.0  # ... and at least this many times the share of T's losses others caused


def evictions(events: list[dict], label: Callable[[dict], str]) -> list[tuple]:
    """``(evictor tenant, owner tenant, blocks, request label)`` for every attributed eviction."""
    out = []
    for ev in events:
        kind = ev.get("event")
        if kind == "evict" and ev.get("request_id") is not None and "owner_tenant" in ev:
            out.append((ev.get("tenant"), ev.get("owner_tenant"), 1, label(ev)))
        elif kind == "summary":
            for owner, n in ev.get("evicted_owners") or ():
                out.append((ev.get("tenant"), owner, int(n), label(ev)))
    return out


def eviction_pressure(events: list[dict], label: Callable[[dict], str], min_evictions: int,
                      finding: Callable) -> list:
    """Findings of kind ``eviction_pressure`` (see the module doc); ``finding`` builds one."""
    by: dict = defaultdict(Counter)   # evictor -> owner -> blocks
    lost: Counter = Counter()         # owner -> blocks lost to anyone
    culprits: dict = defaultdict(dict)  # evictor -> labels of its requests that evicted others
    for evictor, owner, n, lab in evictions(events, label):
        by[evictor][owner] += n
        lost[owner] += n
        if owner != evictor:
            culprits[evictor][lab] = None
    total = sum(lost.values())
    out = []
    for tenant, owners in by.items():
        cross = sum(n for o, n in owners.items() if o != tenant)
        if cross < min_evictions:
            continue
        others_lost = total - lost[tenant]
        suffered = sum(c[tenant] for e, c in by.items() if e != tenant)
        pressure = cross / others_lost
        exposure = suffered / lost[tenant] if lost[tenant] else 0.0
        if pressure < PRESSURE_SHARE or pressure < PRESSURE_MARGIN * exposure:
            continue
        victims = sorted(((n, str(o)) for o, n in owners.items() if o != tenant), key=lambda v: (-v[0], v[1]))
        named = ", ".join(f"{o} {n}" for n, o in victims[:5]) + (" ..." if len(victims) > 5 else "")
        out.append(finding(
            "eviction_pressure", tenant,
            f"evicted {cross} cached block(s) of {len(victims)} other tenant(s) ({named}): "
            f"{pressure:.0%} of all the blocks other tenants lost, while others caused "
            f"{exposure:.0%} of this tenant's losses",
            tuple(culprits[tenant])))
    return out
