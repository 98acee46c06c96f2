"""Stale KV blocks: reading a previous request's K/V, and turning those bytes back into text.

Lesson 05 (``course/05_leak_stale_blocks.ipynb``) uses everything here.  Two halves:

**The inversion** (attacker side, needs only the public model weights): at layer 0 a slot's
K/V depend on one token (and, for K, its position), so a lookup over the vocabulary turns the
bytes back into text -- the simplest case of "Shadow in the Cache" (Luo et al., NDSS 2026).
How and why it works is explained in :mod:`minikv.attacks.kv_inversion`.

**The bugs** (engine side, deliberately wrong, used only by the lesson and its tests).  The
engine itself is correct; these helpers re-create two realistic bug classes on top of it:

* :func:`unmasked_decode_attention` -- decode attention that forgets to mask the unwritten
  slots of a sequence's last block, so every decode step attends over whatever the block held
  before (patches ``minikv.engine.attention.context_mask`` for the duration of a ``with``);
* :class:`BuggyAbortBlockManager` / :func:`abort_recycles_held_blocks` -- an abort path that
  returns *every* block of the aborted request to the free list, even blocks another request
  still holds (the use-after-free class of bug).

:class:`StaleReadRecorder` records exactly which stale slots a decode read and the layer-0
bytes it read there, so a lesson can state precisely what the bug exposed.

The code lives in two modules, one concept each; this module is lesson 05's entry point and
re-exports both, so ``from minikv.attacks.stale_kv import ...`` keeps working:

* :mod:`minikv.attacks.kv_inversion` -- the inversion (``layer0_kv_table``, ``invert_layer0``,
  ``render_tokens``, ``read_slots``);
* :mod:`minikv.attacks.engine_bugs` -- the deliberately buggy helpers
  (``unmasked_decode_attention``, ``spray_stale_reads``, ``abort_recycles_held_blocks``, ...).
"""
from __future__ import annotations

from .engine_bugs import (BuggyAbortBlockManager, SprayResult, StaleRead, StaleReadRecorder,
                          abort_recycles_held_blocks, buggy_context_mask, spray_stale_reads,
                          unmasked_decode_attention)
from .kv_inversion import NO_TOKEN  # noqa: F401  (not in __all__, as before; still importable here)
from .kv_inversion import Layer0Table, invert_layer0, layer0_kv_table, read_slots, render_tokens

__all__ = [
    "Layer0Table", "layer0_kv_table", "invert_layer0", "render_tokens",
    "read_slots", "StaleRead", "StaleReadRecorder", "unmasked_decode_attention",
    "buggy_context_mask", "SprayResult", "spray_stale_reads",
    "BuggyAbortBlockManager", "abort_recycles_held_blocks",
]
