"""The operator's audit trail: a JSONL record of every cache decision.

An operator who suspects cross-tenant leakage needs evidence: which request hit which block,
stored by whom, and whether anybody is probing.  The trail records *decisions* (allocate,
hit, store, evict, scrub, free) with the request id, the tenant and the block id, but never
prompt text or token ids.

Blocks are identified by a *keyed fingerprint*: ``HMAC-SHA256(operator_key, block_hash)``.
An unkeyed hash would let anyone who reads the log confirm a guessed prompt by hashing the
guess themselves; the HMAC key stays with the operator.

``request`` events carry ``prefix_fps``, the keyed fingerprints of every block-aligned prefix of
the prompt, computed from content alone (no tenant key), so the detector can see one tenant
enumerating continuations of another tenant's prefix even when isolation hides all hits.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from array import array
from pathlib import Path

BLOCK_EVENTS = {"allocate": "allocate", "hit": "hit", "store": "store", "evict": "evict",
                "free": "free"}


class AuditTrail:
    def __init__(self, path: str | Path | None, operator_key: bytes, block_size: int, keep_in_memory: bool = False):
        self.path = Path(path) if path is not None else None
        self._key = operator_key
        self.block_size = block_size
        self.events: list[dict] | None = [] if keep_in_memory else None
        self._lock = threading.Lock()
        self._file = open(self.path, "a", encoding="utf-8") if self.path is not None else None

    def fingerprint(self, data: bytes) -> str:
        return hmac.new(self._key, data, hashlib.sha256).hexdigest()[:16]

    def record(self, event: str, **fields) -> None:
        rec = {"t": round(time.time(), 6), "event": event}
        rec.update(fields)
        with self._lock:
            if self._file is not None:
                self._file.write(json.dumps(rec, separators=(",", ":")) + "\n")
                self._file.flush()
            if self.events is not None:
                self.events.append(rec)

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

    def request(self, seq) -> None:
        fps, tail = self.prefix_fingerprints(seq.prompt_token_ids)
        self.record("request", request_id=seq.request_id, tenant=seq.tenant, block_id=None, fp=None,
                    num_prompt_tokens=seq.num_prompt_tokens, prefix_fps=fps, tail_fp=tail)

    def finish(self, seq) -> None:
        self.record("finish", request_id=seq.request_id, tenant=seq.tenant, block_id=None, fp=None,
                    num_cached_tokens=seq.num_cached_tokens or 0, num_prompt_tokens=seq.num_prompt_tokens,
                    num_output_tokens=len(seq.output_token_ids), finish_reason=seq.finish_reason,
                    num_preemptions=seq.num_preemptions)

    def block_event(self, event: str, block_ids: list[int], seq, blocks) -> None:
        """One record per block; ``blocks`` is the block manager's block list."""
        for bid in block_ids:
            b = blocks[bid]
            extra = {}
            if event == "hit":
                extra = {"owner_tenant": b.writer_tenant, "public": b.public}
            self.record(BLOCK_EVENTS.get(event, event), request_id=seq.request_id if seq else None,
                        tenant=seq.tenant if seq else None, block_id=bid,
                        fp=self.fingerprint(b.hash) if b.hash is not None else None, **extra)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_trail(path: str | Path) -> list[dict]:
    """Load a trail (one dict per event); see ``minikv.audit.detector.load_trail``."""
    from .detector import load_trail
    return load_trail(path)
