"""LLMEngine: the loop that ties scheduler, block manager, KV pool and model together.

``add_request`` queues a request; each ``step()`` schedules one mixed batch, runs the model
once over it, samples one token per scheduled sequence, and returns what changed.  Everything
is synchronous and single-threaded, so a lesson can interleave tenants step by step and look
at the pool in between (``snapshot()``).

Security lives in three places you can find from here: the *isolation domain* a request's
blocks are hashed in (``_new_sequence``), the *scrub hooks* run on block lifecycle events
(``_on_block_event``), and the *audit trail* that records every cache decision.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import time

import torch

from ..models.hub import resolve_model
from ..security.hashing import make_hasher
from ..security.keys import derive_operator_key, derive_tenant_key, new_engine_secret
from ..security.scrub import make_scrubber
from .block_manager import ALL_TENANTS, BlockManager
from .config import EngineConfig
from .kv_pool import KVPool, bytes_per_token
from .loader import load_model, resolve_dtype
from .model_runner import prepare_inputs
from .outputs import CompletionOutput, RequestMetrics, RequestOutput
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, *, weights: tuple | None = None, **kwargs):
        """``weights=(model, tokenizer, hf_config)`` reuses another engine's loaded (read-only)
        weights instead of reading the checkpoint: several engines, one copy of the model."""
        self.config = c = config if config is not None else EngineConfig(**kwargs)
        self.device = torch.device(c.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = resolve_dtype(c.dtype, self.device)
        if weights is None:
            weights = load_model(resolve_model(c.model), self.dtype, self.device)
        self.model, self.tokenizer, self.hf_config = weights
        s = self.model.shape
        self.block_size = c.block_size
        self.max_model_len = min(c.max_model_len or s.max_position, s.max_position)
        self.bytes_per_token = bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype)
        self.num_blocks = c.num_blocks or self._default_num_blocks()
        scrubber = c.scrubber if c.scrubber is not None else make_scrubber(c.scrub)
        self.scrubber = scrubber
        self.pool = KVPool(s.num_layers, self.num_blocks, c.block_size, s.num_kv_heads, s.head_dim,
                           self.dtype, self.device)
        self._secret = c.engine_secret or new_engine_secret()  # never logged or returned
        hasher = c.block_hasher if c.block_hasher is not None else make_hasher(c.hash_algo, self._secret)
        self.block_manager = BlockManager(
            self.num_blocks, c.block_size, hasher=hasher, enable_caching=c.enable_prefix_caching,
            chain_hashes=c.chain_hashes, verify_hits=c.verify_hits,
            max_cached_per_tenant=c.max_cached_blocks_per_tenant)
        self.block_manager.listeners.append(self._on_block_event)
        self.audit = None
        # Fingerprints in the trail are keyed with the operator key; a fork inherits it (``fork``).
        self._operator_key = derive_operator_key(self._secret)
        if c.audit_log is not None:
            from ..audit.trail import AuditTrail
            self.audit = AuditTrail(c.audit_log, self._operator_key, c.block_size, level=c.audit_level)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens)
        self._tenant_keys: dict[str | None, bytes] = {}
        self._shared_prefixes = [self.encode_prompt(p)[0] for p in c.shared_prefixes]
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._rng = torch.Generator().manual_seed(c.seed)
        self.eos_token_ids = self._eos_ids()
        self.step_count = 0
        self.logit_trace: list | None = None  # set to [] to record {request_id: logits} per step
        self.stats = dict(requests=0, prompt_tokens=0, cached_tokens=0, generated_tokens=0,
                          preemptions=0, steps=0, scrub_s=0.0, aborted=0)

    # ------------------------------------------------------------------ set-up helpers
    def _default_num_blocks(self) -> int:
        block_bytes = self.bytes_per_token * self.block_size
        budget = int(self.config.kv_cache_memory_gb * 2**30) // block_bytes
        wanted = math.ceil(self.max_model_len * self.config.max_num_seqs / self.block_size)
        return max(math.ceil(self.max_model_len / self.block_size) + 1, min(budget, wanted))

    def _eos_ids(self) -> set[int]:
        ids = set()
        for src in (self.hf_config.eos_token_id, self.tokenizer.eos_token_id):
            ids.update(src if isinstance(src, (list, tuple)) else [src] if src is not None else [])
        return ids

    def tenant_key(self, tenant: str | None) -> bytes:
        """The server-side key of a tenant's isolation domain, derived from the engine secret.
        Clients never see it or supply it, so one client cannot claim another's domain."""
        if tenant not in self._tenant_keys:
            self._tenant_keys[tenant] = derive_tenant_key(self._secret, tenant)
        return self._tenant_keys[tenant]

    def fork(self, **overrides) -> "LLMEngine":
        """A new engine with its own pool, scheduler, keys and trail, sharing this one's weights.
        ``overrides`` are :class:`EngineConfig` fields; the weights fix model, device and dtype.
        Unless given its own ``engine_secret``, the fork fingerprints with this engine's operator
        key; with the same ``audit_log`` it writes into the same trail, tagged ``<tag>.<n>``."""
        for fixed in ("model", "device", "dtype"):
            if fixed in overrides:
                raise ValueError(f"{fixed!r} cannot be overridden: a fork shares the parent's weights")
        cfg = dataclasses.replace(self.config, device=str(self.device), dtype=self.dtype, **overrides)
        child = LLMEngine(cfg, weights=(self.model, self.tokenizer, self.hf_config))
        if "engine_secret" not in overrides:
            # One audit identity per engine family: identical content gets the same fingerprint
            # in every fork's records.  A fork given its own secret is a separate domain.
            child._operator_key = self._operator_key
        if child.audit is not None:
            # The fork's records carry the tag "<parent tag>.<n>", so the same request id in the
            # parent and in a fork (both count from 0) never names two requests in one trail.
            child.audit.set_lineage(child._operator_key, parent=self.audit)
        return child

    def reset_prefix_cache(self, tenant=ALL_TENANTS) -> int:
        """Evict every cached, unreferenced block (or only those written by ``tenant``), as
        vLLM's ``reset_prefix_cache`` does.  Returns how many blocks were evicted."""
        return self.block_manager.evict_cached(tenant)

    def new_request_id(self) -> str:
        return str(next(self._ids))

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt) -> tuple[list[int], str | None]:
        """Token ids (validated against the vocabulary) and text of a str or token-id prompt."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty ('')")
            return list(self.tokenizer(prompt).input_ids), prompt
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self.model.shape.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.model.shape.vocab_size})")
            return list(prompt), None
        raise TypeError(f"prompt must be a str or a list of token ids, got {type(prompt).__name__}")

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    tenant: str | None = None) -> None:
        """Queue a request.  Invalid input raises here, before anything is allocated, so a bad
        request never disturbs the ones already running."""
        if tenant is not None and not isinstance(tenant, str):
            raise TypeError(f"tenant must be a str or None, got {type(tenant).__name__}")
        if not isinstance(request_id, str) or request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is not a new string id")
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids, text = self.encode_prompt(prompt)
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(ids)} tokens; max_model_len is {self.max_model_len}")
        if len(ids) + 1 > self.num_blocks * self.block_size:
            raise ValueError(f"prompt has {len(ids)} tokens; the whole pool holds "
                             f"{self.num_blocks * self.block_size}")
        seq = self._new_sequence(request_id, ids, text, params, tenant)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.stats["requests"] += 1
        if self.audit:
            self.audit.request(seq)

    def _new_sequence(self, request_id, ids, text, params, tenant) -> Sequence:
        iso = self.config.cache_isolation
        seq = Sequence(request_id, ids, params, tenant=tenant, prompt=text,
                       tenant_key=self.tenant_key(tenant) if iso == "tenant" else None,
                       cacheable=iso != "request")
        seq.public_len = max((_common_prefix_len(ids, p) for p in self._shared_prefixes), default=0)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        return seq

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is None:
            raise ValueError(f"unknown request id {request_id!r}")
        self.stats["aborted"] += 1
        self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason, seq.status = reason, SequenceStatus.FINISHED
        seq.finish_time = time.perf_counter()
        self.scheduler.remove(seq)
        self.requests.pop(seq.request_id, None)
        if self.audit:
            self.audit.finish(seq)

    # ------------------------------------------------------------------ block lifecycle hooks
    def _on_block_event(self, event: str, ids: list[int], seq: Sequence | None) -> None:
        hook = {"evict": "on_free", "release": "on_free", "allocate": "on_alloc"}.get(event)
        if hook:
            t0 = time.perf_counter()
            getattr(self.scrubber, hook)(self.pool, ids)
            self.stats["scrub_s"] += time.perf_counter() - t0
            # Log only hooks that really zero memory (a scrubber lists them in ``hooks``).
            if self.audit and hook in getattr(self.scrubber, "hooks", ("on_free", "on_alloc")):
                self.audit.scrub(hook, ids, seq)
        if self.audit and event != "release":
            self.audit.block_event(event, ids, seq, self.block_manager.blocks)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + model step; return outputs of every sequence that advanced."""
        batch = self.scheduler.schedule()
        self.step_count += 1
        self.stats["steps"] += 1
        self.stats["preemptions"] += len(batch.preempted)
        for seq in batch.prefills:
            if seq.num_preemptions == 0:
                self.stats["prompt_tokens"] += seq.num_prompt_tokens
                self.stats["cached_tokens"] += seq.num_computed_tokens
        if batch.empty:
            # Nothing fits even in an empty pool: a preempted sequence outgrew the pool.
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]
                self._finish(seq, "length")
                return [self._output(seq)]
            return []
        seqs = batch.prefills + batch.decodes
        input_ids, positions, meta, last_rows = prepare_inputs(batch.prefills, batch.decodes,
                                                               self.block_size, self.device)
        hidden = self.model.forward(input_ids, positions, self.pool, meta)
        logits = self.model.logits(hidden[last_rows])
        tokens = sample(logits, [s.params for s in seqs], [s.generator for s in seqs])
        if self.logit_trace is not None:
            self.logit_trace.append({s.request_id: logits[i].cpu() for i, s in enumerate(seqs)})
        now = time.perf_counter()
        outputs = []
        for seq, tok in zip(seqs, tokens):
            seq.num_computed_tokens = seq.num_tokens
            self.block_manager.commit(seq)
            seq.output_token_ids.append(tok)
            self.stats["generated_tokens"] += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            reason = self._check_stop(seq, tok)
            if reason:
                self._finish(seq, reason)
            outputs.append(self._output(seq))
        return outputs

    def _check_stop(self, seq: Sequence, tok: int) -> str | None:
        p = seq.params
        seq.output_text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        if (not p.ignore_eos and tok in self.eos_token_ids) or tok in p.stop_token_ids:
            return "stop"
        for s in p.stop_strings:
            idx = seq.output_text.find(s)
            if idx >= 0:
                seq.output_text = seq.output_text[:idx]
                return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            seq.request_id, seq.prompt, list(seq.prompt_token_ids),
            [CompletionOutput(0, seq.output_text, list(seq.output_token_ids), seq.finish_reason)],
            seq.is_finished, seq.num_cached_tokens or 0,
            RequestMetrics(seq.arrival_time, seq.first_token_time, seq.finish_time), seq.tenant,
            seq.num_preemptions)

    # ------------------------------------------------------------------ inspection
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of ``token_ids`` ([T, vocab], fp32), computed through the
        same paged path as a prefill; the blocks are borrowed from the pool and returned.
        Lessons use it to let the model rank candidates; tests compare it with transformers."""
        ids, _ = self.encode_prompt(list(token_ids))
        seq = Sequence(f"score-{self.new_request_id()}", ids, SamplingParams(max_tokens=1), cacheable=False)
        if not self.block_manager.allocate(seq):
            raise RuntimeError("the pool has no room to score this sequence now")
        try:
            seq.num_computed_tokens = 0  # score every position, even a prefix-cache hit's
            input_ids, positions, meta, _ = prepare_inputs([seq], [], self.block_size, self.device)
            return self.model.logits(self.model.forward(input_ids, positions, self.pool, meta))
        finally:
            self.block_manager.free(seq)

    def snapshot(self):
        """A frozen copy of the pool and queues (see ``snapshot.py``) for visualizations."""
        sch = self.scheduler
        tenants = {s.request_id: s.tenant for s in list(sch.running) + list(sch.waiting)}
        return self.block_manager.snapshot(self.step_count, [s.request_id for s in sch.running],
                                           [s.request_id for s in sch.waiting], tenants)

    def check_invariants(self) -> None:
        self.block_manager.check_invariants(list(self.scheduler.running))


def _common_prefix_len(ids: list[int], public: list[int]) -> int:
    """How many leading tokens of ``ids`` equal the public prefix's.  Token-wise, not all-or-
    nothing: BPE often merges the public text's last token with the user's first word, and
    tokens that equal the public text's are public content whatever follows them."""
    n = 0
    for a, b in zip(ids, public):
        if a != b:
            break
        n += 1
    return n
