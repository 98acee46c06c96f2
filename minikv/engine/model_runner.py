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
from .checks import show
from .sampling import SamplingParams
from .sequence import Sequence


def prepare_inputs(prefills: list[Sequence], decodes: list[Sequence], block_size: int, device):
    """Returns ``(input_ids, positions, meta, last_rows)``; ``last_rows[i]`` is the flat row of
    sequence i's last new token (prefills then decodes): the row we sample its next token from."""
    ids, pos, slots, items, last_rows = [], [], [], [], []
    for seq in prefills + decodes:
        start, end = seq.num_computed_tokens, seq.num_tokens
        if len(items) < len(prefills):
            items.append(PrefillItem(len(ids), end - start, end, torch.tensor(seq.block_table, device=device)))
        ids.extend(seq.token_ids[start:end])
        pos.extend(range(start, end))
        # A token at position p lives in slot p % block_size of logical block p // block_size.
        slots.extend(seq.block_table[p // block_size] * block_size + p % block_size for p in range(start, end))
        last_rows.append(len(ids) - 1)
    tables = lens = None
    if decodes:
        width = max(len(s.block_table) for s in decodes)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in decodes], device=device)
        lens = torch.tensor([s.num_tokens for s in decodes], device=device)
    meta = AttentionMetadata(torch.tensor(slots, device=device), items, len(ids) - len(decodes), tables, lens)
    return (torch.tensor(ids, device=device), torch.tensor(pos, device=device), meta,
            torch.tensor(last_rows, device=device))


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
        input_ids, positions, meta, _ = prepare_inputs([seq], [], engine.block_size, engine.device)
        return engine.model.logits(engine.model.forward(input_ids, positions, engine.pool, meta))
    finally:
        engine.block_manager.free(seq)
