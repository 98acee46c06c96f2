"""Failure containment: an exception inside ``step()`` fails only the sequence that caused it.

One ``step()`` serves many tenants at once.  Without containment, a single request whose row
could not be sampled (a NaN temperature slipped past validation, say) raises out of ``step()``:
every request in the batch fails with it, and because the culprit stays in the running batch,
every later ``step()`` raises again -- one request takes the whole engine down.

The rule now: **a failure belongs to the sequence it happened in.**

* *Per-sequence stages* -- sampling, committing the new K/V to the block manager,
  detokenization and the stop checks -- run inside a ``try`` for each sequence.  If one raises,
  that sequence finishes with ``finish_reason="error"`` and ``CompletionOutput.error`` says
  which stage failed and why; its blocks go back to the pool (uncommitted K/V are never
  registered in the prefix cache).  The others carry on in the same step.
* *The batched forward* cannot be split after the fact, so when it raises we run it again
  **once, one sequence at a time**: the sequences whose own forward raises again are the
  culprits and fail; the others keep the logits of their solo run.  Re-running is safe because
  a forward only writes K/V slots of blocks its sequence holds privately (prefix-cache hits are
  never rewritten), and it writes the same values again.  A transient fault (a batch too big
  for memory) fails nobody.
* Failures in the engine's own bookkeeping outside these stages (scheduling, freeing blocks,
  scrubbing) are *not* contained: they mean the pool's state may be inconsistent, and hiding
  that would be worse than stopping.

Testing it needs a way to make one sequence fail on purpose.  ``LLMEngine.set_fault_injector``
is that **test-only seam** (``seams.py``): a callable ``fn(stage, seq)`` called before each stage
of each sequence (:func:`inject`), which raises to simulate a fault.  Installing one warns
(``RuntimeWarning``), and no CLI flag or server option reaches it.
"""
from __future__ import annotations

import logging

import torch

from .model_runner import run_model
from .sequence import Sequence

STAGES = ("forward", "sample", "commit", "detokenize")
log = logging.getLogger("minikv.engine")


def inject(engine, stage: str, seq: Sequence) -> None:
    """Give the installed injector (if any) its chance to fail ``seq`` at ``stage``."""
    if engine.fault_injector is not None:
        engine.fault_injector(stage, seq)


def guarded_forward(engine, prefills: list[Sequence], decodes: list[Sequence]
                    ) -> tuple[dict[Sequence, torch.Tensor], dict[Sequence, Exception]]:
    """Run the model over the batch.  Returns ``(logits row per sequence, exception per failed
    sequence)``; together they cover every scheduled sequence, in batch order."""
    seqs = prefills + decodes
    try:
        return dict(zip(seqs, _forward(engine, prefills, decodes))), {}
    except Exception as exc:  # noqa: BLE001 -- any failure: find out whose it is
        if len(seqs) == 1:
            return {}, {seqs[0]: exc}
        log.warning("batched forward of %d sequences failed (%s); retrying one by one", len(seqs), exc)
    rows: dict[Sequence, torch.Tensor] = {}
    failed: dict[Sequence, Exception] = {}
    for seq in seqs:
        alone = ([seq], []) if seq in prefills else ([], [seq])
        try:
            rows[seq] = _forward(engine, *alone)[0]
        except Exception as exc:  # noqa: BLE001
            failed[seq] = exc
    return rows, failed


def _forward(engine, prefills: list[Sequence], decodes: list[Sequence]) -> torch.Tensor:
    """Logits (fp32) of the last new token of each sequence ([batch, vocab]), computed by the
    engine's attention backend (``model_runner.run_model``)."""
    for seq in prefills + decodes:
        inject(engine, "forward", seq)
    return run_model(engine, prefills, decodes)


def describe_failure(seq: Sequence, stage: str, exc: BaseException) -> str:
    """The error text a failed request gets back (and the operator's log line).  It names the
    stage and the exception, nothing from other requests; long messages are cut."""
    detail = str(exc).splitlines()[0] if str(exc) else ""
    detail = detail if len(detail) <= 200 else detail[:197] + "..."
    log.error("request %s (tenant %r) failed in %s: %s: %s", seq.request_id, seq.tenant, stage,
              type(exc).__name__, detail)
    return f"internal error in {stage} for this request: {type(exc).__name__}: {detail}".rstrip(": ")
