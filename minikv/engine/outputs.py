"""What a request returns, named as in vLLM so that code written against minikv reads the same."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .sequence import Sequence


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    # With finish_reason "error": what failed (the stage and the exception).  The failure was
    # this request's alone; the engine's other requests went on (see engine/step_guard.py).
    error: str | None = None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, queueing included (``time.perf_counter`` clock)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_s(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    tenant: str | None = None
    num_preemptions: int = 0
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_sequence(cls, seq: "Sequence") -> "RequestOutput":
        """A detached copy of what ``seq`` has produced so far."""
        return cls(seq.request_id, seq.prompt, list(seq.prompt_token_ids),
                   [CompletionOutput(0, seq.output_text, list(seq.output_token_ids), seq.finish_reason, seq.error)],
                   seq.is_finished, seq.num_cached_tokens or 0,
                   RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time), seq.tenant,
                   seq.num_preemptions)
