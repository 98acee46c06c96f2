"""An engine step by step on the ``triton`` backend against the reference backend, on the CPU.

    PYTHONPATH=.:.triton-site TRITON_INTERPRET=1 .venv/bin/python tests/triton_engine_check.py   # CPU
    .venv/bin/python tests/triton_engine_check.py cuda                                            # GPU
    ... tests/triton_engine_check.py cpu prefill-graphs     # hits and misses through prefill graphs

``resolve_backend`` grants ``"triton"`` on CUDA only, so on the CPU a fused engine is switched to it
after it is built (nothing else about an engine depends on the name: the forward pass is
chosen per step by the backend, ``minikv.backends.fused.FusedBackend``) and Triton's interpreter runs the kernel on CPU
tensors.  The schedule is ``test_attention_fused``'s: prefills, a decode-only step, a mixed step
(a fresh prefill and two decodes), then prefix hits and their decodes; every sampled row's logits
must be within 1e-4 of its largest logit of the reference's, the tokens identical.  Run in a
subprocess by ``tests/test_paged_triton.py``: the test process never imports Triton.

``prefill-graphs``: ``tests/test_prefill_graphs.py``'s schedule (requests one at a time: misses
and prefix hits padded to their buckets) with the prefill graph runner (on the CPU its eager
stand-in), so that every hit's kernel call is made from inside a replay, reading the real row
count and context length from the static buffer; the same comparison with the reference.
"""
from __future__ import annotations

import sys

from minikv.backends.attention_fused import triton_attention
from tests.engine_helpers import assert_traces_close
from tests.test_attention_fused import TOL, _drive, _engines, _workload


def main(device: str = "cpu") -> int:
    calls = []

    def counted(*args, **kw):  # the kernel really serves the steps (a silent fallback would pass too)
        calls.append(args[3].shape[0])
        return triton_attention(*args, **kw)

    import minikv.backends.attention_fused as fused_module

    fused_module.triton_attention = counted
    ref, eng = _engines(device, backend="triton" if device == "cuda" else "fused")
    eng.attention_backend = eng.backend.name = "triton"
    prompts, late = _workload(ref.model.shape.vocab_size)
    trace_r, tokens_r, cached_r, kinds = _drive(ref, prompts, late)
    trace_t, tokens_t, cached_t, _ = _drive(eng, prompts, late)
    assert kinds == {"prefill", "decode", "mixed"}
    assert cached_r == cached_t and min(cached_r) >= 32, cached_r  # the prefix hits ran
    assert tokens_r == tokens_t and len(tokens_r) == 5, (tokens_r, tokens_t)
    assert_traces_close(trace_r, trace_t, TOL)
    worst = max((row - trace_t[i][rid]).abs().max().item() / row.abs().max().item()
                for i, step in enumerate(trace_r) for rid, row in step.items())
    layers = ref.model.shape.num_layers if hasattr(ref.model.shape, "num_layers") else len(ref.model.layers)
    print(f"triton engine check: {len(trace_r)} steps, {len(calls)} kernel calls ({len(calls) // layers} steps x "
          f"{layers} layers), worst logit diff {worst:.2e} of the row's largest (tolerance {TOL}), tokens identical")
    # the mixed step and the hits' step at least (on CUDA decode-only steps replay graphs instead)
    assert len(calls) >= layers * 2, calls
    return 0


def prefill_graphs(device: str = "cpu") -> int:
    import minikv.backends.attention_fused as fused_module
    from minikv.backends.cuda_graphs import DecodeGraphRunner
    from minikv.backends.prefill_graphs import PrefillGraphRunner
    from tests.test_prefill_graphs import _drive as drive_one_at_a_time

    calls, in_replay = [], [False]

    def counted(*args, **kw):  # each kernel call: whether a prefill graph's capture or replay made it
        calls.append(in_replay[0])
        return triton_attention(*args, **kw)

    fused_module.triton_attention = counted
    ref, eng = _engines(device, backend="triton" if device == "cuda" else "fused")
    eng.attention_backend = eng.backend.name = "triton"
    if device == "cpu":  # CUDA builds both runners itself
        eng.backend.graphs = DecodeGraphRunner(eng, capture="eager")
        eng.backend.prefill_graphs = PrefillGraphRunner(eng, capture="eager")
    runner = eng.backend.prefill_graphs
    assert runner is not None and runner.triton
    run = runner._replay

    def marked(key, step_fn):  # the kernel calls made while a prefill graph replays
        in_replay[0] = True
        try:
            return run(key, step_fn)
        finally:
            in_replay[0] = False
    runner._replay = marked
    trace_r, tokens_r, _ = drive_one_at_a_time(ref)
    trace_t, tokens_t, _ = drive_one_at_a_time(eng)
    assert tokens_r == tokens_t, (tokens_r, tokens_t)
    hits = [name for name, (_, cached) in tokens_r.items() if cached > 0]
    assert len(hits) >= 4, tokens_r  # the schedule's prefix hits hit
    assert_traces_close(trace_r, trace_t, TOL)
    # Every kernel call came from a prefill graph (the other steps: fresh prefills on SDPA, decodes
    # on the decode graphs), at least one per layer for every hit bucket.
    hit_graphs = [k for k in runner.graphs if k[0] == "hit"]
    assert len(hit_graphs) >= 3 and all(calls) and len(calls) >= len(ref.model.layers) * len(hit_graphs), \
        (runner.graphs, calls, hits)
    print(f"triton prefill graphs: {runner.replays} replays ({len(hits)} hits, {len(hit_graphs)} hit buckets), "
          f"{len(calls)} kernel calls, all from prefill graphs, tokens identical")
    return 0


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[1:2] == ["prefill-graphs"]:
        sys.exit(prefill_graphs(args[0]))
    sys.exit(main(*args))
