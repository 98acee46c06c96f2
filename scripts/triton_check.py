"""The Triton paged-attention kernel against the reference attention, on identical inputs.

    PYTHONPATH=.:.triton-site TRITON_INTERPRET=1 .venv/bin/python scripts/triton_check.py   # CPU
    .venv/bin/python scripts/triton_check.py --device cuda                                   # GPU

For each kind of step -- fresh prefills, prefix hits, decodes, and all three mixed in one call --
the same random queries and new K/V go through ``attention.gather_attention`` (the reference the
lessons read: gather the blocks, mask, SDPA), which writes them into a pool whose other slots
hold random stale K/V, and then through ``paged_triton.paged_attention``, which reads that pool
in place through the same block tables (shuffled: a sequence's blocks are never adjacent).  The
largest absolute difference must be within the kernel tolerances of ``tests/test_paged_prefill.py``
(fp32 1e-5; half precision 2e-2).  Shapes are SmolLM2's attention: 9 query heads, 3 KV heads,
head_dim 64, blocks of 16.

Prints one JSON line per case and exits 1 if any case fails.  It runs in its own process
because the tests' process never imports Triton (``tests/test_paged_triton.py``).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from minikv.engine.attention import AttentionMetadata, PrefillItem, gather_attention as reference
from minikv.engine.kv_pool import KVPool, slot_of
from minikv.backends.paged_triton import paged_attention

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}
# (new tokens, context length) of each sequence; decodes are (1, ctx) and come last, as in a step
CASES = {
    "prefill": [(37, 37), (16, 16)],
    "hit": [(5, 70), (20, 53)],
    "decode": [(1, 1), (1, 16), (1, 17), (1, 90)],
    "mixed": [(23, 23), (7, 50), (1, 33), (1, 64)],
}


def run_case(seqs: list[tuple[int, int]], dtype: torch.dtype, device: str, gen: torch.Generator) -> float:
    """Largest |Triton - reference| over one call's output for sequences ``seqs``."""
    widths = [-(-c // BLOCK) for _, c in seqs]
    pool = KVPool(1, sum(widths) + 3, BLOCK, KV_HEADS, DIM, dtype, device)
    pool._kv.copy_(torch.randn(pool._kv.shape, generator=gen).to(dtype))  # stale K/V everywhere
    perm = torch.randperm(pool.num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for w in widths:
        tables.append(perm[used:used + w])
        used += w
    t = sum(n for n, _ in seqs)
    q, k, v = (torch.randn(t, h, DIM, generator=gen).to(dtype).to(device) for h in (HEADS, KV_HEADS, KV_HEADS))
    slots, items, starts, row = [], [], [], 0
    for (n, c), table in zip(seqs, tables):
        slots += [slot_of(table, p, BLOCK) for p in range(c - n, c)]
        starts.append(row)
        if n > 1 or c == 1:  # the reference's prefills (a one-token prompt is a prefill too)
            items.append(PrefillItem(row, n, c, torch.tensor(table, device=device)))
        row += n
    dec = [(c, table) for (n, c), table in zip(seqs, tables) if not (n > 1 or c == 1)]
    width = max(widths)
    dec_tables = torch.tensor([tb + [pool.pad_block] * (width - len(tb)) for _, tb in dec], device=device) if dec else None
    dec_lens = torch.tensor([c for c, _ in dec], device=device) if dec else None
    meta = AttentionMetadata(torch.tensor(slots, device=device), items, t - len(dec), dec_tables, dec_lens)
    scale = DIM ** -0.5
    want = reference(0, q, k, v, pool, meta, scale).reshape(t, HEADS * DIM)  # also writes the new K/V
    table = torch.tensor([tb + [pool.pad_block] * (width - len(tb)) for tb in tables], device=device)
    meta_t = torch.tensor([[st, n, c] for st, (n, c) in zip(starts, seqs)], device=device)
    got = paged_attention(q, pool.kv_blocks[0], table, meta_t, scale, n_max=max(n for n, _ in seqs))
    return (got.float() - want.float()).abs().max().item()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtypes", default="float32,float16", help="comma-separated (bfloat16: GPU only, "
                    "Triton's interpreter multiplies bf16 matrices wrongly)")
    args = ap.parse_args(argv)
    gen, failed = torch.Generator().manual_seed(0), 0
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for case, seqs in CASES.items():
            t0 = time.perf_counter()
            err = run_case(seqs, dtype, args.device, gen)
            ok = err <= TOLERANCE[dtype]
            failed += not ok
            print(json.dumps(dict(case=case, dtype=name, device=args.device, max_abs_diff=err,
                                  tolerance=TOLERANCE[dtype], ok=ok, seconds=round(time.perf_counter() - t0, 2))),
                  flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
