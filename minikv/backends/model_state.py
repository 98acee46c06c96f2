"""What the fast paths prepare for a model, kept beside the model object, never on it.

Packed weights (``matmuls.py``), the few-row matmul's panels and the RoPE lookup tables
(``fused_plan.py``, ``fused_hit.py``) are made once per model and shared by every engine on the
same weights (forks, and engines built by name: ``minikv.llm.shared_weights``), so they are keyed
by the model, weakly: they go when the model goes, and the model itself carries none of them.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass


@dataclass
class Prepared:
    """One model's prepared state; None until a step first needs it."""

    packed: list | None = None  # matmuls.PackedLayer per layer (oneDNN's packed weights)
    packed_head: object = None  # the LM head, packed
    skinny: list | None = None  # matmuls.SkinnyLayer per layer (the few-row matmul's panels)
    skinny_head: tuple | None = None  # (the LM head's panels, its rows)
    rope_tables: tuple | None = None  # fused_plan.rope_tables: (cos, sin) per position, V's row last
    rope_heads_v: object = None  # which of q | k | v heads are V's (they get the last row)
    rope_perm: object = None  # fused_hit.rope_perm: rotate-half as one index


_PREPARED: "weakref.WeakKeyDictionary[object, Prepared]" = weakref.WeakKeyDictionary()


def prepared(model) -> Prepared:
    """``model``'s prepared state (made empty on first use)."""
    state = _PREPARED.get(model)
    if state is None:
        state = _PREPARED[model] = Prepared()
    return state
