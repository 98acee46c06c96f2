# GENERATED from solutions/ex3_scrubbing.py by `python -m minikv.grading.make_exercises`.
# This file is yours: replace every `raise NotImplementedError` with your implementation,
# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the
# reference solution uses.  Course maintainers: edit solutions/ex3_scrubbing.py and regenerate; never
# edit this file by hand.
"""Exercise 3 (lesson 08): scrubbing KV blocks, at the right moment of their life.

A freed KV block keeps its previous owner's keys and values until something overwrites them,
and layer-0 K/V invert straight back to tokens (lessons 01 and 05).  A scrubber zeroes blocks
so that no request can ever be handed another request's leftovers.

* 3a ``zero_blocks`` -- zero exactly the given blocks, in every layer, K and V, with one
  indexed write per tensor (no Python loop over blocks: on a GPU, one kernel launch);
* 3b ``ScrubOnAlloc`` -- the engine's ``Scrubber`` seam.  The engine calls
  ``on_free(pool, ids)`` when blocks leave the prefix cache (evicted) or are released
  uncached, and ``on_alloc(pool, ids)`` when it hands blocks to a request *without* a
  prefix-cache hit, just before the new owner writes them.

The pool tensors are ``pool.k_cache`` and ``pool.v_cache``, both shaped
``[num_layers, num_blocks, block_size, num_kv_heads, head_dim]``.

Plug it in with ``LLM(..., scrubber=ScrubOnAlloc())``.  Grade with ``check_zero_blocks`` and
``check_scrubber``.
"""
from __future__ import annotations

import torch


def zero_blocks(pool, block_ids: list[int]) -> None:
    """Overwrite blocks ``block_ids`` of ``pool`` with zeros: every layer, both K and V.

    Contract:

    * afterwards ``pool.k_cache[:, b]`` and ``pool.v_cache[:, b]`` are all zeros for every
      ``b`` in ``block_ids`` (any order, possibly several blocks, possibly none);
    * every other block is untouched (other blocks hold other requests' live K/V, or cached
      prefixes that later requests will hit);
    * works on any object with ``k_cache`` / ``v_cache`` tensors: do not call
      ``pool.zero_blocks`` (that is the engine's own answer to this exercise).

    Hints:

    * the block dimension is dim **1** (dim 0 is the layer); ``pool.k_cache[ids] = 0`` would
      zero whole *layers*;
    * ``tensor.index_fill_(1, idx, 0)`` with ``idx = torch.as_tensor(ids, dtype=torch.long,
      device=tensor.device)`` is one kernel per tensor; ``pool.k_cache[:, idx] = 0`` works too;
    * an empty list must be a no-op (and should not launch anything).
    """
    raise NotImplementedError("zero_blocks: not implemented yet (read the docstring, then write your code here)")


class ScrubOnAlloc:
    """Zero a block just before a new owner writes it (when it is handed out without a hit).

    Contract:

    * ``on_alloc(pool, ids)`` zeroes exactly ``ids`` (all layers, K and V);
    * ``on_free(pool, ids)`` may do nothing: the data may still be hit in the prefix cache
      until eviction, and ``on_alloc`` will wipe it before anyone else can see it (scrubbing
      in ``on_free`` too would be safe, but twice the work);
    * with this scrubber the engine never hands a request a block that still holds someone
      else's K/V, and never destroys K/V that a running request or a cache hit still needs.

    Hints:

    * which blocks must *never* be scrubbed?  Blocks a request receives as a prefix-cache *hit*
      (the engine does not call ``on_alloc`` for those), and blocks the new owner has already
      written (so scrub before the model step, never after, and never "later, in a batch");
    * ``hooks`` lists the hooks that really zero memory; the engine's audit trail logs a
      ``scrub`` event only for those.
    """

    hooks = frozenset({"on_alloc"})

    def on_free(self, pool, block_ids: list[int]) -> None:
        raise NotImplementedError("ScrubOnAlloc.on_free: not implemented yet (read the docstring, then write your code here)")

    def on_alloc(self, pool, block_ids: list[int]) -> None:
        raise NotImplementedError("ScrubOnAlloc.on_alloc: not implemented yet (read the docstring, then write your code here)")
