"""KV tiers: where a block's K/V go when the pool has no room, and where a later miss finds them.

Below the engine, not inside it: :func:`attach_tiers` plugs a :class:`~minikv.tiers.link.TierLink`
into an engine's block manager as its KV connector (``minikv.LLM`` does it); the tiers themselves
are :mod:`~minikv.tiers.kv_tiers` (the seam, the host tier, the spec registry) and
:mod:`~minikv.tiers.redis_tier` (a store shared by instances).
"""
from .kv_tiers import TIER_KEYS, TIERS, WHEN, HostTier, KVTier, is_tier, make_tier, parse_tiers
from .link import TierLink, attach_tiers

__all__ = ["TIER_KEYS", "TIERS", "WHEN", "HostTier", "KVTier", "TierLink", "attach_tiers", "is_tier",
           "make_tier", "parse_tiers"]
