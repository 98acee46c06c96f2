"""The cached (evictable) blocks, in least-recently-used order -- overall and per tenant.

The block manager asks three questions of its cached blocks, on hot paths:

* which block has been idle longest?  (the LRU victim when the free list is empty);
* which of *this tenant's* blocks has been idle longest?  (a tenant recycles its own cache
  first, and a tenant over its quota loses its oldest blocks: lesson 10);
* how many blocks has a tenant registered?  (its quota)

Scanning every cached block to answer the second would make each allocation and each commit
cost O(cache size).  So each block sits in two ordered dicts -- one for everyone, one for its
writer's tenant -- and every answer costs O(1) per block returned.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator


class CachedLRU:
    """Block ids in LRU order (oldest first), indexed by the tenant that wrote them.

    Behaves like the ``OrderedDict`` it replaces for reading (``in``, ``len``, iteration
    oldest-first, ``pop(bid, default)``); ``add`` needs the writer's tenant."""

    def __init__(self) -> None:
        self._all: OrderedDict[int, str | None] = OrderedDict()  # block id -> writer tenant
        self._by_tenant: dict[str | None, OrderedDict[int, None]] = {}

    def add(self, bid: int, tenant: str | None) -> None:
        """``bid`` became cached now: it is the most recently used (goes last)."""
        self.pop(bid)
        self._all[bid] = tenant
        self._by_tenant.setdefault(tenant, OrderedDict())[bid] = None

    def pop(self, bid: int, default=None):
        """Remove ``bid`` (it is being reused or evicted); returns its tenant, or ``default``."""
        if bid not in self._all:
            return default
        tenant = self._all.pop(bid)
        mine = self._by_tenant[tenant]
        del mine[bid]
        if not mine:
            del self._by_tenant[tenant]
        return tenant

    def oldest(self) -> int | None:
        """The longest-idle block, or None when nothing is cached."""
        return next(iter(self._all), None)

    def oldest_of(self, tenant: str | None) -> int | None:
        """``tenant``'s longest-idle block, or None (None is a tenant: the anonymous one)."""
        return next(iter(self._by_tenant.get(tenant, ())), None)

    def tenant_of(self, bid: int) -> str | None:
        """The tenant ``bid`` is filed under (its writer's); KeyError if it is not cached."""
        return self._all[bid]

    def of(self, tenant: str | None) -> list[int]:
        """``tenant``'s cached blocks, oldest first."""
        return list(self._by_tenant.get(tenant, ()))

    def __contains__(self, bid: int) -> bool:
        return bid in self._all

    def __iter__(self) -> Iterator[int]:
        return iter(self._all)

    def __len__(self) -> int:
        return len(self._all)

    def check(self) -> None:
        """Raise AssertionError if the two indexes disagree (used by ``check_invariants``)."""
        assert sum(len(d) for d in self._by_tenant.values()) == len(self._all), "tenant index size"
        for tenant, ids in self._by_tenant.items():
            assert ids, f"empty index kept for tenant {tenant!r}"
            for bid in ids:
                assert self._all.get(bid, object()) == tenant, f"block {bid} indexed under {tenant!r}"
        order = {bid: k for k, bid in enumerate(self._all)}
        for ids in self._by_tenant.values():
            ranks = [order[b] for b in ids]
            assert ranks == sorted(ranks), "a tenant's blocks are out of LRU order"
