"""A blocking tier called off the engine's step thread, with a deadline.

A remote store's calls are network round trips; one the store does not answer (a stalled or
SIGSTOPped Redis) blocks until the socket times out, seconds later.  Called from the step, that
wait stalls every tenant's tokens, not only the tenant whose prefix is being looked up.  So each
call runs on a worker thread of its own, and the step waits for its answer at most ``deadline``
seconds:

* in time: the answer, as if called directly (a healthy store behaves exactly as before);
* late: a miss (``get``: the block is recomputed) or a write not made (``put``: the block stays in
  the pool, uncached below it); the call finishes on the worker whenever the store answers;
* while an earlier call is still stuck on the worker, a new call is not even queued: a miss at
  once.  A stalled store thus costs one step at most one ``deadline``, however many blocks the
  step looks up, and the step never queues work behind a dead socket.

The tier is wrapped, not changed: its ``stats`` gain ``late`` and ``skipped`` counts, and every
other attribute is the tier's own.
"""
from __future__ import annotations

import logging
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FuturesTimeout

log = logging.getLogger("minikv.tiers")


class OffThread:
    def __init__(self, tier, deadline: float):
        self.tier, self.deadline = tier, deadline
        self.name, self.when = tier.name, tier.when
        self.stats = tier.stats
        for counter in ("late", "skipped", "errors"):
            self.stats.setdefault(counter, 0)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix=f"minikv-tier-{tier.name}")
        self._last: Future | None = None
        weakref.finalize(self, self._worker.shutdown, wait=False)  # no idle thread outlives the link

    def __getattr__(self, name):  # the tier's own attributes (client, url, used, ...)
        if name == "tier":  # not set yet (or gone): no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.tier, name)

    def busy(self) -> bool:
        """Is an earlier call still running on the worker (the store has not answered it)?"""
        return self._last is not None and not self._last.done()

    def _call(self, method: str, *args, miss):
        if self.busy():
            self.stats["skipped"] += 1
            return miss
        self._last = call = self._worker.submit(getattr(self.tier, method), *args)
        try:
            return call.result(timeout=self.deadline)
        except FuturesTimeout:
            self.stats["late"] += 1
            if self.stats["late"] <= 3 or self.stats["late"] % 1000 == 0:
                log.warning("kv tier %s: %s took over %.0f ms; treated as a miss", self.name, method,
                            self.deadline * 1000)
        except Exception as exc:  # a tier that raises is a miss too: it is a cache, never required
            self.stats["errors"] += 1
            log.warning("kv tier %s: %s failed (%s); treated as a miss", self.name, method, type(exc).__name__)
        return miss

    def get(self, key: bytes) -> bytes | None:
        return self._call("get", key, miss=None)

    def put(self, key: bytes, value: bytes, tenant_tag: str) -> bool:
        return bool(self._call("put", key, value, tenant_tag, miss=False))

    def evict(self, key: bytes) -> None:
        self._call("evict", key, miss=None)

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the call on the worker, if any, to finish (tests; an orderly shutdown)."""
        if self._last is not None:
            try:
                self._last.result(timeout=timeout)
            except Exception:
                pass
