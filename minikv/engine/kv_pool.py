"""The KV pool: one big preallocated tensor of K/V blocks, shared by every request.

PagedAttention's idea (Kwon et al., SOSP 2023) is to treat KV memory like virtual memory:
a sequence's K/V live in fixed-size *blocks* scattered anywhere in the pool, and a per-sequence
*block table* maps logical block ``i`` to a physical block id.  No sequence needs a contiguous
region, so there is no fragmentation and blocks can be shared between sequences.

The same sharing is the security problem of this course: a block outlives the request that
wrote it, so whatever guards *which* request may read it must be right.

Layout: ``k_cache[layer, block, slot, kv_head, head_dim]`` (and ``v_cache`` likewise).  A
token at position ``p`` of a sequence lives in slot ``p % block_size`` of physical block
``block_table[p // block_size]``; its flat *slot index* is ``block_id * block_size + slot``.

In memory K and V are *interleaved*: one tensor ``[layer, block, slot, 2, kv_head, head_dim]``,
each slot holding its token's K heads, then its V heads.  That is the order the fused qkv
matmul already produces them in (``q | k | v`` along a row), so the fused path stores a token's
K and V with one write, and copies a block's K and V out with one gather (one memcpy per block
instead of two).  ``k_cache`` and ``v_cache``
are strided views of that one tensor, with exactly the shape above: indexing, scrubbing and
``reshape`` work on them as on separate tensors, and write through to the pool.

Two blocks more than ``num_blocks`` are allocated.  The first is the **pad block** (id
``num_blocks``).  A batch of block tables is a rectangle, so a short sequence's row must be
padded up to the longest one's; padding with block 0 would point attention at another
request's K/V, hidden only by the mask.  The pad block is never handed out by the block manager
(its ids stop at ``num_blocks - 1``), never written (no slot maps to it) and never scrubbed, so
it is always zero.

One more block after it is the **scratch block** (id ``num_blocks + 1``): where the padding rows
of a fixed-shape batch (a CUDA-graph step of ``minikv.backends``: a batch of 3 run as a batch of 4)
write their K/V, so that they write neither the pad block nor anyone's real block.  Nobody reads it.

Where the zeros come from is the backend's :class:`PoolMemory` (``torch.zeros`` unless a backend
brings its own, such as pages mapped outside the heap on the CPU).

``k_cache`` and ``v_cache`` are views of the first ``num_blocks`` blocks: what lessons,
scrubbers and snapshots see is exactly the pool the block manager manages.
"""
from __future__ import annotations

from typing import Protocol

import torch

from ..security.scrub import zero_blocks


class PoolMemory(Protocol):
    """Where a pool's memory comes from: ``zeros(shape, dtype, device)``, and ``populate(tensor)``
    making all of it resident now (returns how, as a word)."""

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor: ...

    def populate(self, t: torch.Tensor) -> str: ...


class DeviceMemory:
    """``torch.zeros``.  Fresh pages of it are faulted in by their first writer."""

    def zeros(self, shape, dtype, device) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype, device=device)

    def populate(self, t: torch.Tensor) -> str:
        if t.device.type != "cpu":
            return "resident"  # on a GPU, torch.zeros already wrote every page
        flat = t.reshape(-1).view(torch.uint8)  # a view: the pool is contiguous
        flat[::4096].add_(0)  # one write per page, each byte written back unchanged
        return "touch"


DEVICE_MEMORY = DeviceMemory()


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """K and V, for every layer and KV head: the memory one token costs in the cache."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """The flat slot index of a sequence's token at ``position``: slot ``position % block_size``
    of physical block ``block_table[position // block_size]``."""
    return block_table[position // block_size] * block_size + position % block_size


class KVPool:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 memory: PoolMemory = DEVICE_MEMORY):
        self.num_layers, self.num_blocks, self.block_size = num_layers, num_blocks, block_size
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        # Zeros, never torch.empty: uninitialised memory would hold whatever the allocator had
        # before (another process's data on a GPU) and make every unmasked read irreproducible.
        # What scrubbing is about is different: data that *requests* wrote and then freed.
        self.memory = memory
        shape = (num_layers, num_blocks + 2, block_size, 2, num_kv_heads, head_dim)  # + pad and scratch blocks
        self._kv = memory.zeros(shape, dtype, self.device)
        self._k, self._v = self._kv[:, :, :, 0], self._kv[:, :, :, 1]  # [layers, blocks + 2, bs, kv_heads, D]
        self.k_cache, self.v_cache = self._k[:, :num_blocks], self._v[:, :num_blocks]
        # Per-layer views with one row per slot, pad and scratch blocks included: what writes index
        # ([slots, kv_heads, D] for K or V alone, [slots, 2 * kv_heads, D] for both at once).
        slots = (num_blocks + 2) * block_size
        self.k_slots = [self._k[i].view(slots, num_kv_heads, head_dim) for i in range(num_layers)]
        self.v_slots = [self._v[i].view(slots, num_kv_heads, head_dim) for i in range(num_layers)]
        self.kv_slots = [self._kv[i].view(slots, 2 * num_kv_heads, head_dim) for i in range(num_layers)]
        # ... and with one row per *block*: what gathers read.  Copying whole blocks with
        # ``index_select`` moves the same bytes as indexing every slot, in far fewer copies (one
        # memcpy per block, not per slot).  ``kv_blocks[layer]`` is [blocks + 2, bs, 2, kv_heads, D].
        self.k_blocks, self.v_blocks = list(self._k.unbind(0)), list(self._v.unbind(0))
        self.kv_blocks = list(self._kv.unbind(0))

    @property
    def pad_block(self) -> int:
        """Id of the reserved, always-zero block that pads block tables (see the module doc)."""
        return self.num_blocks

    @property
    def scratch_block(self) -> int:
        """Id of the reserved block that padding rows of graph-captured decode steps write (never read)."""
        return self.num_blocks + 1

    def prefault(self) -> str:
        """Make the whole pool resident now (its contents do not change), so that no later write
        pays a page fault.  A benchmark calls it to time the steady state."""
        return self.memory.populate(self._kv)

    @property
    def nbytes(self) -> int:
        return self.k_cache.nbytes + self.v_cache.nbytes

    def zero_blocks(self, block_ids: list[int]) -> None:
        """Scrub: overwrite every layer's K and V of these blocks with zeros
        (:func:`minikv.security.scrub.zero_blocks`: one indexed write per tensor)."""
        zero_blocks(self, block_ids)

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, kv_heads, head_dim]) at flat slot indices ``slots``."""
        self.k_slots[layer].index_copy_(0, slots, k.to(self.dtype))
        self.v_slots[layer].index_copy_(0, slots, v.to(self.dtype))

    def gather(self, layer: int, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of whole blocks for each row of ``block_tables`` ([B, max_blocks]) as
        [B, max_blocks * block_size, kv_heads, head_dim].  Slots past a sequence's length hold
        stale data, and pad-block slots zeros; attention must mask them (``attention.context_mask``)."""
        b, n = block_tables.shape  # may name the pad block (id num_blocks): zeros
        ids = block_tables.flatten()
        k = self.k_blocks[layer].index_select(0, ids).view(b, n * self.block_size, self.num_kv_heads, self.head_dim)
        v = self.v_blocks[layer].index_select(0, ids).view(b, n * self.block_size, self.num_kv_heads, self.head_dim)
        return k, v

    def read_block(self, block_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """All layers' K/V of one block ([layers, block_size, kv_heads, head_dim]); for lessons."""
        return self.k_cache[:, block_id].clone(), self.v_cache[:, block_id].clone()
