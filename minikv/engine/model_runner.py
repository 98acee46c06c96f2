"""Turn a scheduled batch of sequences into the flat tensors the model runs on.

The scheduler thinks in sequences; the model thinks in one flat batch of tokens.  This module
is the translation (nano-vllm and vLLM call it the model runner): for every new token, its id,
its position in its own sequence, and its *slot* in the KV pool -- where the model will write
its K/V -- plus the block tables attention needs to read the context back.

Prefill tokens come first, then one token per decoding sequence, so attention can treat the
decode rows as one batched gather (see ``attention.py``).
"""
from __future__ import annotations

import torch

from .attention import AttentionMetadata, PrefillItem
from .attention_backends import FUSED
from .attention_fused import fused_forward
from .fused_hit import hit_lists, hit_plan, hit_seqs
from .fused_plan import build_plan, stored_lists, stored_plan, stores, to_device, to_device_split
from .checks import show
from .kv_pool import slot_of
from .matmuls import logits as fused_logits
from .sampling import SamplingParams
from .sequence import Sequence


def prepare_inputs(prefills: list[Sequence], decodes: list[Sequence], block_size: int, device,
                   pad_block: int, model=None, paged: bool = False, causal_kernel: bool = False,
                   triton: bool = False):
    """Returns ``(input_ids, positions, meta, last_rows)``; ``last_rows[i]`` is the flat row of
    sequence i's last new token (prefills then decodes): the row we sample its next token from.

    ``meta`` is the reference backend's :class:`AttentionMetadata`, or, given ``model``, the fused
    backend's :class:`~minikv.engine.fused_plan.FusedPlan`.  Decode block tables are padded
    with ``pad_block``, the pool's reserved always-zero block (``KVPool.pad_block``), never with
    a block some request owns.  ``paged``: the fused plan's decodes go to the C++ kernel
    (``paged_cpu.py``) as one group; ``causal_kernel`` (with ``paged``): its fresh prefills too,
    to the prefill kernel (``fused_plan.build_plan`` says why ``score`` does not).  ``triton``:
    its prefix hits and decodes to the Triton paged-attention kernel as one group (CUDA)."""
    if model is not None:  # fused: decode rows by context length, so groups of similar length are slices
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
    last_rows = [row_of[id(seq)] for seq in prefills + (decodes_in_order if model is not None else decodes)]
    if model is not None:
        dec = [(len(ids) - len(decodes) + i, s.num_tokens, s.block_table) for i, s in enumerate(decodes)]
    if model is not None and stores(model, paged, items):  # prefix hits on the kernels: one copy for all
        *tensors, table, seqs = to_device_split([ids, pos, slots, last_rows, *stored_lists(items, dec, pad_block)], device)
        return tensors[0], tensors[1], stored_plan(model, tensors[1], tensors[2], table, seqs), tensors[3]
    if model is not None and not paged and not triton and (seqs := hit_seqs(items, dec)) is not None:  # hits, plain PyTorch
        rep = model.shape.num_heads // model.shape.num_kv_heads
        ids_t, pos_t, slots_t, last_t, *lists = to_device_split([ids, pos, slots, last_rows,
                                                                 *hit_lists(seqs, pad_block, rep)], device)
        return ids_t, pos_t, hit_plan(model, pos_t, slots_t, seqs, lists, block_size), last_t
    input_ids, positions, slots_t, last_rows_t = to_device_split([ids, pos, slots, last_rows], device)
    if model is not None:
        return input_ids, positions, build_plan(model, positions, slots_t, items, dec, block_size, pad_block,
                                                  paged=paged, causal_kernel=causal_kernel, triton=triton), last_rows_t
    tables = lens = None
    if decodes:
        width = max(len(s.block_table) for s in decodes)
        tables = to_device([s.block_table + [pad_block] * (width - len(s.block_table)) for s in decodes],
                           torch.long, device)
        lens = to_device([s.num_tokens for s in decodes], torch.long, device)
    prefill_items = [PrefillItem(a, n, c, to_device(bt, torch.long, device)) for a, n, c, bt in items]
    meta = AttentionMetadata(slots_t, prefill_items, len(ids) - len(decodes), tables, lens)
    return input_ids, positions, meta, last_rows_t


def _reference(engine, input_ids, positions, meta) -> torch.Tensor:
    if engine.decode_mask is not None:  # the test-only seams of seams.py (None on a normal engine)
        meta.decode_mask = engine.decode_mask
    meta.on_decode_read = engine.kv_read_observer
    return engine.model.forward(input_ids, positions, engine.pool, meta)


def _fused(engine, input_ids, positions, plan) -> torch.Tensor:
    return fused_forward(engine.model, input_ids, engine.pool, plan)


# The attention backends' forward passes, by the names of ``attention_backends.BACKENDS``.
FORWARDS = {"reference": _reference, "fused": _fused, "paged": _fused, "triton": _fused}


def run_model(engine, prefills: list[Sequence], decodes: list[Sequence], all_rows: bool = False) -> torch.Tensor:
    """The engine's forward pass over one batch, with its attention backend: logits ([rows, vocab],
    fp32) of each sequence's last new token, or of every new token when ``all_rows``.

    An engine with a test-only seam installed (a decode mask or a KV-read observer, ``seams.py``)
    runs the reference backend: those seams are hooks *into* its explicit gather."""
    backend = engine.attention_backend
    if engine.decode_mask is not None or engine.kv_read_observer is not None:
        backend = "reference"
    if backend in ("fused", "triton") and engine.graphs is not None and decodes and not prefills and engine.graphs.fits(decodes):
        return engine.graphs.run(decodes)  # decode-only on CUDA: one graph replay (cuda_graphs.py)
    graphs = engine.prefill_graphs  # one prefill alone on CUDA, hit or miss: one replay (prefill_graphs.py)
    if backend in ("fused", "triton") and graphs is not None and len(prefills) == 1 and not decodes and not all_rows \
            and (key := graphs.key(prefills[0])) is not None:
        return graphs.run(prefills[0], key)
    input_ids, positions, meta, last_rows = prepare_inputs(
        prefills, decodes, engine.block_size, engine.device, engine.pool.pad_block,
        engine.model if backend in FUSED else None, paged=backend == "paged",
        causal_kernel=backend == "paged" and not all_rows,  # score (all_rows) keeps transformers' bits
        triton=backend == "triton")
    hidden = FORWARDS[backend](engine, input_ids, positions, meta)
    rows = hidden if all_rows else hidden[last_rows]
    if backend in FUSED:  # the LM head too may run on packed weights (matmuls.py)
        return fused_logits(engine.model, rows, meta.exact, meta.kernels)
    return engine.model.logits(rows)


def score_tokens(engine, token_ids: list[int]) -> torch.Tensor:
    """``engine``'s logits at every position of ``token_ids`` ([T, vocab], fp32), computed
    through the same paged path as a prefill; the blocks are borrowed from the pool and returned.
    Lessons use it to let the model rank candidates; tests compare it with transformers."""
    if not isinstance(token_ids, (list, tuple)) or not token_ids:
        raise ValueError(f"score() needs a non-empty list of token ids, got {show(token_ids)}")
    ids, _ = engine.encode_prompt(list(token_ids))
    room = min(engine.max_model_len, engine.num_blocks * engine.block_size)
    if len(ids) > room:
        raise ValueError(f"score() got {len(ids)} tokens; at most {room} fit")
    seq = Sequence(f"score-{engine.new_request_id()}", ids, SamplingParams(max_tokens=1), cacheable=False)
    if not engine.block_manager.allocate(seq):
        raise RuntimeError("the pool has no room to score this sequence now")
    try:
        seq.num_computed_tokens = 0  # score every position, even a prefix-cache hit's
        return run_model(engine, [seq], [], all_rows=True)
    finally:
        engine.block_manager.free(seq)
