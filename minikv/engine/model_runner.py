"""The model runner: a scheduled batch in, one row of logits per sequence out.

The scheduler thinks in sequences; the model thinks in one flat batch of tokens.  This module
is the translation (nano-vllm and vLLM call it the model runner): for every new token, its id,
its position in its own sequence, and its *slot* in the KV pool -- where the model will write
its K/V -- plus the block tables attention needs to read the context back.

Prefill tokens come first, then one token per decoding sequence, so attention can treat the
decode rows as one batched gather (see ``attention.py``).

*How* the forward pass runs is a :class:`Backend`.  The engine holds exactly one and calls
nothing else: :class:`ReferenceBackend`, below, is the explicit gather the lessons read; the
fast paths (fused plans, C++ and Triton kernels, CUDA graphs) live in ``minikv.backends`` behind
the same three members, and ``minikv.LLM`` picks one.  The engine never asks which it has.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .attention import AttentionMetadata, PrefillItem
from .checks import show
from .kv_pool import DEVICE_MEMORY, PoolMemory, slot_of
from .sampling import SamplingParams
from .sequence import Sequence


class Backend(Protocol):
    """How an engine's forward pass runs.  ``name`` is what ``attention_backend`` resolved to;
    ``memory`` allocates the KV pool's zeros; ``bind(engine)`` runs once the pool exists (pack
    weights, set up graphs: nothing is compiled or packed mid-request); ``forward`` returns the
    fp32 logits of each sequence's last new token ([rows, vocab], prefills then decodes, in the
    caller's order), or of every new token when ``all_rows``."""

    name: str
    memory: PoolMemory

    def bind(self, engine) -> None: ...

    def forward(self, engine, prefills: list[Sequence], decodes: list[Sequence],
                all_rows: bool = False) -> torch.Tensor: ...


def to_device(values, dtype, device) -> torch.Tensor:
    """A host list as a tensor on ``device``; on CUDA through pinned memory, without blocking."""
    if device.type == "cuda":
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)
    return torch.tensor(values, dtype=dtype, device=device)


def to_device_split(lists: list[list[int]], device) -> tuple[torch.Tensor, ...]:
    """Several host lists of ints as long tensors on ``device``, in one copy: each tensor is a
    dispatch or four (and on CUDA a transfer), so a step sends its metadata in one and splits it
    there (views, each contiguous)."""
    flat = [v for values in lists for v in values]
    return to_device(flat, torch.long, device).split([len(values) for values in lists])


def prepare_inputs(prefills: list[Sequence], decodes: list[Sequence], block_size: int, device, pad_block: int):
    """Returns ``(input_ids, positions, meta, last_rows)``; ``last_rows[i]`` is the flat row of
    sequence i's last new token (prefills then decodes): the row we sample its next token from.
    Decode block tables are padded with ``pad_block``, the pool's reserved always-zero block
    (``KVPool.pad_block``), never with a block some request owns."""
    ids, pos, slots, items = [], [], [], []
    for seq in prefills + decodes:
        start, end = seq.num_computed_tokens, seq.num_tokens
        if len(items) < len(prefills):
            items.append(PrefillItem(len(ids), end - start, end, seq.block_table))
        ids.extend(seq.token_ids[start:end])
        pos.extend(range(start, end))
        slots.extend(slot_of(seq.block_table, p, block_size) for p in range(start, end))
    last_rows = [item.start + item.num_new - 1 for item in items] + \
        list(range(len(ids) - len(decodes), len(ids)))
    input_ids, positions, slots_t, last_rows_t = to_device_split([ids, pos, slots, last_rows], device)
    tables = lens = None
    if decodes:
        width = max(len(s.block_table) for s in decodes)
        tables = to_device([s.block_table + [pad_block] * (width - len(s.block_table)) for s in decodes],
                           torch.long, device)
        lens = to_device([s.num_tokens for s in decodes], torch.long, device)
    for item in items:
        item.block_table = to_device(item.block_table, torch.long, device)
    meta = AttentionMetadata(slots_t, items, len(ids) - len(decodes), tables, lens)
    return input_ids, positions, meta, last_rows_t


class ReferenceBackend:
    """The explicit gather (``attention.gather_attention``): every layer loops over the prefills
    and gathers each decoding sequence's blocks.  The only backend with the test-only seams of
    ``seams.py`` (a decode mask, a KV-read observer): those are hooks *into* its gather."""

    name = "reference"

    def __init__(self, memory: PoolMemory = DEVICE_MEMORY):
        self.memory = memory

    def bind(self, engine) -> None:
        pass

    def forward(self, engine, prefills, decodes, all_rows=False) -> torch.Tensor:
        input_ids, positions, meta, last_rows = prepare_inputs(
            prefills, decodes, engine.block_size, engine.device, engine.pool.pad_block)
        if engine.decode_mask is not None:  # the test-only seams (None on a normal engine)
            meta.decode_mask = engine.decode_mask
        meta.on_decode_read = engine.kv_read_observer
        hidden = engine.model.forward(input_ids, positions, engine.pool, meta)
        return engine.model.logits(hidden if all_rows else hidden[last_rows])


REFERENCE = ReferenceBackend()


def reference_only(name: str) -> ReferenceBackend:
    """The backend of an engine handed no ``make_backend``: the reference, which is what
    ``attention_backend="auto"`` can mean there; any other name needs the fast paths."""
    if name not in ("reference", "auto"):
        raise ValueError(f"attention_backend={name!r} needs make_backend= (minikv.LLM passes "
                         "minikv.backends.make_backend); this engine alone runs 'reference'")
    return ReferenceBackend()


def chunk_view(seq: Sequence, block_size: int) -> Sequence:
    """``seq`` as a backend must see it this step: itself, or, for a prefill chunk that stops
    short of the prompt's end (``scheduler.py``), a copy cut at the chunk's end.  The copy is a
    prefill whose first ``num_computed_tokens`` (a block multiple) are already in the pool: what
    every backend computes for a prefix hit, so no backend needs to know about chunks.  A sequence
    no scheduler touched (``num_scheduled_tokens`` 0) runs whole."""
    end = seq.num_computed_tokens + seq.num_scheduled_tokens
    if not seq.num_scheduled_tokens or end >= seq.num_tokens:
        return seq
    view = Sequence(seq.request_id, seq.token_ids[:end], seq.params, tenant=seq.tenant)
    view.block_table = seq.block_table[:-(-end // block_size)]
    view.num_computed_tokens = view.num_committed_tokens = seq.num_computed_tokens
    return view


def run_model(engine, prefills: list[Sequence], decodes: list[Sequence], all_rows: bool = False) -> torch.Tensor:
    """The engine's forward pass over one batch, through its backend.  An engine with a test-only
    seam installed (``seams.py``) runs the reference: the seams hook into its explicit gather."""
    seamed = engine.decode_mask is not None or engine.kv_read_observer is not None
    prefills = [chunk_view(s, engine.block_size) for s in prefills]
    return (REFERENCE if seamed else engine.backend).forward(engine, prefills, decodes, all_rows)


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
