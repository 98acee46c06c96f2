"""KV tiers: where a block's K/V go when the pool has no room, and where a later miss finds them.

Production engines keep the prefix cache beyond the GPU pool: LMCache, Mooncake and SGLang's
HiCache move blocks into host memory and into remote stores shared by many instances.  minikv has
one seam for that, :class:`KVTier`, below the block manager (its KV connector is the tier link,
:mod:`~minikv.tiers.link`, which the composition root ``minikv.LLM`` attaches)::

    pool (hash table, LRU) --evict--> host tier (this process, bounded, LRU per tenant)
          |                 --store--> redis tier (shared by instances; TTL, per-tenant budget)
          '<--onload-- the first tier holding the key, on a pool miss

A tier stores opaque *sealed values* under opaque keys: the tier link
(:mod:`~minikv.tiers.link`) seals each block (MAC, per-tenant AEAD:
:mod:`minikv.security.sealing`) before a tier sees it, so no tier implementation needs to be
trusted with plaintext or with keys.  ``when`` says when a tier is written: ``"evict"`` (the
host tier: the pool's LRU evicts into it) or ``"store"`` (Redis: written as soon as a block is
full, so another instance can hit it while this one still holds it -- LMCache's store-on-prefill).

Tiers are a registry by name (``TIERS``), like hashers, scrubbers and sharing strategies; a
spec string picks one and its options: ``"host"``, ``"host?mib=64"``,
``"redis://127.0.0.1:6390/0?ttl=600&budget_mib=64"``.

``kv_tiers`` also takes a tier *object* (anything with ``name``, ``when``, ``put``, ``get`` and
``evict``: :func:`is_tier`), used as it is.  Engines given the same object share it: that is how
two instances in one process share a store without Redis (a lesson, a test)::

    store = HostTier(64 << 20, name="store", when="store")   # written on store, like Redis
    a = LLM("tiny-random", kv_tiers=["host", store], engine_secret=s)
    b = LLM("tiny-random", kv_tiers=["host", store], engine_secret=s)
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

from ..engine.checks import show
from ..engine.config import TIER_KEYS
from .options import spec_error, number_option

__all__ = ["KVTier", "HostTier", "TIERS", "TIER_KEYS", "WHEN", "is_tier", "make_tier", "parse_tiers"]

#: a tier's ``when``: the transition that writes it
WHEN = ("evict", "store")


class KVTier(Protocol):
    """The seam.  Values are bytes (a sealed block); keys are bytes (``sealing.tier_key``)."""

    name: str
    when: str  # "evict" or "store": which transition writes this tier

    def put(self, key: bytes, value: bytes, tenant_tag: str) -> bool:
        """Store ``value`` under ``key`` for the tenant named (opaquely) ``tenant_tag``; False
        when refused (over budget, full, unreachable): a tier is a cache, never required."""

    def get(self, key: bytes) -> bytes | None:
        """The value under ``key``, or None."""

    def evict(self, key: bytes) -> None:
        """Drop ``key`` (a value that failed verification is dropped this way)."""


class HostTier:
    """A bounded in-process tier: ``capacity`` bytes in all, evicting the biggest holder first.

    Holds sealed (encrypted) values even though it is in-process: a core dump or a debug endpoint
    of a host tier then leaks nothing either, and a block moves between tiers without re-sealing.

    When full, it drops the least recently used value *of the tenant holding the most bytes*,
    not the oldest value overall.  A plain LRU lets one tenant's flood push every other tenant's
    blocks out (the tier-level prime-and-probe, and a cache-flooding denial of service); this way
    a flood only evicts the flooder, and a tenant holding less than its neighbours keeps its
    blocks.  Tenants are the opaque tags the tier link passes (``tenant_tag``), so the tier still
    learns no names.

    ``name`` and ``when`` default to the host tier's; ``HostTier(n, name="store", when="store")``
    is an in-process stand-in for a shared store (written on ``store``, like the Redis tier), for
    engines in one process given the same object (see the module doc)."""

    def __init__(self, capacity: int = 256 << 20, *, name: str = "host", when: str = "evict"):
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity <= 0:
            raise ValueError(f"host tier capacity must be a positive number of bytes, got {show(capacity)}")
        if not isinstance(name, str) or not name:
            raise ValueError(f"a tier's name must be a non-empty string, got {show(name)}")
        if when not in WHEN:
            raise ValueError(f"a tier's when must be one of {', '.join(WHEN)}, got {show(when)}")
        self.name, self.when = name, when
        self.capacity, self.nbytes = capacity, 0
        self._values: OrderedDict[bytes, bytes] = OrderedDict()  # every value, least recently used first
        self._owner: dict[bytes, str] = {}  # key -> the tag of the tenant who wrote it
        self._lru: dict[str, OrderedDict[bytes, None]] = {}  # tag -> its keys, least recently used first
        self._held: dict[str, int] = {}  # tag -> bytes it holds
        self.stats = dict(puts=0, hits=0, misses=0, dropped=0)

    def put(self, key: bytes, value: bytes, tenant_tag: str) -> bool:
        if len(value) > self.capacity:
            return False
        self.evict(key)
        self._values[key], self._owner[key] = value, tenant_tag
        self._lru.setdefault(tenant_tag, OrderedDict())[key] = None
        self._held[tenant_tag] = self._held.get(tenant_tag, 0) + len(value)
        self.nbytes += len(value)
        self.stats["puts"] += 1
        while self.nbytes > self.capacity:
            biggest = max(self._held, key=self._held.__getitem__)
            self.evict(next(iter(self._lru[biggest])))
            self.stats["dropped"] += 1
        return True

    def get(self, key: bytes) -> bytes | None:
        value = self._values.get(key)
        if value is None:
            self.stats["misses"] += 1
            return None
        self._values.move_to_end(key)
        self._lru[self._owner[key]].move_to_end(key)
        self.stats["hits"] += 1
        return value

    def evict(self, key: bytes) -> None:
        old = self._values.pop(key, None)
        if old is None:
            return
        tag = self._owner.pop(key)
        del self._lru[tag][key]
        self._held[tag] -= len(old)
        if not self._lru[tag]:
            del self._lru[tag], self._held[tag]
        self.nbytes -= len(old)

    def items(self) -> list[tuple[bytes, bytes]]:
        """Every ``(key, value)``, oldest first: what a reader of this memory (a dump) sees."""
        return list(self._values.items())

    def clear(self) -> None:
        """Forget everything (a restart of the process, in tests)."""
        self._values.clear()
        self._owner.clear()
        self._lru.clear()
        self._held.clear()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._values)


def _host_options(spec: str, query: dict) -> dict:
    mib = number_option(spec, query, "mib", "256", minimum=0, maximum=MAX_HOST_MIB)
    return dict(capacity=max(1, int(mib * (1 << 20))))


def _redis_options(spec: str, query: dict) -> dict:
    from .redis_tier import redis_options  # no client import: options are checked without it
    return redis_options(spec, query)


def _redis(**options):
    from .redis_tier import RedisTier  # the redis client is imported only when asked for
    return RedisTier(**options)


#: tier name (the spec's scheme) -> (options(spec, query) -> kwargs, factory(**kwargs)); options
#: are checked strictly and without connecting; options left unread are refused
TIERS = {"host": (_host_options, HostTier), "redis": (_redis_options, _redis)}
MAX_HOST_MIB = 1 << 20  # 1 TiB of this process's memory: more is a typo


def is_tier(obj) -> bool:
    """True for a tier object (not a spec): a ``name``, a ``when`` and ``put``/``get``/``evict``."""
    return (not isinstance(obj, str) and isinstance(getattr(obj, "name", None), str)
            and hasattr(obj, "when") and all(callable(getattr(obj, m, None)) for m in ("put", "get", "evict")))


def _options(spec: str) -> tuple:
    """``(factory, kwargs)`` for a spec string, every option checked; ValueError names a bad one."""
    parts = urlsplit(spec)
    name = parts.scheme or parts.path
    if name not in TIERS:
        raise spec_error(spec, f"unknown kind; valid kinds: {', '.join(TIERS)} (e.g. 'host', 'redis://127.0.0.1:6390/0')")
    options, factory = TIERS[name]
    query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
    kwargs = options(spec, query)
    if query:
        raise spec_error(spec, f"unknown option(s) {', '.join(sorted(query))}")
    return factory, kwargs


def make_tier(spec) -> KVTier:
    """Build the tier a spec names (see the module doc); a tier object is returned as it is, to be
    shared.  ValueError names a bad spec."""
    if is_tier(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"a kv tier is a spec string such as 'host' or 'redis://127.0.0.1:6390/0', got {show(spec)}")
    factory, kwargs = _options(spec)
    return factory(**kwargs)


def parse_tiers(specs) -> tuple:
    """``kv_tiers`` as a tuple of spec strings (checked strictly, not built: building connects) and tier
    objects (kept as they are, so engines given one share it).  TypeError names an entry that is
    neither."""
    if specs is None:
        return ()
    if isinstance(specs, str) or is_tier(specs):
        specs = (specs,)
    if not isinstance(specs, (list, tuple)):
        raise TypeError(f"kv_tiers must be a list of tier specs, got {type(specs).__name__} ({show(specs)})")
    for s in specs:
        if is_tier(s):
            if s.when not in WHEN:
                raise ValueError(f"kv_tiers: tier {s.name!r} has when={show(s.when)}; valid: {', '.join(WHEN)}")
            continue
        if not isinstance(s, str):
            raise TypeError(f"kv_tiers: {show(s)} ({type(s).__name__}) is neither a tier spec string nor a "
                            "tier object (name, when, put, get, evict: minikv.tiers.KVTier)")
        _options(s)  # every option checked, nothing built or connected
    return tuple(specs)
