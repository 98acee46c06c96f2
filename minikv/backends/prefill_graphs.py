"""CUDA graphs for prefill steps: one sequence's prefix hit or miss, replayed from a bucket.

**Why.**  On a GPU, a small model's prefill is launch-bound like its decode (``cuda_graphs.py``):
a prefix hit of SmolLM2's shapes spends a fraction of its host time on the device, the host
dispatching hundreds of kernels one by one (``scripts/profile_ttft.py`` measures it;
docs/BENCHMARKS.md, "CUDA graphs").  A hit then costs what a miss costs, and the leak the course teaches (a hit
answers sooner) is hidden by the host, though the GPU did far less work for the hit.  Replaying
the step from a graph leaves the host a few dispatches, and the GPU's own time decides the TTFT.

**Which steps.**  A step with exactly one prefilling sequence and no decodes: a TTFT probe, an
attacker's request or a quiet server's next prompt.  Steps that batch several prefills, or
prefills with decodes, run eagerly (vLLM's piecewise graphs cover any batch by leaving attention
out of the graph; minikv keeps whole-step graphs, which need one shape per graph).  ``score``
(every row's logits) runs eagerly too.

**Two kinds, the eager step's own arithmetic.**

* ``"miss"``: nothing of the sequence is cached (its context is its new tokens).  The graph
  runs ``build_plan``'s ``"fresh"`` group: causal attention over the step's own new K/V, the
  kernel the eager miss calls.
* ``"hit"``: some of the context is in the pool (a prefix hit).  The graph runs
  ``fused_hit.hit_plan``: the new tokens' K/V written to the pool, the context's blocks read
  back through the block table, one masked attention.  On the ``triton`` backend it runs that
  backend's ``"triton"`` group instead: the kernel reads K/V where they lie in the pool, told
  the real new-token count and context length by the static buffer, so it leaves the padded
  rows' outputs alone (nobody reads them).

**Buckets.**  A graph has one shape, so steps are padded up to a bucket: new tokens to a
multiple of 8 up to 256, beyond that to 1/16 of their power-of-two octave (272, 288, ... 512,
544, ...), so padding adds at most 7 rows or 1/16 of the real ones; a hit's block table to a
power of two (``cuda_graphs.width_buckets``; padded with the pool's pad block, which the mask
hides).  A bucket is captured on its first use and kept; past ``MAX_GRAPHS`` buckets a new shape
runs eagerly.  Its first request pays the capture (tens of milliseconds on a GPU): a server
that wants flat TTFTs warms its buckets before serving (vLLM captures its sizes at start-up).

**Padding rows.**  They come *after* the real rows, repeat the last real token's position and
write their K/V into the pool's scratch block, as padded decode rows do (``cuda_graphs.py``):
a miss's causal attention hides later rows from earlier ones, and a hit's mask shows each row
only keys up to its position, read from the table's blocks, never the scratch block.  So a real
row computes what the eager step computes; padded rows compute finite numbers nobody reads.
"""
from __future__ import annotations

import math

import torch

from .attention_fused import fused_forward
from .cuda_graphs import GraphRunner, bucket, width_buckets
from .fused_hit import hit_plan
from .fused_plan import Group, build_plan
from ..engine.kv_pool import slot_of
from .matmuls import logits as fused_logits

MAX_GRAPHS = 256  # buckets kept at most; each holds its kernels' arguments and its logits


def token_bucket(n: int) -> int:
    """The padded row count of ``n`` new tokens: a multiple of 8 up to 256, then of 1/16 of the
    power-of-two octave ``n`` lies in (16 in (256, 512], 32 in (512, 1024], ...)."""
    step = 8 if n <= 256 else 2 ** ((n - 1).bit_length() - 5)
    return -(-n // step) * step


class PrefillGraphRunner(GraphRunner):
    """Runs an engine's one-sequence prefill steps through captured graphs, one per bucket:
    ``("miss", tokens)`` or ``("hit", tokens, width)``, on the fused and triton backends."""

    BACKENDS = ("fused", "triton")

    def __init__(self, engine, capture: str = "cuda"):
        super().__init__(engine, capture)
        self.triton = engine.attention_backend == "triton"  # hits through the Triton kernel
        # A prefill alone in its step is any prompt length (the scheduler admits the first prefill
        # of a step whatever its size), so buckets go up to the longest prompt there can be.
        self.max_tokens = engine.max_model_len
        self.widths = width_buckets(min(math.ceil(engine.max_model_len / self.block_size), engine.num_blocks))
        self._static: torch.Tensor | None = None  # allocated on first use

    def key(self, seq) -> tuple | None:
        """The bucket of ``seq``'s prefill step, or None when no bucket holds it (more blocks than
        the widest bucket, or ``MAX_GRAPHS`` buckets kept and this one not among them): it then
        runs eagerly."""
        n = seq.num_tokens - seq.num_computed_tokens
        tokens = min(token_bucket(n), self.max_tokens)
        if n > tokens:
            return None
        if seq.num_computed_tokens == 0:
            key = ("miss", tokens)
        else:
            width = bucket(self.widths, len(seq.block_table))
            key = None if width is None else ("hit", tokens, width)
        return key if key in self.graphs or (key is not None and len(self.graphs) < MAX_GRAPHS) else None

    @torch.inference_mode()  # as fused_forward: the static buffer and outputs are inference tensors
    def run(self, seq, key: tuple) -> torch.Tensor:
        """Logits ([1, vocab], fp32) of ``seq``'s last new token, through the graph of ``key``."""
        if self._static is None:
            self._static = torch.zeros(3 * self.max_tokens + 4 + self.widths[-1], dtype=torch.long, device=self.device)
        host = torch.tensor(self._host_inputs(seq, key), dtype=torch.long, pin_memory=self.device.type == "cuda")
        self._static[: host.numel()].copy_(host, non_blocking=True)  # the only host-to-device copy
        return self._replay(key, lambda: self._step_fn(key)).clone()  # the next replay overwrites it

    def _host_inputs(self, seq, key: tuple) -> list[int]:
        """The step's values in the static buffer's layout: token ids, positions and slots ([N]
        each, real rows first), the last real row, (first row, new tokens, context length) as
        the Triton kernel reads them, then (a hit) the block table ([W])."""
        tokens, width = key[1], key[2] if key[0] == "hit" else 0
        start, end, bs = seq.num_computed_tokens, seq.num_tokens, self.block_size
        pad = tokens - (end - start)
        scratch = self.pool.scratch_block
        ids = seq.token_ids[start:end] + [0] * pad
        pos = list(range(start, end)) + [end - 1] * pad
        slots = [slot_of(seq.block_table, p, bs) for p in range(start, end)] + [scratch * bs + j % bs for j in range(pad)]
        table = seq.block_table + [self.pool.pad_block] * (width - len(seq.block_table)) if width else []
        return ids + pos + slots + [end - start - 1, 0, end - start, end] + table

    def _step_fn(self, key: tuple):
        """The function a graph captures for ``key``: it reads only the static buffer (views fixed
        here) and the pool, and allocates only inside itself."""
        kind, tokens = key[0], key[1]
        width = key[2] if kind == "hit" else 0
        buf = self._static
        ids, pos, slots = buf[: 3 * tokens].view(3, tokens)
        last, meta = buf[3 * tokens: 3 * tokens + 1], buf[3 * tokens + 1: 3 * tokens + 4]
        table = buf[3 * tokens + 4: 3 * tokens + 4 + width]
        model, pool, bs = self.model, self.pool, self.block_size
        rep = model.shape.num_heads // model.shape.num_kv_heads

        def step() -> torch.Tensor:
            if kind == "miss":  # one fresh prefill of ``tokens`` rows: the eager miss's plan
                plan = build_plan(model, pos, slots, [(0, tokens, tokens, [])], [], bs, pool.pad_block)
            elif self.triton:  # the Triton kernel over the pool, as the eager triton step's group
                group = Group("triton", slice(0, 0), slice(0, 0), None, tokens, table.view(1, width), ctx=meta.view(1, 3))
                plan = build_plan(model, pos, slots, [], [], bs, pool.pad_block, extra_groups=(group,))
            else:  # one hit of ``tokens`` rows over ``width`` blocks; folded rows r * tokens + i sit at pos[i]
                plan = hit_plan(model, pos, slots, [(0, tokens, width * bs, None)], [table, pos.repeat(rep)], bs)
            hidden = fused_forward(model, ids, pool, plan).index_select(0, last)
            return fused_logits(model, hidden, plan.exact, plan.kernels)
        return step
