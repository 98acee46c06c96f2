"""Wrong answers to exercise 3: scrubs that miss data, or destroy data that is still in use.

A recycled KV block must reach its new owner with nothing of the previous tenant in it -- in
every layer, in K and in V -- while every block still owned (cached prefixes, running requests)
keeps its contents.  The 3a mutants zero too little, too much or a copy; the 3b placements zero
on the wrong transitions, or decide by *why* a block moves (finished, aborted, an operator reset)
instead of by the transition, and so miss a path.
"""
from __future__ import annotations

from ._table import entries

# ============================================================================ 3a zero_blocks


def zero_k_only(pool, block_ids):
    """Forgets the values: V keeps the previous owner's data."""
    if block_ids:
        pool.k_cache[:, list(block_ids)] = 0


def zero_layer0_only(pool, block_ids):
    """Only layer 0 ('the one that inverts to tokens'); deeper layers leak too (Shadow in the Cache)."""
    if block_ids:
        pool.k_cache[0, list(block_ids)] = 0
        pool.v_cache[0, list(block_ids)] = 0


def zero_wrong_dim(pool, block_ids):
    """Indexes dim 0 (layers) instead of dim 1 (blocks): wipes whole layers of everyone's K/V."""
    ids = [b for b in block_ids if b < pool.k_cache.shape[0]]
    if ids:
        pool.k_cache[ids] = 0
        pool.v_cache[ids] = 0


def zero_index_fill_discarded(pool, block_ids):
    """``index_fill`` without the underscore: it returns a NEW zeroed tensor, which is dropped, so
    the pool keeps every byte (its diagnosis must not blame advanced indexing)."""
    import torch
    if block_ids:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        pool.k_cache.index_fill(1, idx, 0.0)
        pool.v_cache.index_fill(1, idx, 0.0)


def zero_on_a_copy(pool, block_ids):
    """Advanced indexing, then an in-place op: ``pool.k_cache[:, ids]`` is a COPY, so ``.zero_()``
    zeroes the copy and the pool keeps every byte."""
    import torch
    if block_ids:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        pool.k_cache[:, idx].zero_()
        pool.v_cache[:, idx].zero_()


def zero_out_of_place(pool, block_ids):
    """Builds a zeroed copy of the whole pool (twice the memory) and rebinds the attributes."""
    import torch
    if block_ids:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        pool.k_cache = pool.k_cache.index_fill(1, idx, 0)
        pool.v_cache = pool.v_cache.index_fill(1, idx, 0)


def zero_loop_over_blocks(pool, block_ids):
    """Right bytes, wrong cost: a Python loop that zeroes one block at a time, a write (on a GPU, a kernel
    launch) per block and tensor, where the contract asks for one indexed write per tensor."""
    for b in block_ids:
        pool.k_cache[:, b] = 0
        pool.v_cache[:, b] = 0


# ============================================================================ 3c write the mutant
# Wrong answers to the *mutant-writing* task: each replaces sneaky_zero_blocks_a (the reference's
# sneaky_zero_blocks_b, a slice over the ids' range, stays beside it).


def sneaky_same_class(pool, block_ids):
    """A second spelling of the reference's other mutant: a loop over every id from the smallest to
    the largest, so it is caught for the very same reason (blocks between the ids changed)."""
    ids = list(block_ids)
    if ids:
        for b in range(min(ids), max(ids) + 1):
            pool.k_cache[:, b] = 0
            pool.v_cache[:, b] = 0


def sneaky_but_correct(pool, block_ids):
    """"Sneaky" by its name only: one ``index_fill_`` per tensor along the block dimension is 3a's
    whole contract, so 3a's grader accepts it."""
    import torch
    if block_ids:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        pool.k_cache.index_fill_(1, idx, 0)
        pool.v_cache.index_fill_(1, idx, 0)


def sneaky_values_only(pool, block_ids):
    """Zeroes V and forgets K: wrong, but exactly where the smoke test looks (layer 0's K of the
    block it zeroed), so the quickest test already catches it."""
    if block_ids:
        pool.v_cache[:, list(block_ids)] = 0


def sneaky_crashes_on_empty(pool, block_ids):
    """``torch.tensor(block_ids)``: an empty list becomes a *float* tensor, and ``index_fill_``
    refuses a float index, so the first empty scrub raises (the smoke test never sends one)."""
    import torch
    idx = torch.tensor(list(block_ids))
    pool.k_cache.index_fill_(1, idx, 0)
    pool.v_cache.index_fill_(1, idx, 0)


# ============================================================================ 3b placement
# Each decides ZERO/KEEP per lifecycle event (transition, seq); exercise 3b's PlacedScrubber runs it.

from ...engine.lifecycle import Transition as _T  # noqa: E402
from ...engine.sequence import SequenceStatus as _S  # noqa: E402

_INTO_FREE_LIST = (_T.FREE, _T.EVICT)


def place_wipe_hits(transition, seq):
    """'Scrub every time a block changes hands', hits included: a hit's K/V are wiped before the
    hitting request reads them."""
    _T(transition)
    return "zero" if transition in (*_INTO_FREE_LIST, _T.HIT) else "keep"


def place_wipe_onload(transition, seq):
    """'Zero whatever enters the pool from outside': a block ONLOADED from a KV tier is wiped before the
    request that found it in the tier reads it, so a tier hit serves zeros."""
    _T(transition)
    return "zero" if transition in (*_INTO_FREE_LIST, _T.ONLOAD) else "keep"


def place_alloc_keeps_offload(transition, seq):
    """Zero on the way OUT of the free list only (``allocate``), like a scrub-on-alloc policy, and nothing
    else: safe for every handover, but a block sealed into a KV tier keeps its plaintext K/V in the pool
    until someone allocates it -- a pool dump reads what the tier keeps sealed."""
    _T(transition)
    return "zero" if transition is _T.ALLOCATE else "keep"


def place_wipe_adopted(transition, seq):
    """'An adopted block is a duplicate someone else computed: scrub it before the adopter reads
    it.'  That wipes the twin -- live in BOTH requests' block tables now -- instead of the copy the
    adoption lets go of (which leaves through 'free' and is zeroed there)."""
    _T(transition)
    return "zero" if transition in (*_INTO_FREE_LIST, _T.ADOPT) else "keep"


def place_compares_reason(transition, seq):
    """Orders finish reasons as if they were numbers (``seq.finish_reason > 0``): raises TypeError on
    the first request -- a crash inside the decision, not a refused transition (its diagnosis must
    not read "a transition left undecided")."""
    transition = _T(transition)
    if transition is _T.FREE and seq is not None and seq.finish_reason > 0:
        return "keep"
    return "zero" if transition in _INTO_FREE_LIST else "keep"


def place_no_adopt_row(transition, seq):
    """Written from an old list of transitions (allocate, hit, store, cache, free, evict, promote,
    isolate): right on all of them, and refuses 'adopt' as unknown."""
    transition = _T(transition)
    if transition is _T.ADOPT:
        raise ValueError(f"no scrub decision for transition {transition!r}")
    return "zero" if transition in _INTO_FREE_LIST else "keep"


def place_on_release(transition, seq):
    """'Scrub when the request lets go': zeroes blocks released INTO the cache too, so every cached
    prefix is zeros when the next request hits it."""
    _T(transition)
    return "zero" if transition in (*_INTO_FREE_LIST, _T.CACHE) else "keep"


def place_keep_evicted(transition, seq):
    """'Evicted blocks are cached data, keep them': zeroes only on 'free', so an evicted block reaches
    its next owner intact."""
    _T(transition)
    return "zero" if transition == _T.FREE else "keep"


def place_finished_only(transition, seq):
    """'Scrub when the request is done': zeroes a 'free' only for a FINISHED request -- a preempted
    request is still running when its blocks are released."""
    _T(transition)
    if transition == _T.FREE:
        return "zero" if seq is not None and seq.status == _S.FINISHED else "keep"
    return "zero" if transition == _T.EVICT else "keep"


def place_skip_aborted(transition, seq):
    """'An aborted request was cancelled, nothing to clean up': keeps the blocks of aborts."""
    _T(transition)
    if transition == _T.FREE and seq is not None and seq.finish_reason == "abort":
        return "keep"
    return "zero" if transition in _INTO_FREE_LIST else "keep"


def place_needs_a_request(transition, seq):
    """Looks at the request behind each eviction, and keeps when there is none: the operator's
    reset_prefix_cache (seq=None) frees every cached block unscrubbed."""
    _T(transition)
    if seq is None:
        return "keep"
    return "zero" if transition in _INTO_FREE_LIST else "keep"


MUTANTS = {
    "3a": entries(("k-only", zero_k_only), ("layer0-only", zero_layer0_only), ("wrong-dim", zero_wrong_dim),
                  ("on-a-copy", zero_on_a_copy), ("out-of-place", zero_out_of_place),
                  ("index-fill-discarded", zero_index_fill_discarded), ("loop-over-blocks", zero_loop_over_blocks)),
    "3b": entries(("wipe-hits", place_wipe_hits), ("wipe-adopted", place_wipe_adopted),
                  ("no-adopt-row", place_no_adopt_row), ("on-release", place_on_release),
                  ("keep-evicted", place_keep_evicted), ("finished-only", place_finished_only),
                  ("skip-aborted", place_skip_aborted), ("needs-a-request", place_needs_a_request),
                  ("compares-reason", place_compares_reason), ("wipe-onload", place_wipe_onload),
                  ("alloc-keeps-offload", place_alloc_keeps_offload)),
    "3c": entries(("same-class", sneaky_same_class), ("correct", sneaky_but_correct),
                  ("caught-by-smoke", sneaky_values_only), ("crashes-on-empty", sneaky_crashes_on_empty)),
}

#: mutant -> the words its grader's verdict must contain (the bug class it names)
DIAGNOSES = {
    ("3a", "k-only"): "V forgotten", ("3a", "layer0-only"): "only some layers zeroed", ("3a", "wrong-dim"): "wrong dimension",
    ("3a", "on-a-copy"): "COPY", ("3a", "out-of-place"): "out-of-place copy",
    ("3a", "index-fill-discarded"): "result discarded", ("3a", "loop-over-blocks"): "a write per block", ("3b", "compares-reason"): "crashed in the decision",
    ("3b", "wipe-hits"): "wipes every HIT", ("3b", "wipe-adopted"): "wipes every ADOPTED block",
    ("3b", "no-adopt-row"): "a transition left undecided", ("3b", "on-release"): "released INTO the cache",
    ("3b", "keep-evicted"): "LRU EVICTION", ("3b", "finished-only"): "PREEMPTION",
    ("3b", "skip-aborted"): "ABORT", ("3b", "needs-a-request"): "reset_prefix_cache",
    ("3b", "wipe-onload"): "ONLOADED from a tier", ("3b", "alloc-keeps-offload"): "offloaded K/V left in the pool",
    ("3c", "same-class"): "one mistake written twice", ("3c", "correct"): "not a mutant",
    ("3c", "caught-by-smoke"): "caught by the smoke test", ("3c", "crashes-on-empty"): "a crash",
}
