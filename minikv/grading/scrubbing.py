"""Graders for exercise 3: zeroing blocks (3a), and where in the block lifecycle to scrub (3b).

This module grades 3a; 3b, the placement, is graded in :mod:`minikv.grading.scrub_placement` and its
graders are re-exported here, where ``minikv.grading`` and the tests have always found them.

``check_zero_blocks`` calls the learner's function on a pool-like object filled with random
numbers and checks every element: the given blocks are zero in every layer, K and V, and not
one other element changed (a function that changed nothing at all worked on a copy).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ._report import CheckFailed, expect, grader
from .scrub_placement import check_scrub_placement, engine_stage_placement  # noqa: F401 -- 3b, re-exported

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM = 5, 9, 4, 2, 3


class FakePool:
    """Just the tensors of a pool, filled with nonzero random numbers (no ``zero_blocks``), so
    "zeroed" and "untouched" cannot be confused; tests/test_security_scrub.py uses it too."""

    def __init__(self, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        shape = (LAYERS, BLOCKS, BLOCK_SIZE, HEADS, DIM)
        self.k_cache = torch.rand(shape, generator=g) + 0.5
        self.v_cache = torch.rand(shape, generator=g) + 0.5
        self.num_layers, self.num_blocks, self.block_size = LAYERS, BLOCKS, BLOCK_SIZE
        self.num_kv_heads, self.head_dim = HEADS, DIM
        self.dtype, self.device = self.k_cache.dtype, self.k_cache.device


def _diff_report(pool, before_k, before_v, ids: list[int], call: str, must_zero: bool = True) -> None:
    """Fail with a precise message unless exactly ``ids`` are zero (when ``must_zero``) and
    every other block is unchanged."""
    for name, now, before in (("K", pool.k_cache, before_k), ("V", pool.v_cache, before_v)):
        for b in range(now.shape[1]):
            if b not in ids:
                changed = [layer for layer in range(now.shape[0]) if not torch.equal(now[layer, b], before[layer, b])]
                if changed:
                    wrong_dim = set(changed) <= set(ids)
                    raise CheckFailed(
                        f"after {call}, block {b} (not in the list) changed in {name}, layer(s) {changed}"
                        + (" -- the layers numbered like your block ids (bug class: indexed the wrong dimension)"
                           if wrong_dim else "") + ": that block may hold another request's live K/V or a cached "
                        "prefix",
                        "the pool is [layers, blocks, slots, heads, dim]: which dimension did your ids index, "
                        "and which one names a block?") if wrong_dim else CheckFailed(
                        f"after {call}, block {b} (not in the list) changed in {name}, layer(s) {changed} (bug "
                        "class: a block outside the list changed): that block may hold another request's live K/V "
                        "or a cached prefix",
                        "the pool is [layers, blocks, slots, heads, dim]: which dimension does your indexing "
                        "select along, and which blocks did your call touch besides the given ones?")
    layers = pool.k_cache.shape[0]
    if must_zero:
        for b in ids:
            dirty = {name: [layer for layer in range(layers) if cache[layer, b].abs().sum() > 0]
                     for name, cache in (("K", pool.k_cache), ("V", pool.v_cache))}
            if len(dirty["K"]) == len(dirty["V"]) == layers:
                raise CheckFailed(f"after {call}, block {b} was not zeroed at all (K and V intact in every layer) "
                                  "(bug class: a given block left intact)",
                                  "zero every block you are given, right away: the new owner receives it as soon "
                                  "as the call returns (not later, not in a batch, not only the first block).")
            for name, nonzero in dirty.items():
                if nonzero:
                    hint = ("zero both k_cache and v_cache." if len(nonzero) == layers else
                            "which layers of the block did your write reach, and along which dimension of [layers, "
                            "blocks, ...] did it index?")
                    bug = (f"{name} forgotten" if len(nonzero) == layers else "only some layers zeroed")
                    raise CheckFailed(f"after {call}, block {b} still holds {name} data in layer(s) {nonzero} "
                                      f"(bug class: {bug})", hint)


class WriteCounter(TorchFunctionMode):
    """Counts the in-place writes (``__setitem__`` and ``*_`` methods) that land in the storage of K or V,
    through the tensor itself or any view of it: the contract's "one indexed write per tensor"."""

    def __init__(self, k, v):
        super().__init__()
        self.storages = {k.untyped_storage().data_ptr(): "K", v.untyped_storage().data_ptr(): "V"}
        self.counts = {"K": 0, "V": 0}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], torch.Tensor) and (
                name == "__setitem__" or (name.endswith("_") and not name.startswith("_"))):
            which = self.storages.get(args[0].untyped_storage().data_ptr())
            if which is not None:
                self.counts[which] += 1
        return func(*args, **(kwargs or {}))


@grader("zero exactly the given blocks, along the block dimension, in every layer, in K and V, in place.")
def check_zero_blocks(zero_blocks) -> str:
    """Exercise 3a: exactly the given blocks, every layer, K and V, in place."""
    for seed, ids in enumerate(([3], [1, 4, 7], [8, 0], [], [2, 2])):
        pool = FakePool(seed)
        k, v = pool.k_cache, pool.v_cache
        before_k, before_v = k.clone(), v.clone()
        try:
            with WriteCounter(k, v) as writes:
                zero_blocks(pool, list(ids))
        except AttributeError as exc:
            if "zero_blocks" in str(exc):
                raise CheckFailed("your zero_blocks called pool.zero_blocks, which this pool does not have",
                                  "write the zeroing yourself on pool.k_cache and pool.v_cache.") from None
            raise
        expect(pool.k_cache is k and pool.v_cache is v,
               "zero_blocks replaced pool.k_cache / pool.v_cache with new tensors instead of zeroing them in place "
               "(bug class: out-of-place copy)",
               "other code holds the pool's original tensors: does your operation change them, or hand back new "
               "ones (each as large as the whole pool)?")
        if ids and torch.equal(pool.k_cache, before_k) and torch.equal(pool.v_cache, before_v):
            raise CheckFailed(f"zero_blocks(pool, {list(ids)}) changed nothing in the pool: the zeros went into a "
                              "new tensor that was then dropped -- either an in-place op on a COPY (advanced indexing "
                              "returns one) or an out-of-place op whose result was discarded (index_fill, "
                              "masked_fill, without the trailing underscore, return a new tensor) (bug class: zeros "
                              "written to a COPY / result discarded)",
                              "which tensor did your zeros land in?  Print `x is pool.k_cache` for the tensor your "
                              "operation returned or modified.")
        _diff_report(pool, before_k, before_v, list(ids), f"zero_blocks(pool, {list(ids)})")
        many = {name: n for name, n in writes.counts.items() if n > 1}
        expect(not many, f"zero_blocks(pool, {list(ids)}) wrote " + " and ".join(
               f"{name} in {n} separate in-place writes" for name, n in many.items()) + "; the contract is one "
               "indexed write per tensor (bug class: a write per block or per layer -- a Python loop where one "
               "indexed operation does it)", "on a GPU every write is a kernel launch: how many writes does your call "
               "make per tensor, and could one write take the whole list of ids?")
    return "zeroes exactly the given blocks, in every layer, K and V, in place; [] is a no-op"
