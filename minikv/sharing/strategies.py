"""Selective sharing (``cache_isolation="selective"``): win back the hits isolation costs, but not for secrets.

``"tenant"`` isolation keys every block with its tenant's key: no tenant ever hits another's
block, so N tenants sharing one system prompt each pay its prefill.  ``"shared"`` hashes every
block without a key: the system prompt is computed once, and every private prompt becomes an
oracle (lesson 04).  A *strategy* decides, per block, which of the two domains it lives in.  The
strategies are a registry (``STRATEGIES``), chosen by ``EngineConfig.selective_strategy``:

``k_tenants`` (default, ``selective_k=3``) -- **promotion by independent demand.**
    Every block starts in its writer's private domain.  The engine counts, per *content*, the
    distinct tenants that computed it under their own keys (the operator-keyed content
    fingerprint of :mod:`minikv.security.content`, which no tenant can observe).  When the k-th
    distinct tenant computes it, its block is *promoted*: re-keyed into the public domain (the one
    ``shared_prefixes`` use), where every later request hits it.  A lone victim's secret is
    computed by one tenant, so it is never hittable by anyone else.

    **The Sybil limit.**  The promotion is itself an oracle, one bit per guess: an attacker with
    k-1 accounts sends a guess from each of them, then once more; a hit says "a k-th tenant --
    the victim -- computed this".  With fewer than k-1 accounts the guess never reaches k and the
    attack learns nothing.  So ``k`` is "how many accounts an attacker must control", and the
    operator's account controls (sign-up cost, verification) are what make k mean anything.
    **k=2 is broken**: one attacker account suffices (``unsafe_settings`` lists it).

``monitor`` -- **share by default, isolate what a detector flags** (in the spirit of
    CacheSolidarity: Pennas, Papaioannou, Guarnieri and Doudali, arXiv 2603.10726, 2026).
    Blocks are hashed without a tenant key (shared across tenants, *not* marked public: the trail
    records the cross-tenant hits) except inside a flagged prefix or for a flagged tenant.  When a
    request finishes, a summary (content fingerprints, lengths, tenant; no text) goes to a
    :class:`ReuseMonitor`; minikv's is :class:`minikv.audit.monitor.DetectorMonitor`, the audit
    detector's probing rule, handed in through ``EngineConfig.reuse_monitor`` (the engine never
    imports ``minikv.audit``).  A flagged tenant's requests are private from then on, and so are
    the continuations of a flagged prefix; their registered blocks are *isolated*: re-keyed into
    their writer's private domain.  **Before the first flag it is the shared cache**: whatever an
    attack learns in fewer probes than the detector's threshold (8 by default), it keeps.

**Private marks** (both strategies).  Two marks keep blocks in their writer's private domain
whatever the strategy would do -- never opened to other tenants, never counted towards a
promotion, never promoted: a request its *tenant* marks private (``add_request(...,
cache_private=True)``, ``LLM.generate(..., cache_private=True)``: every block of it), and what
the *operator* marks sensitive (``EngineConfig.sensitive_prefixes``: token sequences marking
the start of sensitive content, wherever they occur in a prompt; the block holding a match's
first token and every block after it).  The request's own tenant still hits those blocks from
its later private requests (the same tenant key, the same hash); nobody else can, so neither the
count oracle nor the promotion oracle sees them.  Each mark that applies is a ``private``
record in the trail (fingerprint of the first private block, the reason; no text).  Under
``"tenant"`` isolation everything is private already; under UNSAFE ``"shared"`` a
``cache_private`` request is hashed with its tenant key too (the flag's promise does not
depend on the policy), and ``sensitive_prefixes`` are refused there (ValueError).

Blocks inside ``shared_prefixes`` are public under every strategy (a private mark included); quotas, scrubbing,
``verify_hits`` and the audit trail are unchanged (a re-key changes a block's key, never its
K/V, holders or state).  Every promotion, flag and isolation is an audit-trail ``sharing`` record
with keyed fingerprints and no prompt text (``decide``), and every re-keyed block is a ``promote``
or ``isolate`` transition of the lifecycle table.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

from ..security.content import content_fingerprints, content_tail, derive_content_key
from ..engine.lifecycle import BlockIdentity, Transition


@dataclass(frozen=True)
class Flag:
    """A monitor's verdict: make ``tenant``'s requests private (if not None) and the
    continuations of the prefix whose content fingerprint is ``prefix_fp`` (if not None)."""

    tenant: str | None
    prefix_fp: str | None
    reason: str  # for the operator's trail: counts and tenant names, never prompt text


class ReuseMonitor(Protocol):
    """What the ``monitor`` strategy consults: ``observe`` gets one record per finished request,
    shaped like an audit-trail ``summary`` (``request_id``, ``tenant``, ``num_prompt_tokens``,
    ``prefix_fps``, ``tail_fp``; fingerprints are the engine's content fingerprints) and returns
    the flags it raises now.  ``EngineConfig.reuse_monitor`` is a factory: ``factory(config)``."""

    def observe(self, record: dict) -> list[Flag]: ...


Decide = Callable[..., None]  # decide(kind, **fields): one audit-trail "sharing" record


class _Strategy:
    """What both strategies share: content fingerprints, the re-key, the decision records."""

    name = ""

    def __init__(self, config, block_manager, secret: bytes, tenant_key: Callable, decide: Decide):
        self.bm, self.tenant_key, self.decide = block_manager, tenant_key, decide
        self.bs = block_manager.block_size
        self._key = derive_content_key(secret)  # never leaves this object
        self.max_tracked = 8 * block_manager.num_blocks  # bounds the memory of demand/promotions

    def fingerprints(self, seq, n_blocks: int) -> list[str]:
        """Content fingerprints of ``seq``'s first ``n_blocks`` full blocks (kept on the sequence)."""
        return content_fingerprints(self._key, seq.token_ids, self.bs, seq.content_fps, n_blocks)

    sensitive: list[list[int]] = []  # the operator's sensitive_prefixes as token ids (set by the engine)

    def admit(self, seq) -> None:
        """Set the domains of a new request's blocks (``seq.public_len`` / ``seq.open_len``):
        the strategy's choice, but never past a private mark (``seq.private_from``)."""
        n = seq.num_prompt_tokens // self.bs
        start = 0 if seq.cache_private else first_match(seq.prompt_token_ids, self.sensitive)
        if start is not None:
            seq.private_from = start // self.bs
            fps = self.fingerprints(seq, n)[seq.private_from:seq.private_from + 1]
            self.decide("private", strategy=self.name, tenant=seq.tenant, fps=fps,
                        reason="cache_private" if seq.cache_private else "sensitive_prefixes",
                        blocks=max(0, n - seq.private_from))
        self.open(seq, min(n, seq.private_from if seq.private_from is not None else n))

    def open(self, seq, n: int) -> None:
        """Open or make public what the strategy shares among the first ``n`` full blocks."""

    def finish(self, seq) -> None:
        """A request finished or was aborted."""

    def on_block_event(self, transition, ids: list[int], seq) -> None:
        """A block-manager listener: blocks ``ids`` were stored by ``seq`` (other transitions: no-op)."""
        if transition != Transition.STORE or seq is None or not ids:
            return
        pos = {bid: i for i, bid in enumerate(seq.block_table)}
        limit = seq.private_from if seq.private_from is not None else len(seq.block_table)
        for bid in sorted(ids, key=pos.__getitem__):
            i = pos[bid]
            if i < limit and not self.bm.blocks[bid].public:  # a private mark: no demand, no opening
                self.stored(seq, i, bid, self.fingerprints(seq, i + 1)[i])

    def stored(self, seq, i: int, bid: int, fp: str) -> None:
        raise NotImplementedError

    def rekey(self, bid: int, domain: bytes | None, transition: Transition, seq) -> bool:
        """Re-key registered block ``bid`` into ``domain`` (None: public), keeping its K/V, parent
        and state: the hash a request of that domain computes for the same tokens after the same
        parent.  A taken hash (or a parent no longer there) gets an unreachable random key
        instead, so a block leaving the shared domain can never stay hittable there."""
        block = self.bm.blocks[bid]
        ident = block.identity
        parent = self.bm.blocks[ident.parent[0]] if ident.parent is not None else None
        parent_ok = parent is None or (parent.ref == ident.parent and parent.hash is not None)
        if parent_ok:
            link = parent.hash if (parent is not None and self.bm.chain_hashes) else None
            new = self.bm.hasher(link, ident.tokens, (), domain)
            if new not in self.bm.hash_table:
                return self.bm.rekey(bid, new, BlockIdentity(ident.tokens, ident.parent, domain),
                                     domain is None and transition == Transition.PROMOTE, transition, seq)
        if transition == Transition.PROMOTE:
            return False  # nothing to promote into: the block stays private
        return self.bm.rekey(bid, os.urandom(32), ident, False, transition, seq)


def first_match(ids: list[int], patterns: list[list[int]]) -> int | None:
    """Where the earliest occurrence of any of ``patterns`` starts in ``ids`` (None: nowhere)."""
    starts = [s for p in patterns for s in range(len(ids) - len(p) + 1)
              if ids[s] == p[0] and ids[s:s + len(p)] == p]
    return min(starts, default=None)


def _touch(lru: OrderedDict, key, limit: int):
    """``lru[key]`` made most recent (created as a set when new); the oldest go past ``limit``.
    Forgetting is always safe here: it only makes sharing rarer."""
    value = lru.pop(key, None)
    lru[key] = value if value is not None else set()
    while len(lru) > limit:
        lru.popitem(last=False)
    return lru[key]


class KTenants(_Strategy):
    """Promote a block's content once ``k`` distinct tenants computed it (see the module doc)."""

    name = "k_tenants"

    def __init__(self, config, *args):
        super().__init__(config, *args)
        self.k = config.selective_k
        self.demand: OrderedDict[str, set] = OrderedDict()    # content fp -> tenants that computed it
        self.promoted: OrderedDict[str, set] = OrderedDict()  # content fps now public

    def open(self, seq, limit: int) -> None:
        fps = self.fingerprints(seq, limit)[:limit]
        n = 0
        while n < len(fps) and fps[n] in self.promoted:
            _touch(self.promoted, fps[n], self.max_tracked)
            n += 1
        seq.public_len = max(seq.public_len, n * self.bs)

    def stored(self, seq, i: int, bid: int, fp: str) -> None:
        if fp in self.promoted:
            return  # promoted after this request was admitted: its private copy ages out
        tenants = _touch(self.demand, fp, self.max_tracked)
        tenants.add(seq.tenant)
        if len(tenants) < self.k:
            return
        del self.demand[fp]
        _touch(self.promoted, fp, self.max_tracked)
        # In place: this block's K/V are the content's, so it becomes the public copy -- if the
        # block before it is public too (a public block's parent must be public to be reachable).
        prev = self.bm.blocks[seq.block_table[i - 1]] if i else None
        moved = (prev is None or prev.public) and self.rekey(bid, None, Transition.PROMOTE, seq)
        self.decide("promote", strategy=self.name, tenant=seq.tenant, fps=[fp], blocks=int(moved),
                    tenants=len(tenants), k=self.k)


class Monitor(_Strategy):
    """Share by default; isolate flagged tenants and the continuations of flagged prefixes."""

    name = "monitor"

    def __init__(self, config, *args):
        super().__init__(config, *args)
        self.monitor: ReuseMonitor = config.reuse_monitor(config)
        self.flagged_tenants: set = set()
        self.flagged_prefixes: set[str] = set()  # 16-hex content fingerprints (the records' width)
        self.open_blocks: dict[int, tuple[int, list[str], int]] = {}  # bid -> (generation, fps, index)
        self.num_flags = 0

    def open(self, seq, limit: int) -> None:
        if seq.tenant in self.flagged_tenants:
            return  # its domain key everywhere (shared_prefixes aside)
        fps = self.fingerprints(seq, limit)[:limit]
        n = next((j + 1 for j, fp in enumerate(fps) if fp[:16] in self.flagged_prefixes), len(fps))
        seq.open_len = n * self.bs

    def stored(self, seq, i: int, bid: int, fp: str) -> None:
        if seq.domain_key(i, self.bs) is None:  # stored in the shared domain: may need isolating
            self.open_blocks[bid] = (self.bm.blocks[bid].generation, seq.content_fps, i)

    def finish(self, seq) -> None:
        fps = self.fingerprints(seq, seq.num_prompt_tokens // self.bs)
        record = {"event": "summary", "request_id": seq.request_id, "tenant": seq.tenant,
                  "num_prompt_tokens": seq.num_prompt_tokens, "prefix_fps": [fp[:16] for fp in fps],
                  "tail_fp": content_tail(self._key, seq.prompt_token_ids)[:16]}
        for flag in self.monitor.observe(record):
            self.apply(flag)

    def apply(self, flag: Flag) -> None:
        """Flag a tenant (and a prefix, if named); isolate the registered shared blocks they cover."""
        self.num_flags += 1
        self.flagged_tenants.add(flag.tenant)  # None is the anonymous tenant, a tenant like others
        prefix = flag.prefix_fp[:16] if flag.prefix_fp else None
        if prefix is not None:
            self.flagged_prefixes.add(prefix)
        hit = []
        for bid, (gen, fps, i) in list(self.open_blocks.items()):
            block = self.bm.blocks[bid]
            if block.generation != gen or block.hash is None:
                del self.open_blocks[bid]  # evicted and reused since: nothing to isolate
            elif block.writer_tenant == flag.tenant or (prefix is not None and any(
                    fp[:16] == prefix for fp in fps[:i])):  # the flagged tenant's, or a continuation
                hit.append((i, bid))
        self.decide("flag", strategy=self.name, tenant=flag.tenant, fps=[prefix] if prefix else [],
                    reason=flag.reason)
        moved = 0
        for i, bid in sorted(hit):  # parents first: a child's new key chains on its parent's
            moved += self.rekey(bid, self.tenant_key(self.bm.blocks[bid].writer_tenant), Transition.ISOLATE, None)
            del self.open_blocks[bid]
        self.decide("isolate", strategy=self.name, tenant=flag.tenant, fps=[prefix] if prefix else [],
                    blocks=moved)


STRATEGIES: dict[str, type] = {cls.name: cls for cls in (KTenants, Monitor)}


def make_sharing(config, block_manager, secret: bytes, tenant_key: Callable, decide: Decide):
    """The strategy object for ``config`` (None unless ``cache_isolation="selective"`` with prefix
    caching on: without a cache there is nothing to share)."""
    if config.cache_isolation != "selective" or not config.enable_prefix_caching:
        return None
    return STRATEGIES[config.selective_strategy](config, block_manager, secret, tenant_key, decide)
