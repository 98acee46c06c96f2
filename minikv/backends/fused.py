"""The fused backends (``"fused"``, ``"cpu_kernels"``, ``"triton"``): one plan per step, lean layers.

The same forward pass as the engine's :class:`~minikv.engine.model_runner.ReferenceBackend`, with
the per-step work hoisted out of the layers (``fused_plan.py``, ``fused_hit.py``,
``attention_fused.py``), weights packed for the CPU's matmul libraries (``matmuls.py``), and on
CUDA decode-only and one-prefill steps replayed from captured graphs (``cuda_graphs.py``,
``prefill_graphs.py``).  ``"cpu_kernels"`` sends decodes, prefix hits and fresh prefills to
minikv's C++ kernels (``cpu_kernels.py``); ``"triton"`` sends prefix hits and decodes to the
Triton kernel (``paged_triton.py``).  Everything this backend keeps (its graph runners, and
through ``matmuls`` and ``fused_plan`` the packed weights and RoPE tables of each model it ran)
is its own: the model object carries none of it.
"""
from __future__ import annotations

import torch

from ..engine.kv_pool import PoolMemory, slot_of
from ..engine.model_runner import to_device_split
from ..engine.sequence import Sequence
from .attention_fused import fused_forward
from .cuda_graphs import DecodeGraphRunner
from .fused_hit import hit_lists, hit_plan, hit_seqs
from .fused_plan import build_plan, in_place_lists, in_place_plan, reads_in_place
from .matmuls import logits as fused_logits
from .matmuls import prepare as prepare_matmuls
from .prefill_graphs import PrefillGraphRunner


def prepare_inputs(model, prefills: list[Sequence], decodes: list[Sequence], block_size: int, device,
                   pad_block: int, kernels: bool = False, causal_kernel: bool = False, triton: bool = False):
    """``(input_ids, positions, plan, last_rows)`` of one step, ``plan`` the fused backend's
    :class:`~minikv.backends.fused_plan.FusedPlan` (or a hit step's ``HitPlan``).  Decode rows
    are ordered by context length, so that groups of similar length are slices; ``last_rows``
    stays in the caller's order.  ``kernels``: the plan's decodes go to the C++ kernel
    (``cpu_kernels.py``) as one group; ``causal_kernel`` (with ``kernels``): its fresh
    prefills too, to the prefill kernel (``fused_plan.build_plan`` says why ``score`` does not).
    ``triton``: its prefix hits and decodes to the Triton kernel as one group (CUDA)."""
    decodes_in_order, decodes = decodes, sorted(decodes, key=lambda s: s.num_tokens)
    ids, pos, slots, items, row_of = [], [], [], [], {}
    for seq in prefills + decodes:
        start, end = seq.num_computed_tokens, seq.num_tokens
        if len(items) < len(prefills):
            items.append((len(ids), end - start, end, seq.block_table))
        ids.extend(seq.token_ids[start:end])
        pos.extend(range(start, end))
        slots.extend(slot_of(seq.block_table, p, block_size) for p in range(start, end))
        row_of[id(seq)] = len(ids) - 1
    last_rows = [row_of[id(seq)] for seq in prefills + decodes_in_order]
    dec = [(len(ids) - len(decodes) + i, s.num_tokens, s.block_table) for i, s in enumerate(decodes)]
    if reads_in_place(model, kernels, items):  # prefix hits on the kernels: one copy for all
        *tensors, table, seqs = to_device_split([ids, pos, slots, last_rows, *in_place_lists(items, dec, pad_block)],
                                                device)
        return tensors[0], tensors[1], in_place_plan(model, tensors[1], tensors[2], table, seqs), tensors[3]
    if not kernels and not triton and (seqs := hit_seqs(items, dec)) is not None:  # hits, plain PyTorch
        rep = model.shape.num_heads // model.shape.num_kv_heads
        ids_t, pos_t, slots_t, last_t, *lists = to_device_split([ids, pos, slots, last_rows,
                                                                 *hit_lists(seqs, pad_block, rep)], device)
        return ids_t, pos_t, hit_plan(model, pos_t, slots_t, seqs, lists, block_size), last_t
    input_ids, positions, slots_t, last_rows_t = to_device_split([ids, pos, slots, last_rows], device)
    plan = build_plan(model, positions, slots_t, items, dec, block_size, pad_block,
                      paged=kernels, causal_kernel=causal_kernel, triton=triton)
    return input_ids, positions, plan, last_rows_t


class FusedBackend:
    """``name``: ``"fused"`` (pure PyTorch, every device), ``"cpu_kernels"`` or ``"triton"``;
    ``memory``: where the pool's zeros come from (``host_memory.HOST_MEMORY`` on the CPU)."""

    def __init__(self, name: str, memory: PoolMemory):
        self.name, self.memory = name, memory
        self.kernels = name == "cpu_kernels"
        self.graphs: DecodeGraphRunner | None = None  # CUDA only (and not enforce_eager)
        self.prefill_graphs: PrefillGraphRunner | None = None

    def bind(self, engine) -> None:
        """Pack the weights now, not mid-request, and set up the graph runners (nothing captured yet)."""
        prepare_matmuls(engine.model, kernels=self.kernels)
        self.graphs = DecodeGraphRunner.for_engine(engine)  # None off CUDA, or with enforce_eager
        self.prefill_graphs = PrefillGraphRunner.for_engine(engine)  # likewise (fused and triton)

    def forward(self, engine, prefills, decodes, all_rows=False) -> torch.Tensor:
        if self.graphs is not None and decodes and not prefills and self.graphs.fits(decodes):
            return self.graphs.run(decodes)  # decode-only on CUDA: one graph replay
        graphs = self.prefill_graphs  # one prefill alone on CUDA, hit or miss: one replay
        if graphs is not None and len(prefills) == 1 and not decodes and not all_rows \
                and (key := graphs.key(prefills[0])) is not None:
            return graphs.run(prefills[0], key)
        input_ids, positions, plan, last_rows = prepare_inputs(
            engine.model, prefills, decodes, engine.block_size, engine.device, engine.pool.pad_block,
            kernels=self.kernels, causal_kernel=self.kernels and not all_rows,  # score keeps transformers' bits
            triton=self.name == "triton")
        hidden = fused_forward(engine.model, input_ids, engine.pool, plan)
        rows = hidden if all_rows else hidden[last_rows]
        return fused_logits(engine.model, rows, plan.exact, plan.kernels)  # the LM head on packed weights too
