"""Where each request goes: round-robin, or prefix affinity (itself a side channel).

A prefix-aware router sends requests whose prompts start alike to the instance that already
holds those KV blocks (SGLang's cache-aware router, vLLM production-stack's prefix-aware
routing).  That raises hit rates -- and makes *which instance answers* depend on what other
tenants sent recently, which an attacker can observe.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

from ..security.encoding import encode_fields


# --------------------------------------------------------------------------- routers
class RoundRobinRouter:
    """Instance ``i mod N`` for the i-th request: perfect load spread, no cache affinity."""

    name = "round-robin"

    def __init__(self, num_instances: int):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        self.num_instances = num_instances
        self._next = 0

    def route(self, token_ids: list[int], tenant: str | None = None) -> tuple[int, str]:
        slot = self._next
        self._next = (self._next + 1) % self.num_instances
        return slot, "round-robin"

    def forget(self, slot: int) -> None:  # nothing remembered
        pass


class PrefixAffinityRouter:
    """Route by the first ``prefix_blocks`` blocks of the prompt, remembering recent routes.

    The routing key is a SHA-256 over the first ``prefix_blocks * block_size`` token ids (the
    whole prompt when it is shorter).  The router keeps an LRU index ``key -> instance`` of
    recently routed prefixes -- what SGLang's cache-aware router keeps as an approximate radix
    tree per worker and llm-d's approximate prefix scorer keeps as an LRU of prefix hashes per
    pod.  A request whose key is in the index goes to that instance (``"affinity"``); any other
    request goes to the *fallback* instance and is recorded there (``"fallback"``).

    Fallback: real routers pick the least-loaded worker.  In this synchronous simulation no
    request ever waits, so every instance is equally loaded and least-loaded with a rotating
    tie-break is round-robin: the fallback pointer advances once per fallback decision.  That
    pointer is shared state that every tenant's misses move, which is why it leaks (lesson 10).

    ``tenant_aware=True`` puts the tenant into the key, so one tenant's requests never follow
    another tenant's routes: the routing domain matches the cache-isolation domain.
    ``forget(slot)`` drops the routes to an instance (it restarted; its cache is gone).
    """

    name = "prefix-affinity"

    def __init__(self, num_instances: int, block_size: int = 16, prefix_blocks: int = 1,
                 tenant_aware: bool = False, capacity: int = 4096):
        if num_instances < 1:
            raise ValueError(f"num_instances must be >= 1, got {num_instances}")
        if block_size < 1 or prefix_blocks < 1 or capacity < 1:
            raise ValueError("block_size, prefix_blocks and capacity must be >= 1")
        self.num_instances, self.block_size, self.prefix_blocks = num_instances, block_size, prefix_blocks
        self.tenant_aware, self.capacity = tenant_aware, capacity
        self.index: OrderedDict[bytes, int] = OrderedDict()
        self._next = 0
        if tenant_aware:
            self.name = "prefix-affinity (tenant-aware)"

    def key(self, token_ids: list[int], tenant: str | None = None) -> bytes:
        head = tuple(int(t) for t in token_ids[:self.prefix_blocks * self.block_size])
        fields = ("minikv/route/v1", head) + ((tenant,) if self.tenant_aware else ())
        return hashlib.sha256(encode_fields(*fields)).digest()

    def route(self, token_ids: list[int], tenant: str | None = None) -> tuple[int, str]:
        k = self.key(token_ids, tenant)
        slot = self.index.get(k)
        if slot is not None:
            self.index.move_to_end(k)
            return slot, "affinity"
        slot = self._next
        self._next = (self._next + 1) % self.num_instances
        self.index[k] = slot
        while len(self.index) > self.capacity:
            self.index.popitem(last=False)
        return slot, "fallback"

    def forget(self, slot: int) -> None:
        for k in [k for k, s in self.index.items() if s == slot]:
            del self.index[k]


def bracket_verdict(slot_before: int, slot_after: int, num_instances: int) -> str:
    """The instance-id side channel of a router with a shared fallback pointer.

    An attacker sends a fresh control request C1 (a miss: it lands on the fallback instance
    ``a``), then its probe P, then another fresh control C2.  If P *missed* the router's index
    it consumed a fallback decision and C2 lands on ``a + 2``; if P *hit* (somebody recently
    sent P's prefix) it went to that somebody's instance and C2 lands on ``a + 1``.  Returns
    ``"seen recently"`` or ``"not seen"``.  With concurrent traffic the same logic works
    statistically; here it is exact.
    """
    return "seen recently" if slot_after == (slot_before + 1) % num_instances else "not seen"
