"""The operator's audit trail: a JSONL record of the cache decisions made for each request.

An operator who suspects cross-tenant leakage needs evidence: which request hit which block,
stored by whom, whose allocation evicted whose cached blocks, and whether anybody is probing.
The trail records those *decisions* with the request id and the tenant, but never prompt text
or token ids (the schema is in docs/ARCHITECTURE.md, "Audit trail").

Blocks are identified by a *keyed fingerprint*: ``HMAC-SHA256(operator_key, block_hash)``.
An unkeyed hash would let anyone who reads the log confirm a guessed prompt by hashing the
guess themselves; the HMAC key stays with the operator.  Each request also carries
``prefix_fps``, keyed fingerprints of every block-aligned prefix of its prompt computed from
content alone (no tenant key), so the detector can see one tenant enumerating continuations of
another tenant's prefix even when isolation hides every hit.

Two levels of detail, because a trail is only useful if an operator can afford to keep it on:

* ``"request"`` (default): ONE ``summary`` line per request, written when it finishes or is
  aborted -- counts of blocks allocated, hit, adopted, stored, evicted (with the owners of the
  evicted blocks) and scrubbed, cross-tenant reuses by owner, and the fingerprints.  About
  1 KB/request.
* ``"block"``: one line per block event (``request``, ``allocate``, ``hit``, ``adopt``,
  ``store``, ``evict``, ``scrub``, ``free``, ``finish``), for tracing one request through the cache.

A ``hit`` is a block found in the cache at admission (what ``num_cached_tokens`` counts); an
``adopt`` is a block the request computed itself in the same step as another request with the
same prefix, then swapped for that request's registered copy at commit.  Both hand the request
a block someone else wrote, so both carry ``owner_tenant`` and ``public``, and both count in
``cross_tenant_hits``: an isolation audit must treat another tenant's adopted block exactly
like a hit on it.

Block records are named by the engine's lifecycle table (``minikv.engine.lifecycle``): each
transition has one record kind, and a block whose last holder lets go is a ``free`` record
whether it stays cached or goes to the free list.

Every record carries ``"v": 2`` and ``"engine"``, a tag of the engine that wrote it: forks of an
engine (``LLMEngine.fork``) get ``<parent tag>.<n>`` and may share the parent's file, so
``(engine, request_id)`` names one request even when two forks both number theirs from 0.
The file is written through :class:`~minikv.audit.rotation.RotatingFile` (size/time rotation,
gzip, disk cap).
"""
from __future__ import annotations

import hashlib
import hmac
import itertools
import json
import secrets
import time
from array import array
from collections import Counter
from pathlib import Path

from ..engine.config import AUDIT_LEVELS as LEVELS
from ..engine.lifecycle import LIFECYCLE, REUSE_RECORDS, crosses_tenants
from ..security.scrub import scrub_hook, zeroes
from .rotation import ROTATION_DEFAULTS, open_shared, release_shared

SCHEMA_VERSION = 2


class _Open:
    """What a request-level trail accumulates for one request until it finishes."""

    __slots__ = ("seq", "counts", "hit_fps", "adopted_fps", "stored_fps", "cross", "evicted_owners")

    def __init__(self, seq):
        self.seq = seq
        self.counts = dict(allocated=0, hit=0, adopted=0, stored=0, evicted=0, scrubbed=0, tier_hit=0, offloaded=0)
        self.hit_fps: list[str] = []
        self.adopted_fps: list[str] = []
        self.stored_fps: list[str] = []
        self.cross: Counter = Counter()           # owner tenant -> private blocks of theirs hit or adopted
        self.evicted_owners: Counter = Counter()  # owner tenant -> their blocks this request evicted


class AuditTrail:
    """Writes one engine's records to ``path`` (None: keep them only in memory, if asked).

    ``level``: ``"request"`` or ``"block"`` (see the module doc).  ``engine``: this engine's
    tag (default: 8 random hex digits, so a restarted server appending to the same file is a
    different engine).  ``rotation`` keywords (``max_bytes``, ``rotate_interval_s``,
    ``max_files``, ``max_total_bytes``, ``compress``) go to :class:`RotatingFile`; the
    defaults keep at most 64 MiB live + 8 rotated files.
    """

    def __init__(self, path: str | Path | None, operator_key: bytes, block_size: int,
                 keep_in_memory: bool = False, *, level: str = "request", engine: str | None = None,
                 clock=time.time, **rotation):
        if level not in LEVELS:
            raise ValueError(f"audit level {level!r} is not valid; choose one of {', '.join(map(repr, LEVELS))}")
        if not isinstance(operator_key, (bytes, bytearray)):
            raise TypeError(f"operator_key must be bytes, got {type(operator_key).__name__}")
        unknown = set(rotation) - set(ROTATION_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown AuditTrail argument(s): {', '.join(sorted(unknown))}; rotation "
                            f"settings are {', '.join(ROTATION_DEFAULTS)}")
        self.path = Path(path) if path is not None else None
        self.level = level
        self.engine = engine or secrets.token_hex(4)
        self.parent: str | None = None
        self._key = bytes(operator_key)
        self.block_size = block_size
        self.events: list[dict] | None = [] if keep_in_memory else None
        self._clock = clock
        self._forks = itertools.count(1)
        self._open: dict[str, _Open] = {}
        self._started = False
        self._writer = open_shared(self.path, clock=clock, **rotation) if self.path is not None else None

    # ------------------------------------------------------------------ identity and keys
    def set_lineage(self, operator_key: bytes, parent: "AuditTrail | None" = None) -> None:
        """Make this trail a fork's: fingerprint with ``operator_key`` (the parent engine's, so
        identical content has one fingerprint in every fork) and, given the parent's trail, take
        the tag ``<parent tag>.<n>``.  Only before the first record."""
        if self._started:
            raise RuntimeError("set_lineage() must be called before the trail writes anything")
        self._key = bytes(operator_key)
        if parent is not None:
            self.parent = parent.engine
            self.engine = f"{parent.engine}.{next(parent._forks)}"

    def fingerprint(self, data: bytes) -> str:
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()[:16]

    def prefix_fingerprints(self, token_ids: list[int]) -> tuple[list[str], str]:
        """Chained keyed fingerprints of each full block-aligned prefix, plus one of the whole prompt."""
        fps, state = [], b""
        n_full = len(token_ids) // self.block_size
        for i in range(n_full):
            block = array("i", token_ids[i * self.block_size:(i + 1) * self.block_size]).tobytes()
            state = hmac.new(self._key, state + block, hashlib.sha256).digest()
            fps.append(state.hex()[:16])
        tail = hmac.new(self._key, b"tail" + array("i", token_ids).tobytes(), hashlib.sha256).hexdigest()[:16]
        return fps, tail

    # ------------------------------------------------------------------ writing
    def record(self, event: str, **fields) -> None:
        """Write one record now, at any level (``t``, ``event``, ``v``, ``engine`` + fields)."""
        if not self._started:
            self._started = True  # first: announce who writes, at which level
            self._write({"t": round(self._clock(), 6), "event": "engine", "v": SCHEMA_VERSION,
                         "engine": self.engine, "parent": self.parent, "level": self.level,
                         "block_size": self.block_size})
        rec = {"t": round(self._clock(), 6), "event": event, "v": SCHEMA_VERSION, "engine": self.engine}
        rec.update(fields)
        self._write(rec)

    def _write(self, rec: dict) -> None:
        if self._writer is not None:
            self._writer.write(json.dumps(rec, separators=(",", ":")) + "\n")
        if self.events is not None:
            self.events.append(rec)

    def _block_records(self, event: str, block_ids, seq, **extra) -> None:
        rid, tenant = (seq.request_id, seq.tenant) if seq is not None else (None, None)
        for bid, fp, more in block_ids:
            self.record(event, request_id=rid, tenant=tenant, block_id=bid, fp=fp, **more, **extra)

    def _tracked(self, seq) -> _Open | None:
        """The open summary of ``seq``, at request level.  Events of sequences that never went
        through ``request()`` (``engine.score``) or of no sequence (an operator's
        ``reset_prefix_cache``) have no summary to fold into and are written per block."""
        if self.level != "request" or seq is None:
            return None
        acc = self._open.get(seq.request_id)
        return acc if acc is not None and acc.seq is seq else None

    # ------------------------------------------------------------------ engine hooks
    def attach(self, engine) -> None:
        """Record what ``engine`` does through its hooks, as KV tiers and sharing plug in: each
        block transition (heard right after the engine's scrub listener, before any plug-in's, so a
        plug-in's nested event is recorded after the one that caused it), each request once queued,
        each as it finishes (before the plug-ins' finish hooks)."""
        scrubber, blocks = engine.scrubber, engine.block_manager.blocks

        def on_block_event(transition, ids, seq) -> None:
            edge = LIFECYCLE[transition]
            if scrub_hook(scrubber, edge.hook) is not None and zeroes(scrubber, edge.hook):
                self.scrub(edge.hook, ids, seq)  # only hooks that zero memory are worth a record
            self.block_event(edge.record, ids, seq, blocks)

        engine.block_manager.listeners.insert(1, on_block_event)  # [0]: the engine's scrub
        engine.request_hooks.append(self.request)
        engine.finish_hooks.insert(0, self.finish)

    def request(self, seq) -> None:
        """A request was queued (``add_request``)."""
        if self.level == "request":
            self._open[seq.request_id] = _Open(seq)
            return
        fps, tail = self.prefix_fingerprints(seq.prompt_token_ids)
        self.record("request", request_id=seq.request_id, tenant=seq.tenant, block_id=None, fp=None,
                    num_prompt_tokens=seq.num_prompt_tokens, prefix_fps=fps, tail_fp=tail)

    def block_event(self, event: str, block_ids: list[int], seq, blocks) -> None:
        """``event`` (the record kind of a lifecycle transition) happened to ``block_ids`` on
        behalf of ``seq`` (None: of no request); ``blocks`` is the block manager's block list.
        For ``evict``, ``seq`` is the request whose allocation needed the room, and
        ``owner_tenant`` is who wrote the evicted block; for ``hit`` and ``adopt`` (the reuses),
        who wrote the reused block."""
        acc = self._tracked(seq)
        rows = []
        for bid in block_ids:
            b = blocks[bid]
            fp = self.fingerprint(b.hash) if b.hash is not None else None
            more = {}
            if event in REUSE_RECORDS:
                more = {"owner_tenant": b.writer_tenant, "public": b.public}
            elif event == "evict":
                more = {"owner_tenant": b.writer_tenant}
            if acc is None:
                rows.append((bid, fp, more))
                continue
            if event in REUSE_RECORDS:
                hit = event == "hit"
                acc.counts["hit" if hit else "adopted"] += 1
                (acc.hit_fps if hit else acc.adopted_fps).append(fp)
                if crosses_tenants((seq.tenant, b.writer_tenant), b.public):
                    acc.cross[b.writer_tenant] += 1
            elif event == "store":
                acc.counts["stored"] += 1
                acc.stored_fps.append(fp)
            elif event == "evict":
                acc.counts["evicted"] += 1
                acc.evicted_owners[b.writer_tenant] += 1
            elif event == "allocate":
                acc.counts["allocated"] += 1
            elif event == "onload":  # a KV-tier hit: the block's "hit" follows, so pool hits = hit - tier_hit
                acc.counts["tier_hit"] += 1
            elif event == "offload":
                acc.counts["offloaded"] += 1
        self._block_records(event, rows, seq)

    def scrub(self, hook: str, block_ids: list[int], seq) -> None:
        """The scrubber zeroed ``block_ids`` (``hook``: ``on_alloc`` or ``on_free``)."""
        acc = self._tracked(seq)
        if acc is not None:
            acc.counts["scrubbed"] += len(block_ids)
        else:
            self._block_records("scrub", [(bid, None, {}) for bid in block_ids], seq, hook=hook)

    def sharing(self, decision: str, *, fps=(), **fields) -> None:
        """A selective-sharing decision (``minikv.sharing``): ``promote``, ``flag`` or
        ``isolate``, at any level, as one ``sharing`` record.  ``fps`` are the engine's content
        fingerprints (hex); the trail writes them re-keyed with the operator key, like every
        fingerprint here.  ``fields``: strategy, tenant, counts, a reason -- never prompt text."""
        self.record("sharing", decision=decision, fps=[self.fingerprint(bytes.fromhex(fp)) for fp in fps],
                    **fields)

    def finish(self, seq) -> None:
        """``seq`` finished or was aborted (its blocks are already released)."""
        if self.level == "request":
            acc = self._open.pop(seq.request_id, None)
            self._summary(acc if acc is not None and acc.seq is seq else _Open(seq))
            return
        self.record("finish", request_id=seq.request_id, tenant=seq.tenant, block_id=None, fp=None,
                    num_cached_tokens=seq.num_cached_tokens or 0, num_prompt_tokens=seq.num_prompt_tokens,
                    num_output_tokens=len(seq.output_token_ids), finish_reason=seq.finish_reason,
                    num_preemptions=seq.num_preemptions)

    def _summary(self, acc: _Open) -> None:
        seq = acc.seq
        fps, tail = self.prefix_fingerprints(seq.prompt_token_ids)
        # Owner tenants as [owner, count] pairs, not a JSON object: the anonymous tenant (None)
        # would become the key "null", indistinguishable from a tenant named "null".
        self.record("summary", request_id=seq.request_id, tenant=seq.tenant,
                    num_prompt_tokens=seq.num_prompt_tokens, num_cached_tokens=seq.num_cached_tokens or 0,
                    num_output_tokens=len(seq.output_token_ids), finish_reason=seq.finish_reason,
                    num_preemptions=seq.num_preemptions, blocks=acc.counts,
                    cross_tenant_hits=[[o, n] for o, n in acc.cross.items()],
                    evicted_owners=[[o, n] for o, n in acc.evicted_owners.items()],
                    hit_fps=acc.hit_fps, adopted_fps=acc.adopted_fps, stored_fps=acc.stored_fps, prefix_fps=fps, tail_fp=tail)

    # ------------------------------------------------------------------ lifecycle
    def flush(self) -> None:
        """Wait for background compression of rotated files (tests, orderly shutdown)."""
        if self._writer is not None:
            self._writer.wait()

    def close(self) -> None:
        """Write the summaries of requests still in flight (``finish_reason`` null), then give
        the file back.  Idempotent."""
        for acc in list(self._open.values()):
            self._summary(acc)
        self._open.clear()
        if self._writer is not None:
            release_shared(self._writer)
            self._writer = None
