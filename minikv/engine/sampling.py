"""Sampling parameters (vLLM's names) and the sampler that turns logits into tokens.

Why per-request generators?  A seeded request must produce the same tokens whether it runs
alone or inside a batch of 60 strangers, otherwise "seed" means nothing in a server.  Each
sequence therefore draws from its own ``torch.Generator``; the batch only shares the logits
computation, never the randomness.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop.

    Mirrors vLLM's ``SamplingParams``: ``temperature=0`` is greedy; ``top_k=0`` (or -1) and
    ``top_p=1`` disable those filters; ``seed`` makes sampling reproducible per request;
    generation stops at EOS (unless ``ignore_eos``), at any ``stop`` string, at a
    ``stop_token_ids`` token, or after ``max_tokens``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1
    stop_strings: tuple = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int):
            raise TypeError(f"max_tokens must be an int, got {type(self.max_tokens).__name__}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise ValueError(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disables it), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__}")
        if self.n != 1:
            raise ValueError(f"n={self.n!r} is not supported; minikv returns one completion per request")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        self.stop_strings = tuple(stops)
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """Pick one token per row of ``logits`` ([batch, vocab], any float dtype).

    Greedy rows take the argmax.  Sampled rows apply temperature, then top-k, then top-p
    (nucleus) filtering, and draw from what is left with the row's own generator.
    """
    logits = logits.float()
    out = logits.argmax(dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        row = logits[i] / p.temperature
        if p.top_k > 0 and p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(row, descending=True)
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the mass *before* it already reaches top_p: the most likely
            # token always survives, and the kept set is the smallest one covering top_p.
            drop = (torch.cumsum(probs, dim=-1) - probs) >= p.top_p
            row = row.scatter(0, order[drop], float("-inf"))
        probs = torch.softmax(row, dim=-1)
        out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
