"""The Redis tier: sealed blocks as bytes under their tier keys, with a TTL and a per-tenant byte budget.

Several engines (``minikv serve`` instances) pointed at one Redis share one remote prefix cache:
a block one instance computed is a hit on another.  That is the whole value of a remote tier, and
exactly why its keys must carry the tenant key (LMCache #4825: they did not) and its values a MAC
and encryption (a shared store is readable and writable by more than one engine).

* **TTL** (``ttl``, seconds, default 3600): every value expires; Redis itself drops it.
* **Per-tenant byte budget** (``budget_mib``, default 256): one counter per tenant, under the
  tenant's *opaque* tag (``Sealer.tenant_tag``: a keyed hash, never the name), counts the bytes
  the tenant wrote within the TTL window; a put that would pass the budget is refused.  One tenant
  cannot flush the shared store for the others (prime-and-probe one level down).  It is a write
  budget, not an exact occupancy: values that expire early are not refunded.
* A failed connection or command is a miss, never an error of the request: the tier is a cache.

Spec: ``redis://HOST:PORT/DB?ttl=SECONDS&budget_mib=MIB``.
"""
from __future__ import annotations

import logging
from urllib.parse import urlsplit

log = logging.getLogger("minikv.tiers")


class RedisTier:
    name, when = "redis", "store"

    def __init__(self, url: str, *, ttl: int = 3600, budget: int = 256 << 20, client=None):
        if ttl <= 0 or budget <= 0:
            raise ValueError(f"redis tier {url!r}: ttl and budget must be > 0, got ttl={ttl}, budget={budget}")
        self.url, self.ttl, self.budget = url, ttl, budget
        if client is None:
            try:
                import redis
            except ImportError:
                raise ImportError("the redis tier needs the redis client: pip install 'minikv[tiers]' "
                                  "(or pip install redis)") from None
            client = redis.Redis.from_url(url, socket_timeout=2.0, socket_connect_timeout=2.0)
        self.client = client
        self.stats = dict(puts=0, hits=0, misses=0, refused_budget=0, errors=0)

    @classmethod
    def from_spec(cls, spec: str, query: dict) -> "RedisTier":
        try:
            ttl = int(query.pop("ttl", "3600"))
            budget = int(float(query.pop("budget_mib", "256")) * (1 << 20))
        except ValueError:
            raise ValueError(f"kv tier {spec!r}: ttl and budget_mib must be numbers") from None
        parts = urlsplit(spec)
        return cls(f"redis://{parts.netloc}{parts.path}", ttl=ttl, budget=budget)

    def _budget_key(self, tenant_tag: str) -> bytes:
        return f"minikv/budget/v1/{tenant_tag}".encode()

    def put(self, key: bytes, value: bytes, tenant_tag: str) -> bool:
        import redis
        try:
            used = self.client.incrby(self._budget_key(tenant_tag), len(value))
            if used > self.budget:
                self.client.decrby(self._budget_key(tenant_tag), len(value))
                self.stats["refused_budget"] += 1
                return False
            pipe = self.client.pipeline(transaction=False)
            pipe.expire(self._budget_key(tenant_tag), self.ttl)
            pipe.set(key, value, ex=self.ttl)
            pipe.execute()
        except redis.RedisError as exc:
            self._error("put", exc)
            return False
        self.stats["puts"] += 1
        return True

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
        import redis
        try:
            self.client.delete(key)
        except redis.RedisError as exc:
            self._error("delete", exc)

    def _error(self, what: str, exc: Exception) -> None:
        self.stats["errors"] += 1
        if self.stats["errors"] <= 3 or self.stats["errors"] % 1000 == 0:  # a dead store must not flood the log
            log.warning("redis tier %s: %s failed (%s); treated as a miss", self.url, what, type(exc).__name__)
