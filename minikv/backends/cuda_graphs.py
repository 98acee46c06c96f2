"""CUDA graphs for decode-only steps: record the step's kernels once, replay them every step.

(Prefill steps of one sequence, a prefix hit or a miss, replay graphs too: ``prefill_graphs.py``,
on the :class:`GraphRunner` base and the capture strategies of this module.)

**Why.**  A decode step of a small model is *launch-bound*: each token does little arithmetic,
but the forward is hundreds of small operations.  The fused backend dispatches about 500 ops
per decode step for SmolLM2 at batch 16 (counted with ``torch.profiler`` on the CPU, see
``minikv.bench.speed``); on a GPU each one is a kernel launch, a few microseconds of CPU time
for a kernel that itself may run for less.  A CUDA graph records the whole sequence of launches
once (*capture*) and hands it to the GPU in one call afterwards (*replay*): the CPU no longer
paces the GPU.  nano-vllm and vLLM both capture their decode steps this way.

**Why static shapes.**  A graph replays the *exact* kernels it recorded, with the same pointers
and the same sizes.  So nothing in the captured function may allocate by data, sync with the
host (no ``.item()``, no Python ``if`` on a tensor) or read an input from a new tensor: every
input lives in one *static buffer* allocated once, and each step copies its values into it
(``copy_``, from pinned host memory without blocking, on CUDA) before the replay.

**Buckets.**  The batch size and the block-table width (blocks per sequence) change from step
to step, and a graph has one of each.  So graphs are kept per *(batch bucket, width bucket)*:
batch sizes 1, 2, 4, 8, then multiples of 8 up to ``max_num_seqs`` (vLLM's default capture list
starts the same way: "1, 2, 4, then multiples of 8 up to 256", ``vllm/config/vllm.py`` in vLLM
0.32), widths in powers of two up to ``ceil(max_model_len / block_size)``.  A step runs the
smallest graph that fits, captured on first use; all graphs share one memory pool
(``torch.cuda.graph_pool_handle()``), since only one of them runs at a time.

**Padding, and where padded rows write.**  A batch of 3 runs the batch-4 graph: the extra row
is token 0 at position 0 with context length 1, and its block table is all *pad block*: the
pool's reserved block that is never handed out and must stay all zero (``kv_pool.py``), so the
padded row reads zeros and its logits are thrown away.  Its K/V *write* cannot go there: the
forward writes every row's new K/V, and a padded row writing into the pad block would make it
non-zero for every later reader.  Nor may it go to a real block (someone's data).  So the pool
has one more reserved block, the *scratch block*, that only padded rows ever write and nobody
reads.  Real rows' tables are padded up to the width bucket with the pad block, as the eager
path pads them up to the batch's longest table; the mask (``key < context length``) hides both.

**What is captured.**  RoPE tables from the positions (``build_plan``'s own code), the mask from
the context lengths, ``fused_forward`` with one decode group, and ``model.logits``.  On the CPU
there is no graph, but the same static-buffer function can be run by the ``"eager"`` strategy on
every replay: that is how the tests check all of the above without a GPU.
"""
from __future__ import annotations

import math

import torch

from .attention_fused import fused_forward
from .fused_plan import Group, build_plan, decode_mask
from ..engine.kv_pool import slot_of

INPUTS = 4  # per row of the static buffer, before the block table: token, position, slot, context length


def batch_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, ... and ``max_num_seqs`` itself as the largest."""
    return sorted({b for b in (1, 2, 4) if b < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs})


def width_buckets(max_blocks: int) -> list[int]:
    """Powers of two below ``max_blocks``, then ``max_blocks`` (the longest table there can be)."""
    return [2 ** i for i in range(max(max_blocks - 1, 0).bit_length()) if 2 ** i < max_blocks] + [max_blocks]


def bucket(sizes: list[int], n: int) -> int | None:
    """The smallest size that holds ``n`` (None when none does)."""
    return next((s for s in sizes if s >= n), None)


# The profiler's name for a replay.  ``minikv.bench.speed.count_ops`` counts it as one dispatched op and
# not what runs inside it, as a CUDA host dispatches one graph launch for the whole step (the op
# budget's rule: "graph replays count as one"); the eager stand-in below is marked the same way, so the CPU
# counts what a GPU's host would, and reports the ops inside separately.
REPLAY = "minikv::graph_replay"


def eager_capture():
    """The CPU's stand-in for a graph: "replaying" runs the static-buffer function again and
    writes its logits into one tensor kept from the capture, as a graph's replay overwrites its
    output (so a caller that kept last step's logits would see them change here too)."""
    def capture(fn):
        out = fn()  # like the CUDA warm-up: runs the step, and running it again changes nothing

        def replay():
            with torch.profiler.record_function(REPLAY):
                return out.copy_(fn())
        return replay
    return capture


def cuda_capture():
    """Real CUDA graphs, all allocating from one shared memory pool (made on the first capture)."""
    pool = None

    def capture(fn):
        nonlocal pool
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        # Warm up on a side stream first, as PyTorch's CUDA-graph notes advise: lazy
        # initialisation (cuBLAS handles, workspaces) must not happen inside the capture.  The
        # warm-up really runs the step, writing its K/V; the replay writes the same values to
        # the same slots, so running it twice changes nothing.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):  # records the launches; runs nothing
            out = fn()

        def replay():
            with torch.profiler.record_function(REPLAY):
                graph.replay()
            return out  # the graph writes its logits into the same memory on every replay
        return replay
    return capture


# Capture strategies by name: a strategy turns a static-buffer function into its replay.
CAPTURES = {"cuda": cuda_capture, "eager": eager_capture}


class GraphRunner:
    """What every graph runner keeps: the capture strategy (``"cuda"`` on a GPU, ``"eager"`` for
    tests on the CPU), the replays by bucket key, how many graphs were built (``captures``) and how
    many steps ran through them (``replays``)."""

    # The attention backends whose steps a runner replays (engines of other backends get none).
    BACKENDS: tuple[str, ...] = ()

    def __init__(self, engine, capture: str = "cuda"):
        if capture not in CAPTURES:
            raise ValueError(f"capture={capture!r} is not one of {', '.join(CAPTURES)}")
        self.model, self.pool, self.block_size = engine.model, engine.pool, engine.block_size
        self.device = engine.device
        self.capture = CAPTURES[capture]()
        self.graphs: dict[tuple, object] = {}  # bucket key -> replay()
        self.captures = self.replays = 0

    @classmethod
    def for_engine(cls, engine):
        """The engine's runner, or None where graphs do not apply: not CUDA, another attention
        backend, or ``enforce_eager``.  Cheap: nothing is allocated before the first step."""
        if engine.device.type != "cuda" or engine.attention_backend not in cls.BACKENDS \
                or engine.config.enforce_eager:
            return None
        return cls(engine)

    def _replay(self, key: tuple, step_fn) -> torch.Tensor:
        """Replay bucket ``key``'s graph, capturing ``step_fn()`` (which makes the function to
        capture) on the bucket's first use."""
        if key not in self.graphs:
            self.graphs[key] = self.capture(step_fn())
            self.captures += 1
        self.replays += 1
        return self.graphs[key]()


class DecodeGraphRunner(GraphRunner):
    """Runs an engine's decode-only steps through captured graphs, one per bucket pair."""

    # triton: its decode-only steps replay the fused graphs
    BACKENDS = ("fused", "triton")

    def __init__(self, engine, capture: str = "cuda"):
        super().__init__(engine, capture)
        self.batch_sizes = batch_buckets(engine.config.max_num_seqs)
        self.widths = width_buckets(min(math.ceil(engine.max_model_len / self.block_size), engine.num_blocks))
        self._static: torch.Tensor | None = None  # allocated on first use: most engines never decode on CUDA

    def fits(self, decodes) -> bool:
        """Whether a decode-only batch fits the largest buckets (else the eager path runs it)."""
        return len(decodes) <= self.batch_sizes[-1] and max(len(s.block_table) for s in decodes) <= self.widths[-1]

    @torch.inference_mode()  # as fused_forward: the static buffer and outputs are inference tensors
    def run(self, decodes) -> torch.Tensor:
        """Logits ([len(decodes), vocab], fp32) of one decode-only step, through the graph of its buckets."""
        b, w = len(decodes), max(len(s.block_table) for s in decodes)
        nb, nw = bucket(self.batch_sizes, b), bucket(self.widths, w)
        if self._static is None:
            self._static = torch.zeros(self.batch_sizes[-1] * (INPUTS + self.widths[-1]), dtype=torch.long,
                                       device=self.device)
        host = torch.tensor(self._host_inputs(decodes, nb, nw), dtype=torch.long,
                            pin_memory=self.device.type == "cuda")
        self._static[: host.numel()].copy_(host, non_blocking=True)  # the only host-to-device copy
        # a copy: the next replay overwrites the static logits
        return self._replay((nb, nw), lambda: self._step_fn(nb, nw))[:b].clone()

    def _host_inputs(self, decodes, nb: int, nw: int) -> list[int]:
        """The step's values in the static buffer's layout for bucket ``(nb, nw)``: tokens,
        positions, slots and context lengths ([nb] each), then block tables ([nb, nw])."""
        bs, pad, scratch = self.block_size, self.pool.pad_block, self.pool.scratch_block
        ids, pos, slots, ctx, tables = [], [], [], [], []
        for s in decodes:  # one new token each, at position num_tokens - 1
            p = s.num_tokens - 1
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(slot_of(s.block_table, p, bs))
            ctx.append(s.num_tokens)
            tables.extend(s.block_table + [pad] * (nw - len(s.block_table)))
        for j in range(nb - len(decodes)):  # padded rows: read the pad block, write the scratch block
            ids.append(0)
            pos.append(0)
            slots.append(scratch * bs + j % bs)
            ctx.append(1)
            tables.extend([pad] * nw)
        return ids + pos + slots + ctx + tables

    def _step_fn(self, nb: int, nw: int):
        """The function a graph captures for bucket ``(nb, nw)``: it reads only the static
        buffer (views fixed here) and the pool, and allocates only inside itself."""
        rows = self._static[: nb * (INPUTS + nw)]
        ids, pos, slots, ctx = rows[: INPUTS * nb].view(INPUTS, nb)
        table = rows[INPUTS * nb:]  # [nb * nw], row-major: what the decode group's index_select reads
        model, pool, bs = self.model, self.pool, self.block_size

        def step() -> torch.Tensor:
            mask = decode_mask(ctx, nw * bs, model.dtype)  # [nb, 1, 1, nw * bs], as the eager decode group's
            group = Group("decode", slice(0, nb), slice(0, nb), None, 1, table, mask)
            plan = build_plan(model, pos, slots, [], [], bs, pool.pad_block, extra_groups=(group,))
            return model.logits(fused_forward(model, ids, pool, plan))
        return step
