"""The block manager's one hook below the pool: a KV connector (vLLM's name for what moves KV
blocks between the pool and elsewhere -- host memory, a shared store).

``offload`` runs just before a request's need evicts a cached block (True: its K/V were kept
below, the ``offload`` transition); ``fetch`` is asked on a pool miss at admission (a
:class:`Found`, or None); ``load`` then copies what it found into the free block the block manager
chose for it, every slot, and the block is registered as if computed here (``onload``).  KV tiers
(:mod:`minikv.tiers`) are one connector; the composition root attaches it.  Without one, the
pool is the whole cache: :class:`NoConnector`.
"""
from __future__ import annotations

from typing import NamedTuple


class Found(NamedTuple):
    """What a connector found for a pool miss: ``data`` (its own, handed back to its ``load``) and
    the tenant who wrote the block, as this engine should record it (the trail's writer)."""
    data: object
    writer_tenant: str | None


class NoConnector:
    """The connector of a pool that is the whole cache: below it there is nothing."""

    def offload(self, block, seq) -> bool:
        return False

    def fetch(self, seq, i: int) -> Found | None:
        return None

    def load(self, block_id: int, found: Found) -> None:
        raise AssertionError("NoConnector.fetch finds nothing, so nothing is ever loaded")
