"""The Redis tier: sealed blocks as bytes under their tier keys, with a TTL and a per-tenant quota.

Several engines (``minikv serve`` instances) pointed at one Redis share one remote prefix cache:
a block one instance computed is a hit on another.  That is the whole value of a remote tier, and
exactly why its keys must carry the tenant key (LMCache #4825: they did not) and its values a MAC
and encryption (a shared store is readable and writable by more than one engine).

* **TTL** (``ttl``, seconds, default 3600): every value expires; Redis itself drops it.
* **Per-tenant quota** (``budget_mib``, default 256): each tenant holds at most that many bytes
  of values in the store, counted under the tenant's *opaque* tag (``Sealer.tenant_tag`` of the
  API-key tenant: a keyed hash, never the name; a client's ``cache_salt`` narrows its cache
  domain but is the same tenant here, so rotating salts buys no room).  A write that would pass
  the quota first drops the *same tenant's* oldest values: a tenant's writes displace only its
  own blocks, never a neighbour's (prime-and-probe one level down, and the "KV cache flood").
  One Lua script does the accounting, the displacement and the write atomically, so instances
  sharing the store never race on a tenant's count, and a write Redis refuses (``noeviction``
  at ``maxmemory``) is not charged.
* Sizing: Redis evicts by its own policy (``allkeys-lru``) or refuses writes (``noeviction``)
  only past ``maxmemory``; with ``maxmemory`` above the quotas of the tenants expected at once
  (plus Redis's per-key overhead), neither ever happens and the quotas alone decide.
* A failed connection or command is a miss, never an error of the request: the tier is a cache.
  The link calls it off the engine's step thread, with a deadline (:mod:`~minikv.tiers.offthread`).

Spec: ``redis://HOST:PORT/DB?ttl=SECONDS&budget_mib=MIB&deadline_ms=MS``, parsed strictly by
:func:`redis_options`.
"""
from __future__ import annotations

import logging
from urllib.parse import urlsplit

from .options import number_option, spec_error

log = logging.getLogger("minikv.tiers")

MAX_DB = 15  # Redis's default ``databases 16``
MAX_TTL = 10 * 365 * 86400  # ten years: any longer is a typo, not a cache setting
MAX_BUDGET_MIB = 1 << 20  # 1 TiB per tenant
MAX_DEADLINE_MS = 60_000

# KEYS: value key, the tenant's key set (sorted by write order), their sizes, its byte count.
# ARGV: value, ttl, quota.  The write order is the server's clock (one clock for every instance).
# Returns {1 stored | 0 refused by Redis | -1 larger than
# the quota, values of this tenant dropped to make room}.  Commands that free memory (ZREM, HDEL,
# DEL) run even at maxmemory; a refused SET leaves the count as it was, less what was dropped.
_PUT = """
local n = string.len(ARGV[1])
local quota = tonumber(ARGV[3])
if n > quota then return {-1, 0} end
local used = tonumber(redis.call('GET', KEYS[4]) or '0')
local old = redis.call('HGET', KEYS[3], KEYS[1])
if old then
  used = used - tonumber(old)
  redis.call('ZREM', KEYS[2], KEYS[1])
  redis.call('HDEL', KEYS[3], KEYS[1])
end
local dropped = 0
while used + n > quota do
  local oldest = redis.call('ZRANGE', KEYS[2], 0, 0)
  if #oldest == 0 then break end
  used = used - tonumber(redis.call('HGET', KEYS[3], oldest[1]) or '0')
  redis.call('ZREM', KEYS[2], oldest[1])
  redis.call('HDEL', KEYS[3], oldest[1])
  redis.call('DEL', oldest[1])
  dropped = dropped + 1
end
if used < 0 then used = 0 end
local ok = redis.pcall('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
if type(ok) == 'table' and ok.err then
  redis.pcall('SET', KEYS[4], used, 'EX', ARGV[2])
  return {0, dropped}
end
local now = redis.call('TIME')
redis.pcall('ZADD', KEYS[2], tonumber(now[1]) * 1000000 + tonumber(now[2]), KEYS[1])
redis.pcall('HSET', KEYS[3], KEYS[1], n)
redis.pcall('SET', KEYS[4], used + n, 'EX', ARGV[2])
redis.pcall('EXPIRE', KEYS[2], ARGV[2])
redis.pcall('EXPIRE', KEYS[3], ARGV[2])
return {1, dropped}
"""


def redis_options(spec: str, query: dict) -> dict:
    """The keyword arguments of :class:`RedisTier` for ``spec``, checked without connecting:
    ValueError names the bad value (a database out of range, ``budget_mib=inf``, a bad port)."""
    parts = urlsplit(spec)
    try:
        port = parts.port
    except ValueError:
        raise spec_error(spec, f"the port must be a number in 0-65535, got {parts.netloc.rpartition(':')[2]!r}") from None
    if not parts.hostname:
        raise spec_error(spec, "it names no host (redis://HOST:PORT/DB)")
    db = parts.path.lstrip("/") or "0"
    if not (db.isdigit() and db.isascii() and int(db) <= MAX_DB):
        raise spec_error(spec, f"the database must be a number in 0-{MAX_DB}, got {db!r}")
    ttl = number_option(spec, query, "ttl", "3600", minimum=1, maximum=MAX_TTL, integer=True)
    budget = number_option(spec, query, "budget_mib", "256", minimum=0, maximum=MAX_BUDGET_MIB)
    deadline = number_option(spec, query, "deadline_ms", "100", minimum=0, maximum=MAX_DEADLINE_MS)
    netloc = f"{parts.hostname}:{port}" if port is not None else parts.hostname
    if ":" in parts.hostname:  # IPv6
        netloc = f"[{parts.hostname}]" + (f":{port}" if port is not None else "")
    return dict(url=f"redis://{netloc}/{int(db)}", ttl=int(ttl), budget=max(1, int(budget * (1 << 20))),
                deadline=deadline / 1000)


class RedisTier:
    name, when = "redis", "store"
    blocking = True  # network I/O: the link runs it off the step thread (offthread.OffThread)

    def __init__(self, url: str, *, ttl: int = 3600, budget: int = 256 << 20, deadline: float = 0.1,
                 client=None):
        if ttl <= 0 or budget <= 0 or deadline < 0:
            raise ValueError(f"redis tier {url!r}: ttl and budget must be > 0 and deadline >= 0, "
                             f"got ttl={ttl}, budget={budget}, deadline={deadline}")
        self.url, self.ttl, self.budget, self.deadline = url, ttl, budget, deadline
        if client is None:
            try:
                import redis
            except ImportError:
                raise ImportError("the redis tier needs the redis client: pip install 'minikv[tiers]' "
                                  "(or pip install redis)") from None
            client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.client = client
        self._put = client.register_script(_PUT)
        self.stats = dict(puts=0, hits=0, misses=0, refused_budget=0, refused_store=0, displaced=0, errors=0)

    @classmethod
    def from_spec(cls, spec: str, query: dict) -> "RedisTier":
        return cls(**redis_options(spec, query))

    def _quota_keys(self, tenant_tag: str) -> list[bytes]:
        base = f"minikv/quota/v1/{tenant_tag}"
        return [f"{base}/keys".encode(), f"{base}/sizes".encode(), f"{base}/bytes".encode()]

    def put(self, key: bytes, value: bytes, tenant_tag: str) -> bool:
        """Store ``value`` within ``tenant_tag``'s quota, dropping that tenant's oldest values if
        need be; False when it is larger than the quota, Redis refuses it, or Redis is unreachable
        (nothing is charged then)."""
        import redis
        try:
            status, dropped = self._put(keys=[key, *self._quota_keys(tenant_tag)],
                                        args=[value, self.ttl, self.budget])
        except redis.RedisError as exc:
            self._error("put", exc)
            return False
        self.stats["displaced"] += int(dropped)
        if int(status) != 1:
            self.stats["refused_budget" if int(status) < 0 else "refused_store"] += 1
            return False
        self.stats["puts"] += 1
        return True

    def used(self, tenant_tag: str) -> int:
        """Bytes ``tenant_tag`` holds in the store by its count (for operators and tests)."""
        return int(self.client.get(self._quota_keys(tenant_tag)[2]) or 0)

    def get(self, key: bytes) -> bytes | None:
        import redis
        try:
            value = self.client.get(key)
        except redis.RedisError as exc:
            self._error("get", exc)
            return None
        self.stats["hits" if value is not None else "misses"] += 1
        return value

    def evict(self, key: bytes) -> None:
        """Drop a value that failed verification (its tenant's count catches up when the tenant's
        own writes reach it in the write order: a deleted key frees nothing twice)."""
        import redis
        try:
            self.client.delete(key)
        except redis.RedisError as exc:
            self._error("delete", exc)

    def _error(self, what: str, exc: Exception) -> None:
        self.stats["errors"] += 1
        if self.stats["errors"] <= 3 or self.stats["errors"] % 1000 == 0:  # a dead store must not flood the log
            log.warning("redis tier %s: %s failed (%s); treated as a miss", self.url, what, type(exc).__name__)
