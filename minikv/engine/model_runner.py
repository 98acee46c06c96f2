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
