"""The audit detector as the ``monitor`` strategy's live monitor (``EngineConfig.reuse_monitor``).

``cache_isolation="selective", selective_strategy="monitor"`` shares blocks across tenants until
a monitor flags a tenant (``minikv.sharing``).  The engine defines what a monitor is
(:class:`~minikv.sharing.ReuseMonitor`: records in, flags out) and never imports
``minikv.audit``; this module plugs the one detector in, so the rules an operator runs over a
trail afterwards (``minikv audit detect``) are the rules that isolate tenants live:

    LLM(model, enable_prefix_caching=True, cache_isolation="selective",
        selective_strategy="monitor", reuse_monitor=DetectorMonitor)

Each finished request's summary (content fingerprints, lengths, tenant: no text) is kept in a
window per tenant; when a tenant has ``threshold`` of them, :func:`minikv.audit.detector.detect`
runs over its window, and every new *probing* finding (one tenant enumerating continuations of
one prefix) flags that tenant and that prefix.  The detector's other rules are not used live:
cross-tenant hits are this strategy's normal operation, and eviction pressure is not something
isolation cures (quotas are).

What this cannot see is what the detector cannot see (its module doc): an attacker who needs
fewer probes than ``threshold``, spreads them over several accounts, or varies their lengths.
"""
from __future__ import annotations

from collections import deque

from ..sharing import Flag
from .detector import DEFAULT_BLOCK_SIZE, detect


class DetectorMonitor:
    """A :class:`~minikv.sharing.ReuseMonitor` built on :func:`detect` (see module doc).
    Use the class itself as the factory: ``reuse_monitor=DetectorMonitor``."""

    def __init__(self, config=None, *, threshold: int = 8, window: int = 256):
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 2:
            raise ValueError(f"threshold must be an int >= 2, got {threshold!r}")
        if isinstance(window, bool) or not isinstance(window, int) or window < threshold:
            raise ValueError(f"window must be an int >= threshold ({threshold}), got {window!r}")
        self.threshold, self.window = threshold, window
        self.block_size = getattr(config, "block_size", None) or DEFAULT_BLOCK_SIZE
        self.recent: dict = {}  # tenant -> its last ``window`` request records
        self.raised: set = set()  # (tenant, prefix fp) already flagged
        self.observed = 0

    def observe(self, record: dict) -> list[Flag]:
        self.observed += 1
        tenant = record.get("tenant")
        mine = self.recent.setdefault(tenant, deque(maxlen=self.window))
        mine.append(record)
        if len(mine) < self.threshold:
            return []
        flags = []
        for f in detect(mine, threshold=self.threshold, block_size=self.block_size):
            if f.kind == "probing" and (f.tenant, f.prefix_fp) not in self.raised:
                self.raised.add((f.tenant, f.prefix_fp))
                flags.append(Flag(f.tenant, f.prefix_fp, f.detail))
        return flags
