"""One request's life inside the engine.

A :class:`Sequence` is the engine's record of a request: its tokens, where their K/V live
(the *block table*), how many of them have K/V computed, and the timing of its life.  The
scheduler moves it between the ``waiting`` and ``running`` queues; the block manager fills
its block table.  Nothing here touches torch tensors, so a sequence is cheap to inspect.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keep this module torch-free at run time
    from .sampling import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; holds no blocks
    RUNNING = "running"  # holds blocks; gets a token every step
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: "SamplingParams"
    tenant: str | None = None
    prompt: str | None = None
    # Isolation domain: the server-side key that enters this request's block hashes, and how
    # many leading tokens belong to an operator-declared public prefix (hashed without it).
    tenant_key: bytes | None = None
    public_len: int = 0
    # Selective sharing (minikv/sharing/): tokens hashed without the tenant key although not
    # public (the ``monitor`` strategy's shared region), and the operator's content fingerprints.
    open_len: int = 0
    content_fps: list[str] = field(default_factory=list, repr=False)
    # Private marks: the tenant's (add_request(cache_private=True)) and, from the block holding
    # a match of the operator's sensitive_prefixes (or 0), the first block no strategy shares.
    cache_private: bool = False
    private_from: int | None = None
    cacheable: bool = True  # False under cache_isolation="request"
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks, in order
    tier_hashes: list[bytes] = field(default_factory=list, repr=False)  # UNSAFE content-only chain (minikv.tiers.link)
    num_tier_blocks: int = 0  # admission hits whose K/V came back from a KV tier (onload), not the pool
    num_computed_tokens: int = 0  # tokens whose K/V are in the pool
    num_committed_tokens: int = 0  # of those, how many BlockManager.commit has recorded (its watermark)
    # Tokens the current step computes (set by the scheduler): 1 for a decode, a prefill's chunk
    # otherwise; a chunk that stops short of num_tokens samples no token (scheduler.py).
    num_scheduled_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit at first admission
    num_preemptions: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it failed, when finish_reason == "error" (see step_guard.py)
    output_text: str = ""
    detok_offsets: tuple[int, int] = (0, 0)  # where detokenizer.detokenize's window starts, what it printed
    generator: object = None
    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    _token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    @property
    def token_ids(self) -> list[int]:
        """Prompt then output tokens, as one list.  Read-only.

        It is kept, not rebuilt: each read appends only the outputs added since the last one
        (outputs only grow).  Concatenating on every read would cost O(length) per read, and
        hashing, hit checks and the model runner read it once per block: O(length^2) per prompt."""
        ids, n_prompt = self._token_ids, len(self.prompt_token_ids)
        if not n_prompt <= len(ids) <= n_prompt + len(self.output_token_ids):  # first read, or outputs shrank
            ids[:] = self.prompt_token_ids
        ids.extend(self.output_token_ids[len(ids) - n_prompt:])
        return ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def block_tokens(self, i: int, block_size: int) -> tuple[int, ...]:
        """Token ids stored in logical block ``i``."""
        return tuple(self.token_ids[i * block_size:(i + 1) * block_size])

    def block_is_public(self, i: int, block_size: int) -> bool:
        """Does logical block ``i`` lie entirely inside an operator-declared public prefix?"""
        return (i + 1) * block_size <= self.public_len

    def domain_key(self, i: int, block_size: int) -> bytes | None:
        """The tenant key for logical block ``i``: None for a public block (so every tenant can
        share it) or one inside ``open_len``, the tenant's own key afterwards."""
        if self.block_is_public(i, block_size) or (i + 1) * block_size <= self.open_len:
            return None
        return self.tenant_key


def common_prefix_len(ids: list[int], public: list[int]) -> int:
    """How many leading tokens of ``ids`` equal the public prefix's (``Sequence.public_len``).
    Token-wise, not all-or-nothing: BPE often merges the public text's last token with the
    user's first word, and tokens that equal the public text's are public content whatever
    follows them."""
    n = 0
    for a, b in zip(ids, public):
        if a != b:
            break
        n += 1
    return n


def stop_reason(seq: Sequence, tok: int, eos_ids: set[int], max_model_len: int,
                new_chars: int | None = None) -> str | None:
    """Why ``seq`` stops after its new token ``tok`` ("stop", "length"), or None to go on.
    A stop string cuts ``seq.output_text`` (already detokenized) where it starts.

    ``new_chars``: how many characters at the end of the text are new this step.  Only they,
    and the ``len(stop) - 1`` before them that a stop string may straddle, are searched, so a
    step costs O(new text), not O(output); None searches everything."""
    p = seq.params
    if (not p.ignore_eos and tok in eos_ids) or tok in p.stop_token_ids:
        return "stop"
    text = seq.output_text
    for s in p.stop_strings:
        idx = text.find(s, 0 if new_chars is None else max(0, len(text) - new_chars - len(s) + 1))
        if idx >= 0:
            seq.output_text = seq.output_text[:idx]
            return "stop"
    if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None
