"""An engine step by step on the ``triton`` backend against the reference backend, on the CPU.

    PYTHONPATH=.:.triton-site TRITON_INTERPRET=1 .venv/bin/python tests/triton_engine_check.py   # CPU
    .venv/bin/python tests/triton_engine_check.py cuda                                            # GPU

``resolve_backend`` grants ``"triton"`` on CUDA only, so on the CPU a fused engine is switched to it
after it is built (nothing else about an engine depends on the name: the forward pass is
chosen per step, ``model_runner.run_model``) and Triton's interpreter runs the kernel on CPU
tensors.  The schedule is ``test_attention_fused``'s: prefills, a decode-only step, a mixed step
(a fresh prefill and two decodes), then prefix hits and their decodes; every sampled row's logits
must be within 1e-4 of its largest logit of the reference's, the tokens identical.  Run in a
subprocess by ``tests/test_paged_triton.py``: the test process never imports Triton.
"""
from __future__ import annotations

import sys

from minikv.engine.attention_fused import triton_attention
from tests.engine_helpers import assert_traces_close
from tests.test_attention_fused import TOL, _drive, _engines, _workload


def main(device: str = "cpu") -> int:
    calls = []

    def counted(*args, **kw):  # the kernel really serves the steps (a silent fallback would pass too)
        calls.append(args[3].shape[0])
        return triton_attention(*args, **kw)

    import minikv.engine.attention_fused as fused_module

    fused_module.triton_attention = counted
    ref, eng = _engines(device, backend="triton" if device == "cuda" else "fused")
    eng.attention_backend = "triton"
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


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
