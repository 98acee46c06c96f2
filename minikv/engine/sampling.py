"""Sampling parameters (vLLM's names) and the sampler that turns logits into tokens.

When a request *stops* is the sequence's business (``sequence.stop_reason``): this module knows
logits and parameters, never a :class:`Sequence`, so the two never import each other.

Why per-request generators?  A seeded request must produce the same tokens whether it runs
alone or inside a batch of 60 strangers, otherwise "seed" means nothing in a server.  Each
sequence therefore draws from its own ``torch.Generator``; the batch only shares the logits
computation, never the randomness.

Penalties and biases (OpenAI's, as vLLM applies them) act on the logits before anything else,
greedy rows included: ``logit_bias`` adds its value to its token's logit; ``presence_penalty``
subtracts itself from every token the request has already *generated* (its prompt does not
count), and ``frequency_penalty`` subtracts itself once per time the token was generated.  A
positive penalty makes repeats less likely, a negative one more likely.  So the sampler needs
each row's output so far -- the one thing here that a row's logits alone do not tell.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

from .checks import as_int, as_real, as_seed, check_bool, show

# Temperatures below this are greedy (vLLM's ``_SAMPLING_EPS``).  Dividing logits by a tiny
# positive temperature is not "almost greedy" in floating point: 1e-50 is 0 in fp32, and the
# division gives inf/NaN rows that make ``torch.multinomial`` raise.  Greedy is what the
# caller meant, so that is what they get.
GREEDY_EPS = 1e-5

# OpenAI's ranges (vLLM checks the same): penalties in [-2, 2], a logit bias in [-100, 100].
PENALTY_RANGE, BIAS_RANGE = 2.0, 100.0


@dataclass
class SamplingParams:
    """How to pick each next token, and when to stop.

    Mirrors vLLM's ``SamplingParams``: ``temperature=0`` is greedy; ``top_k=0`` (or -1) and
    ``top_p=1`` disable those filters; ``seed`` makes sampling reproducible per request;
    generation stops at EOS (unless ``ignore_eos``), at any ``stop`` string, at a
    ``stop_token_ids`` token, or after ``max_tokens``.  ``presence_penalty``,
    ``frequency_penalty`` and ``logit_bias`` (token id -> bias) reshape the logits first (module
    doc); the engine checks ``logit_bias``'s ids against the vocabulary, which only it knows.

    Every field is validated here, because this is the door every request comes through (the
    Python API, the CLI and the HTTP server all build one).  A value the sampler could choke on
    -- NaN, inf, ``10**400``, a seed torch cannot take -- raises ``ValueError``/``TypeError``
    naming the field and the value, so it is rejected before it reaches a batch shared with
    other tenants.  Temperatures below ``GREEDY_EPS`` (1e-5) count as greedy, as in vLLM.
    NumPy integers are accepted where an int is expected (converted exactly); bools are not.
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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    stop_strings: tuple = field(init=False, repr=False, default=())

    def __post_init__(self) -> None:
        self.max_tokens = as_int("max_tokens", self.max_tokens)
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {show(self.max_tokens)}")
        self.temperature = as_real("temperature", self.temperature)
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        self.top_p = as_real("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        self.top_k = as_int("top_k", self.top_k)
        if self.top_k < -1:
            raise ValueError(f"top_k must be an int >= -1 (0 or -1 disables it), got {show(self.top_k)}")
        if self.seed is not None:
            self.seed = as_seed("seed", self.seed)
        if isinstance(self.n, bool) or self.n != 1:
            raise ValueError(f"n={show(self.n)} is not supported; minikv returns one completion per request")
        check_bool("ignore_eos", self.ignore_eos)
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise TypeError(f"stop must be a str or a list of str, got {type(self.stop).__name__} ({show(self.stop)})")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise ValueError(f"stop must be non-empty strings, got {show(self.stop)}")
        self.stop_strings = tuple(stops)
        ids = self.stop_token_ids
        if ids is not None and not isinstance(ids, (list, tuple)):
            raise TypeError(f"stop_token_ids must be a list of ints, got {type(ids).__name__} ({show(ids)})")
        self.stop_token_ids = [as_int(f"stop_token_ids[{i}]", t, minimum=0) for i, t in enumerate(ids or ())]
        for name in ("presence_penalty", "frequency_penalty"):
            value = as_real(name, getattr(self, name))
            if not -PENALTY_RANGE <= value <= PENALTY_RANGE:
                raise ValueError(f"{name} must be in [-2, 2], got {value!r}")
            setattr(self, name, value)
        self.logit_bias = _check_bias(self.logit_bias)

    @property
    def penalized(self) -> bool:
        """Does any of presence/frequency penalty or logit bias change this request's logits?"""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: ``temperature`` below ``GREEDY_EPS`` (0 included)."""
        return self.temperature < GREEDY_EPS


def _check_bias(bias) -> dict[int, float] | None:
    """``logit_bias`` as {int token id: float bias}, or an error naming the entry."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise TypeError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__} ({show(bias)})")
    out = {}
    for key, value in bias.items():
        tok = as_int(f"logit_bias key {show(key)}", key, minimum=0)
        b = as_real(f"logit_bias[{tok}]", value)
        if not -BIAS_RANGE <= b <= BIAS_RANGE:
            raise ValueError(f"logit_bias[{tok}] must be in [-100, 100], got {b!r}")
        out[tok] = b
    return out or None


def apply_penalties(logits: torch.Tensor, params: list[SamplingParams], outputs) -> torch.Tensor:
    """``logits`` ([batch, vocab] fp32) with each row's logit bias added and its presence and
    frequency penalties subtracted, counted over ``outputs[i]`` (row i's generated token ids).
    Rows without any come back unchanged; the input is never modified.  Batched: one count
    matrix for the penalized rows, built by one scatter of all their output ids."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    out = logits.clone()
    pen = [i for i in rows if params[i].presence_penalty or params[i].frequency_penalty]
    if pen:
        where = [(r, t) for r, i in enumerate(pen) for t in (outputs[i] if outputs is not None else ())]
        counts = torch.zeros(len(pen), vocab, device=device)
        if where:
            r, t = torch.tensor(where, device=device).T
            counts.index_put_((r, t), torch.ones(len(where), device=device), accumulate=True)
        freq = torch.tensor([params[i].frequency_penalty for i in pen], device=device)[:, None]
        pres = torch.tensor([params[i].presence_penalty for i in pen], device=device)[:, None]
        idx = torch.tensor(pen, device=device)
        out[idx] = out[idx] - freq * counts - pres * (counts > 0).float()
    biased = [(i, t, b) for i in rows for t, b in (params[i].logit_bias or {}).items()]
    if biased:
        r = torch.tensor([i for i, _, _ in biased], device=device)
        t = torch.tensor([t for _, t, _ in biased], device=device)
        out.index_put_((r, t), torch.tensor([b for _, _, b in biased], device=device), accumulate=True)
    return out


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None], outputs=None) -> list[int | Exception]:
    """Pick one token per row of ``logits`` ([batch, vocab] or a list of [vocab] rows, any float
    dtype), all rows at once: the engine's sampler.  ``outputs[i]``: row i's generated token
    ids so far, which its penalties count (None: nothing generated yet, for every row).

    Every row gets exactly what :func:`sample_row` would give it -- the same token for the same
    seed -- but the filters run as batched ops and the draw costs no ``.item()`` per row: one
    ``tolist()`` at the end is the step's only device-to-host sync.  The draw is the trick
    ``torch.multinomial`` itself uses for one sample: ``argmax(probs / q)`` with ``q ~ Exp(1)``
    drawn from the request's own generator, so a request's randomness never depends on its
    batch.  A row that cannot be sampled (NaN or inf logits) comes back as a ``ValueError``
    in its place, so it fails only its own request (``step_guard.py``); should the batched
    code itself raise, every row is retried alone with :func:`sample_row`.
    """
    if not params:
        return []
    try:
        x = torch.stack(list(logits)).float() if isinstance(logits, (list, tuple)) else logits.float()
        tokens, bad = _sample_batch(apply_penalties(x, params, outputs), params, generators)
    except Exception:  # noqa: BLE001 -- fall back to one row at a time, each failing alone
        return [_try_row(logits[i], p, generators[i], outputs[i] if outputs is not None else ())
                for i, p in enumerate(params)]
    return [ValueError("cannot sample: the row's probabilities are not finite (NaN/inf logits)") if b else t
            for t, b in zip(tokens, bad)]


def _try_row(row, p, generator, output_ids) -> int | Exception:
    try:
        return sample_row(row.float(), p, generator, output_ids)
    except Exception as exc:  # noqa: BLE001
        return exc


def _sample_batch(logits: torch.Tensor, params: list[SamplingParams], generators) -> tuple[list, list]:
    greedy_rows = logits.argmax(dim=-1)
    random = [i for i, p in enumerate(params) if not p.greedy]
    if not random:
        return greedy_rows.tolist(), [False] * len(params)
    device, vocab = logits.device, logits.shape[-1]
    x = logits[random] / torch.tensor([params[i].temperature for i in random], device=device)[:, None]
    top_k = [params[i].top_k if 0 < params[i].top_k < vocab else vocab for i in random]
    if min(top_k) < vocab:  # keep values >= each row's k-th largest (ties kept, as topk does)
        kth = x.sort(dim=-1, descending=True).values.gather(1, torch.tensor(top_k, device=device)[:, None] - 1)
        x = x.masked_fill(x < kth, float("-inf"))
    top_p = [params[i].top_p for i in random]
    if min(top_p) < 1.0:  # drop a token once the mass before it reaches top_p (see sample_row)
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        drop = ((torch.cumsum(probs, dim=-1) - probs) >= torch.tensor(top_p, device=device)[:, None])
        drop &= torch.tensor([p < 1.0 for p in top_p], device=device)[:, None]
        x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    q = torch.empty_like(probs)
    for row, i in enumerate(random):  # each request's own stream: vocab draws per step, always
        q[row].exponential_(1, generator=generators[i])
    drawn = (probs / q).argmax(dim=-1)
    bad = ~(torch.isfinite(probs).all(dim=-1) & (probs.sum(dim=-1) > 0))
    idx = torch.tensor(random, device=device)
    out = greedy_rows.index_copy(0, idx, drawn)
    flags = torch.zeros_like(out, dtype=torch.bool).index_copy(0, idx, bad)
    tokens, flags = torch.stack([out, flags.long()]).tolist()  # the one sync
    return tokens, [bool(f) for f in flags]


def sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None,
               output_ids=()) -> int:
    """Draw one token from one fp32 row of logits: bias and penalties (over ``output_ids``, the
    request's generated tokens), temperature, then top-k, then top-p (nucleus) filtering, then
    a draw from what is left with the request's own generator.  The readable one-row version
    of :func:`sample` (which must agree with it token for token)."""
    if p.penalized:
        row = row.clone()
        for tok, n in collections.Counter(output_ids).items():
            row[tok] -= p.frequency_penalty * n + p.presence_penalty
        for tok, bias in (p.logit_bias or {}).items():
            row[tok] += bias
    if p.greedy:
        return int(row.argmax().item())
    row = row / p.temperature
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
    return int(torch.multinomial(probs, 1, generator=generator).item())
