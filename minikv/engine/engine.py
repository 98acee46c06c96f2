"""LLMEngine: the loop that ties scheduler, block manager, KV pool and model together.

``add_request`` queues a request; each ``step()`` schedules one mixed batch, runs the model
once over it, samples one token per scheduled sequence, and returns what changed.  Everything
is synchronous and single-threaded, so a lesson can interleave tenants step by step and look
at the pool in between (``snapshot()``).

Security lives in three places you can find from here: the *isolation domain* a request's
blocks are hashed in (``_new_sequence``), the *scrub hooks* run on block lifecycle events
(``_on_block_event``), and the *audit trail* that records every cache decision through the same
events and hooks.  Before any of them, every request is checked at the door (``intake.py``).
"""
from __future__ import annotations

import dataclasses
import itertools
import time

import torch

from ..security.hashing import make_hasher
from ..security.keys import derive_operator_key, derive_tenant_key, new_engine_secret
from ..security.scrub import make_scrubber, scrub_hook
from . import intake, step_guard
from .block_manager import ALL_TENANTS, BlockManager, NoConnector
from .config import EngineConfig
from .detokenizer import advance_text
from .device import resolve_device
from .kv_pool import KVPool, bytes_per_token
from .lifecycle import LIFECYCLE, Transition
from .loader import eos_token_ids, resolve_dtype
from .model_runner import reference_only, score_tokens
from .outputs import RequestOutput
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .seams import EngineSeams
from .sequence import Sequence, SequenceStatus, common_prefix_len
from .snapshot import PoolSnapshot, capture


class LLMEngine(EngineSeams):  # EngineSeams: the test-only set_* seams (seams.py), all off by default
    def __init__(self, config: EngineConfig | None = None, *, weights: tuple | None = None,
                 open_trail=None, make_backend=None, attach: tuple = (), **kwargs):
        """Both dependencies are handed in; the engine resolves no model name and imports no audit code.

        ``weights=(model, tokenizer, hf_config)``: loaded weights (``loader.load_model(path, ...)``),
        possibly another engine's (read-only): several engines, one copy of the model.
        ``open_trail(config, operator_key) -> trail | None`` opens the audit trail named by
        ``config.audit_log`` (``minikv.llm.open_trail`` builds a ``minikv.audit.trail.AuditTrail``).
        ``make_backend(engine) -> Backend`` picks how the forward pass runs (``model_runner.Backend``;
        without it, ``model_runner.reference_only``).  ``attach``: callables ``attach(engine)``, run
        once the block manager exists, each plugging a component in through hooks (KV tiers,
        selective sharing); a fork gets the same.  ``minikv.LLM(name, ...)`` composes all this."""
        self.config = c = config if config is not None else EngineConfig(**kwargs)
        self.device = resolve_device(c.device)
        self.dtype = resolve_dtype(c.dtype, self.device)
        if weights is None:
            raise TypeError("LLMEngine needs weights=(model, tokenizer, hf_config): load them with "
                            "minikv.engine.loader.load_model(path, dtype, device), or build the engine "
                            "with minikv.LLM(model_name_or_path, ...)")
        if c.audit_log is not None and open_trail is None:
            raise ValueError(f"audit_log={c.audit_log!r} needs open_trail= to open it (minikv.LLM passes "
                             "minikv.llm.open_trail); refusing to run without the trail asked for")
        self._open_trail = open_trail
        self.model, self.tokenizer, self.hf_config = weights
        s = self.model.shape
        self.block_size = c.block_size
        self.max_model_len = min(c.max_model_len or s.max_position, s.max_position)
        self.bytes_per_token = bytes_per_token(s.num_layers, s.num_kv_heads, s.head_dim, self.dtype)
        self.num_blocks = c.num_blocks or c.default_num_blocks(self.bytes_per_token, self.max_model_len)
        self.scrubber = c.scrubber if c.scrubber is not None else make_scrubber(c.scrub)
        self._make_backend = make_backend
        self.backend = make_backend(self) if make_backend is not None else reference_only(c.attention_backend)
        self.attention_backend = self.backend.name
        self.pool = KVPool(s.num_layers, self.num_blocks, c.block_size, s.num_kv_heads, s.head_dim,
                           self.dtype, self.device, memory=self.backend.memory)
        self.backend.bind(self)  # weights packed, graphs set up: now, not mid-request
        self._secret = c.engine_secret or new_engine_secret()  # never logged or returned
        hasher = c.block_hasher if c.block_hasher is not None else make_hasher(c.hash_algo, self._secret)
        self.block_manager = BlockManager(
            self.num_blocks, c.block_size, hasher=hasher, enable_caching=c.enable_prefix_caching,
            chain_hashes=c.chain_hashes, verify_hits=c.verify_hits,
            max_cached_per_tenant=c.cache_quota(self.num_blocks))
        self.block_manager.listeners.append(self._on_block_event)  # first: a block is scrubbed before anyone hears of it
        self.sharing = None  # cache_isolation="selective": set by minikv.sharing.attach_sharing
        self.admit_hooks: list = []  # hook(seq): a new request, its domains set (selective sharing)
        self.request_hooks: list = []  # hook(seq): a request just queued (the audit trail)
        self.finish_hooks: list = []  # hook(seq): a finished request
        self._attach = tuple(attach)
        for plug_in in self._attach:  # KV tiers below the pool (kv_tiers=...): minikv.tiers
            plug_in(self)
        if c.kv_tiers and isinstance(self.block_manager.kv_connector, NoConnector):
            raise ValueError(f"kv_tiers={c.kv_tiers!r} needs the tiers attached: build the engine with "
                             "minikv.LLM, or pass attach=(minikv.tiers.attach_tiers,)")
        if c.cache_isolation == "selective" and c.enable_prefix_caching and self.sharing is None:
            raise ValueError("cache_isolation='selective' needs attach=(minikv.sharing.attach_sharing,) (minikv.LLM passes it)")
        # The trail fingerprints with the operator key (a fork inherits it) and records through the
        # hooks above, ahead of the plug-ins (``AuditTrail.attach``).
        self._operator_key = derive_operator_key(self._secret)
        self.audit = open_trail(c, self._operator_key) if open_trail is not None else None
        if self.audit is not None:
            self.audit.attach(self)
        self.scheduler = Scheduler(self.block_manager, c.max_num_seqs, c.max_num_batched_tokens,
                                   contended_budget=c.contended_num_batched_tokens)
        self._tenant_keys: dict[str | None, bytes] = {}
        self._shared_prefixes = [self.encode_prompt(p)[0] for p in c.shared_prefixes]
        for p in c.sensitive_prefixes:  # checked under every policy
            self.encode_prompt(p)
        self.requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._rng = torch.Generator().manual_seed(c.seed)
        self.eos_token_ids = eos_token_ids(self.hf_config, self.tokenizer)
        self.step_count = 0
        self.logit_trace: list | None = None  # set to [] to record {request_id: logits} per step
        self.stats = dict(requests=0, prompt_tokens=0, cached_tokens=0, generated_tokens=0,
                          preemptions=0, steps=0, scrub_s=0.0, aborted=0, failed=0, tier_tokens=0)

    # ------------------------------------------------------------------ set-up helpers
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
        if fixed := sorted({"model", "device", "dtype"} & overrides.keys()):
            raise ValueError(f"{fixed[0]!r} cannot be overridden: a fork shares the parent's weights")
        cfg = dataclasses.replace(self.config, device=str(self.device), dtype=self.dtype, **overrides)
        child = LLMEngine(cfg, weights=(self.model, self.tokenizer, self.hf_config), open_trail=self._open_trail,
                          make_backend=self._make_backend, attach=self._attach)
        if "engine_secret" not in overrides:  # one audit identity per engine family (same fingerprints)
            child._operator_key = self._operator_key
        if child.audit is not None:  # tag "<parent tag>.<n>": request ids of forks never clash in one trail
            child.audit.set_lineage(child._operator_key, parent=self.audit)
        return child

    def reset_prefix_cache(self, tenant=ALL_TENANTS) -> int:
        """Evict every cached block (or ``tenant``'s), as vLLM's does; returns how many."""
        return self.block_manager.evict_cached(tenant)

    def new_request_id(self) -> str:
        return str(next(self._ids))

    # ------------------------------------------------------------------ requests
    def encode_prompt(self, prompt) -> tuple[list[int], str | None]:
        """Token ids (checked against the vocabulary) and text of a str or token-id prompt (``intake.py``)."""
        return intake.encode_prompt(self.tokenizer, self.model.shape.vocab_size, prompt)

    def add_request(self, request_id: str, prompt, params: SamplingParams | None = None,
                    tenant: str | None = None, cache_private: bool = False) -> None:
        """Queue a request.  Invalid input raises here, before anything is allocated, so a bad
        request never disturbs the ones already running.  ``cache_private=True``: the tenant's
        mark -- this request's blocks stay in its tenant's domain under every policy (``minikv.sharing``)."""
        ids, text, params = intake.check_request(self, request_id, prompt, params, tenant, cache_private)
        seq = self._new_sequence(request_id, ids, text, params, tenant, cache_private)
        self.requests[request_id] = seq
        self.scheduler.add(seq)
        self.stats["requests"] += 1
        for hook in self.request_hooks:
            hook(seq)

    def _new_sequence(self, request_id, ids, text, params, tenant, private=False) -> Sequence:
        iso = self.config.cache_isolation
        seq = Sequence(request_id, ids, params, tenant=tenant, prompt=text, cache_private=private,
                       tenant_key=self.tenant_key(tenant) if iso in ("tenant", "selective") or private else None,
                       cacheable=iso != "request")
        seq.public_len = max((common_prefix_len(ids, p) for p in self._shared_prefixes), default=0)
        for hook in self.admit_hooks:
            hook(seq)
        seed = params.seed if params.seed is not None else int(torch.randint(2**62, (1,), generator=self._rng))
        seq.generator = torch.Generator(device=self.device).manual_seed(seed)
        return seq

    def abort_request(self, request_id: str) -> None:
        seq = self.requests.get(request_id)
        if seq is None:
            raise ValueError(f"unknown request id {request_id!r}")
        self.stats["aborted"] += 1
        if self.abort_release is not None and seq in self.scheduler.running:  # test-only seam
            self.abort_release(self.block_manager, seq)
        self._finish(seq, "abort")

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def _fail(self, seq: Sequence, stage: str, exc: Exception) -> RequestOutput:  # this one alone: step_guard
        seq.error = step_guard.describe_failure(seq, stage, exc)
        self.stats["failed"] += 1
        self._finish(seq, "error")
        return RequestOutput.from_sequence(seq)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason, seq.status = reason, SequenceStatus.FINISHED
        seq.finish_time = time.perf_counter()
        self.scheduler.remove(seq)
        self.requests.pop(seq.request_id, None)
        for hook in self.finish_hooks:
            hook(seq)

    # ------------------------------------------------------------------ the block lifecycle
    def _on_block_event(self, transition: Transition, ids: list[int], seq: Sequence | None) -> None:
        """Every block transition runs its scrubber hook, if the scrubber has one (``LIFECYCLE``)."""
        scrub = scrub_hook(self.scrubber, LIFECYCLE[transition].hook)
        if scrub is not None:
            t0 = time.perf_counter()
            scrub(self.pool, ids)
            self.stats["scrub_s"] += time.perf_counter() - t0

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        """Run one scheduling + model step; return outputs of every sequence that advanced.

        An exception in one sequence's forward, sampling, commit or detokenization fails that
        sequence alone (``finish_reason="error"``); the rest of the batch goes on (``step_guard``)."""
        batch = self.scheduler.schedule()
        self.step_count += 1
        self.stats["steps"] += 1
        self.stats["preemptions"] += len(batch.preempted)
        for seq in batch.admitted:
            if seq.num_preemptions == 0:
                self.stats["prompt_tokens"] += seq.num_prompt_tokens
                self.stats["cached_tokens"] += seq.num_computed_tokens
                self.stats["tier_tokens"] += seq.num_tier_blocks * self.block_size  # of those, onloaded
        if batch.empty:  # nothing fits even in an empty pool: a preempted sequence outgrew it
            if self.scheduler.waiting and not self.scheduler.running:
                seq = self.scheduler.waiting[0]
                self._finish(seq, "length")
                return [RequestOutput.from_sequence(seq)]
            return []
        rows, failed = step_guard.guarded_forward(self, batch.chunks + batch.prefills, batch.decodes)
        outputs = [self._advance_chunk(seq, rows.pop(seq, None), failed) for seq in batch.chunks]
        if self.logit_trace is not None:
            self.logit_trace.append({s.request_id: row.cpu() for s, row in rows.items()})
        live = [s for s in batch.prefills + batch.decodes if s not in failed]  # one batched draw
        drawn = dict(zip(live, sample([rows[s] for s in live], [s.params for s in live], [s.generator for s in live],
                                      [s.output_token_ids for s in live])))  # what penalties count
        now = time.perf_counter()
        outputs = [out for out in outputs if out is not None]
        for seq in batch.prefills + batch.decodes:
            if seq in failed:
                outputs.append(self._fail(seq, "forward", failed[seq]))
                continue
            stage = "sample"
            try:  # the per-sequence stages: whatever raises here is this sequence's failure
                step_guard.inject(self, stage, seq)
                tok = drawn[seq]
                if isinstance(tok, Exception):
                    raise tok
                stage = "commit"
                step_guard.inject(self, stage, seq)
                seq.num_computed_tokens = seq.num_tokens
                self.block_manager.commit(seq)
                seq.output_token_ids.append(tok)
                stage = "detokenize"
                step_guard.inject(self, stage, seq)
                reason = advance_text(self.tokenizer, seq, tok, self.eos_token_ids, self.max_model_len)
            except Exception as exc:  # noqa: BLE001 -- contained: see step_guard.py
                outputs.append(self._fail(seq, stage, exc))
                continue
            self.stats["generated_tokens"] += 1
            if seq.first_token_time is None:
                seq.first_token_time = now
            if reason:
                self._finish(seq, reason)
            outputs.append(RequestOutput.from_sequence(seq))
        return outputs

    def _advance_chunk(self, seq: Sequence, row, failed: dict) -> RequestOutput | None:
        """A prefill chunk that stops short of the prompt's end (``scheduler.py``): its K/V are
        computed and committed like any step's -- full blocks registered now, never before -- and
        no token is sampled (its logits ``row`` are dropped).  An output only if it failed."""
        try:
            if seq in failed:
                return self._fail(seq, "forward", failed[seq])
            step_guard.inject(self, "commit", seq)
            seq.num_computed_tokens += seq.num_scheduled_tokens
            self.block_manager.commit(seq)
        except Exception as exc:  # noqa: BLE001 -- contained: see step_guard.py
            return self._fail(seq, "commit", exc)
        return None

    # ------------------------------------------------------------------ inspection
    def score(self, token_ids: list[int]) -> torch.Tensor:
        """Logits at every position of ``token_ids`` ([T, vocab], fp32), as a prefill computes them."""
        return score_tokens(self, token_ids)

    def snapshot(self) -> PoolSnapshot:
        """A frozen copy of the pool and queues (see ``snapshot.py``) for visualizations."""
        return capture(self.block_manager, self.step_count, self.scheduler.running, self.scheduler.waiting)

    def check_invariants(self) -> None:
        self.block_manager.check_invariants(list(self.scheduler.running))
