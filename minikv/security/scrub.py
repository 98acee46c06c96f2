"""Scrubbers: when freed KV blocks are overwritten with zeros.

Why scrub at all
----------------
A KV block is a slice of one big preallocated tensor.  When a request finishes, its blocks
go back to a free list, but their *contents* -- keys and values that encode the prompt --
stay in memory until something overwrites them.  If the next owner's kernel ever reads a
slot before writing it (an off-by-one in a block table, a padded attention read, a bug in
a custom kernel, a debug endpoint that dumps the pool), it reads the previous tenant's K/V.
This is the GPU analogue of reusing a heap page without clearing it ("LeftoverLocals",
CVE-2023-4969, leaked GPU local memory across processes exactly this way).  Zeroing a
block before anyone else can see it turns that whole bug class into reading zeros.

Where in the block lifecycle
----------------------------
A block is *used* (held by running requests), *cached* (ref count 0 but still in the
prefix-cache hash table, so a future request may hit it) or *free* (neither).  The states and
the transitions between them are named in ``minikv.engine.lifecycle``, whose table says which
hook runs on which transition; the engine runs it through :func:`scrub_hook`.

* ``on_free``: scrub when the data stops being reachable on purpose -- the block is
  evicted from the hash table (``evict``), or its last holder lets go of it without it ever
  being cached (``free``).  Data lives no
  longer than necessary, which also protects against memory dumps of an idle server.
  Never scrub a block that is merely *released into the cache*: that is the shared data
  the cache exists to keep.
* ``on_alloc``: scrub when a block is handed to a request *without* a prefix-cache hit,
  just before the new owner writes it.  It costs nothing for blocks that are evicted but
  never reused, and it also covers blocks that were never scrubbed on free.  Never scrub a
  *hit* block (that would destroy shared data another request is about to read), and never
  scrub after the new owner has written it (that would destroy the owner's own K/V).
* ``on_offload``: a block was sealed into a KV tier (``minikv.tiers``) just before its
  eviction; both safe scrubbers zero it then, so the pool keeps no plaintext of what left it.
* ``on_hit``, ``on_store``, ``on_cache``: optional hooks of the other transitions (none of
  minikv's scrubbers has them), so a policy can act anywhere in a block's life.

Both are correct; ``on_alloc`` is minikv's default.  ``NoScrub`` is UNSAFE and exists to
show the leak.  A scrub is one indexed write per tensor (``index_fill_`` along the block
dimension), never a Python loop over blocks: on a GPU that is one kernel launch however
many blocks are freed at once.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

__all__ = ["Scrubber", "NoScrub", "ScrubOnFree", "ScrubOnAlloc", "SCRUBBERS", "UNSAFE_SCRUBBERS",
           "make_scrubber", "scrub_hook", "zero_blocks", "zeroes"]


@runtime_checkable
class Scrubber(Protocol):
    """The seam: the engine calls these hooks on block lifecycle transitions (see
    ``minikv.engine.lifecycle.LIFECYCLE``).  Optional: ``on_hit``, ``on_store``, ``on_cache``,
    and ``hooks``, the names of the hooks that really zero memory (default: all)."""

    def on_free(self, pool, block_ids: list[int]) -> None: ...

    def on_alloc(self, pool, block_ids: list[int]) -> None: ...


def zero_blocks(pool, block_ids) -> None:
    """Zero ``block_ids`` in every layer of ``pool.k_cache`` and ``pool.v_cache``, in place.

    The one scrub of minikv (``KVPool.zero_blocks`` calls it; exercise 3a writes it): one
    ``index_fill_`` per tensor over dim 1, the block dimension of
    ``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.
    """
    ids = list(block_ids)
    if not ids:
        return  # no kernel launch, no audit noise for an empty free
    import torch  # lazily: minikv.security must stay importable without torch

    idx = torch.as_tensor(ids, dtype=torch.long, device=pool.k_cache.device)
    pool.k_cache.index_fill_(1, idx, 0)
    pool.v_cache.index_fill_(1, idx, 0)


class NoScrub:
    """UNSAFE: never scrub.  Freed blocks keep the previous owner's K/V until overwritten."""

    name, unsafe = "none", True
    hooks: frozenset[str] = frozenset()  # the hooks that actually zero memory

    def on_free(self, pool, block_ids: list[int]) -> None:
        pass

    def on_alloc(self, pool, block_ids: list[int]) -> None:
        pass


class ScrubOnFree:
    """Zero a block as soon as its data stops being reachable (evicted, or freed uncached)."""

    name, unsafe = "on_free", False
    hooks: frozenset[str] = frozenset({"on_free", "on_offload"})

    def on_offload(self, pool, block_ids: list[int]) -> None:
        zero_blocks(pool, block_ids)  # the tier holds the (sealed) K/V now: no plaintext copy stays

    def on_free(self, pool, block_ids: list[int]) -> None:
        zero_blocks(pool, block_ids)

    def on_alloc(self, pool, block_ids: list[int]) -> None:
        pass  # already zeroed when it was freed


class ScrubOnAlloc:
    """Zero a block just before a new owner (without a prefix-cache hit) writes it."""

    name, unsafe = "on_alloc", False
    hooks: frozenset[str] = frozenset({"on_alloc", "on_offload"})

    def on_offload(self, pool, block_ids: list[int]) -> None:
        # Offloaded blocks are zeroed at once under both policies: the tier keeps the K/V sealed,
        # and a plaintext copy left in a free block is what a pool dump would read.
        zero_blocks(pool, block_ids)

    def on_free(self, pool, block_ids: list[int]) -> None:
        pass  # the data may still be hit in the prefix cache; zero it on reuse instead

    def on_alloc(self, pool, block_ids: list[int]) -> None:
        zero_blocks(pool, block_ids)


def scrub_hook(scrubber, hook: str):
    """The method of ``scrubber`` named ``hook`` (the lifecycle table's hook of a transition), or
    None when the scrubber has no such optional hook."""
    return getattr(scrubber, hook, None)


def zeroes(scrubber, hook: str) -> bool:
    """Does ``hook`` of ``scrubber`` zero memory?  A scrubber lists those in ``hooks``; one
    without that attribute is taken at its word that every hook does."""
    hooks = getattr(scrubber, "hooks", None)
    return hooks is None or hook in hooks


SCRUBBERS: dict[str, type] = {cls.name: cls for cls in (NoScrub, ScrubOnFree, ScrubOnAlloc)}
UNSAFE_SCRUBBERS = frozenset({"none"})


def make_scrubber(name: str) -> Scrubber:
    """Build the registered scrubber ``name`` (``"none"``, ``"on_free"`` or ``"on_alloc"``).

    Raises:
        ValueError: unknown ``name``; the message lists the valid names.
    """
    cls = SCRUBBERS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise ValueError(f"unknown scrub policy {name!r}; valid names: {', '.join(sorted(SCRUBBERS))}")
    return cls()
