"""The bridge between asyncio HTTP handlers and the (synchronous, single-threaded) engine.

One thread -- the *engine loop* -- owns the :class:`~minikv.engine.engine.LLMEngine`: it is the
only thread that ever calls ``add_request``, ``step``, ``abort_request`` or touches the
tokenizer.  Handlers never call the engine; they put commands on a locked list and get results
back on a per-request :class:`asyncio.Queue`, which the engine thread feeds with
``loop.call_soon_threadsafe``.  So:

* requests that arrive while others are decoding are added between two steps and join the same
  continuous batch (one forward pass serves all of them);
* the event loop never blocks on a forward pass, so ``/health`` and new connections stay
  responsive while the engine computes;
* an abort (client disconnect) is just another command, applied between two steps.

Validation errors of ``add_request`` (ValueError/TypeError, raised before anything is
allocated) come back to the handler as :class:`RequestRejected`, which the app maps to HTTP 400.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import EngineUnavailable, RequestFailed, RequestRejected
from .metrics import ServerMetrics
from .streaming import RequestStream

log = logging.getLogger("minikv.serve")


@dataclass
class _Sink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tenant: str | None
    first_token_seen: bool = False
    last: Any = None
    submitted: float = field(default_factory=time.perf_counter)

    def put(self, kind: str, item: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, item))
        except RuntimeError:  # the handler's event loop is closed: nobody is listening
            pass


# Which runner drives which engine.  An engine is single-threaded: two runners on one engine (two
# apps built on one LLM, both serving) would both call ``step()`` whenever either has work -- each
# loop wakes on ``has_unfinished_requests()`` -- racing on the block tables and handing outputs to
# a runner that has no sink for them.  So a second live runner is refused at start.
_DRIVERS: "weakref.WeakKeyDictionary[Any, EngineRunner]" = weakref.WeakKeyDictionary()
_DRIVERS_LOCK = threading.Lock()


class EngineRunner:
    """Runs ``engine`` in a background thread; see the module docstring."""

    def __init__(self, engine, metrics: ServerMetrics | None = None, idle_poll_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self._idle_poll_s = idle_poll_s
        self._cond = threading.Condition()
        self._pending: list[tuple] = []
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.healthy = True
        # Observations for tests and /metrics (written by the engine thread only).
        self.max_batch_size = 0
        self.num_steps = 0
        self.num_aborted = 0
        self.num_finished = 0

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> "EngineRunner":
        """Start the engine thread.  Raises RuntimeError when another runner is already driving
        this engine (see ``_DRIVERS``): build one LLM per server."""
        with _DRIVERS_LOCK:
            other = _DRIVERS.get(self.engine)
            if other is not None and other is not self and other.alive:
                raise RuntimeError(f"this engine is already served by another EngineRunner ({other!r}): an "
                                   "engine is stepped by one thread only; build one LLM per server")
            _DRIVERS[self.engine] = self
        with self._cond:
            if self._thread is None:
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name="minikv-engine", daemon=True)
                self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._cond:
            self._thread = None
        with _DRIVERS_LOCK:
            if _DRIVERS.get(self.engine) is self:
                del _DRIVERS[self.engine]

    @property
    def alive(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive() and not self._stopping

    def _push(self, cmd: tuple) -> None:
        with self._cond:
            if self._stopping or self._thread is None:
                raise EngineUnavailable("the engine is not running")
            self._pending.append(cmd)
            self._cond.notify_all()

    # ------------------------------------------------------------------ handler side (any thread)
    def submit(self, request_id: str, prompt, params, tenant: str | None = None) -> asyncio.Queue:
        """Queue a request; returns the asyncio queue its outputs arrive on (call from a loop)."""
        sink = _Sink(asyncio.get_running_loop(), asyncio.Queue(), tenant)
        self._push(("add", request_id, prompt, params, tenant, sink))
        return sink.queue

    def abort(self, request_id: str) -> None:
        """Abort a request if it is still running (no-op otherwise); never raises."""
        try:
            self._push(("abort", request_id))
        except EngineUnavailable:
            pass

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run ``fn(engine)`` on the engine thread between two steps (safe inspection)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._push(("call", fn, fut))
        return fut

    async def open(self, request_id: str, prompt, params, tenant: str | None = None) -> "RequestStream":
        """Submit a request and wait until the engine accepted it.

        Raises :class:`RequestRejected` (bad input) or :class:`EngineUnavailable`.  The returned
        :class:`RequestStream` yields the request's ``RequestOutput`` s; closing it before the
        last one (``await stream.aclose()``) aborts the request.
        """
        queue = self.submit(request_id, prompt, params, tenant)
        try:
            kind, item = await queue.get()
        except BaseException:  # cancelled while waiting (client gone): do not leak the request
            self.abort(request_id)
            raise
        if kind == "error":
            raise item
        if kind == "aborted":
            raise EngineUnavailable("the request was aborted")
        return RequestStream(self, request_id, queue)

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._cond:
                while not self._pending and not self._stopping and not eng.has_unfinished_requests():
                    self._cond.wait(self._idle_poll_s)
                cmds, self._pending = self._pending, []
                stopping = self._stopping
            for cmd in cmds:
                self._apply(cmd)
            if stopping:
                self._shutdown()
                return
            if eng.has_unfinished_requests():
                self._step()

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, prompt, params, tenant, sink = cmd
            try:
                self.engine.add_request(rid, prompt, params, tenant=tenant)
            except (ValueError, TypeError) as exc:
                err = RequestRejected(str(exc))
                err.__cause__ = exc
                sink.put("error", err)
                return
            except Exception as exc:  # noqa: BLE001 -- never let one request kill the loop
                log.error("engine rejected request %s: %s", rid, type(exc).__name__)
                sink.put("error", EngineUnavailable(f"engine error: {type(exc).__name__}"))
                return
            self._sinks[rid] = sink
            sink.put("accepted", None)
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "call":
            _, fn, fut = cmd
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn(self.engine))
                except BaseException as exc:  # noqa: BLE001 -- handed to the caller
                    fut.set_exception(exc)

    def _abort(self, rid: str) -> None:
        sink = self._sinks.pop(rid, None)
        seq = self.engine.requests.get(rid)
        if seq is None:
            return  # already finished (or never admitted)
        self.engine.abort_request(rid)
        self.num_aborted += 1
        if self.metrics:
            self.metrics.observe_finish(seq.num_prompt_tokens, seq.num_cached_tokens or 0,
                                        len(seq.output_token_ids), "abort", None, seq.tenant)
        log.info("request %s aborted (tenant=%s, prompt_tokens=%d, output_tokens=%d)", rid,
                 seq.tenant, seq.num_prompt_tokens, len(seq.output_token_ids))
        if sink is not None:
            sink.put("aborted", None)

    def _step(self) -> None:
        eng = self.engine
        try:
            outs = eng.step()
        except Exception as exc:  # noqa: BLE001 -- fail the requests, keep serving health checks
            # The engine isolates a failing sequence itself (finish reason "error"); reaching
            # here means the step failed as a whole.  Fail what was in flight, report
            # unhealthy, and recover on the next step that succeeds.
            self.healthy = False
            log.error("engine step failed: %s; failing %d request(s)", type(exc).__name__, len(self._sinks))
            self._fail_all(f"engine error: {type(exc).__name__}")
            return
        self.healthy = True
        self.num_steps += 1
        self.max_batch_size = max(self.max_batch_size, len(outs))
        if self.metrics:
            self.metrics.set_queue(len(eng.scheduler.running), len(eng.scheduler.waiting))
            self.metrics.batch_size.set(self.max_batch_size)
        for out in outs:
            sink = self._sinks.get(out.request_id)
            if sink is None:
                continue
            if not sink.first_token_seen and out.outputs[0].token_ids:
                sink.first_token_seen = True
                if self.metrics:
                    self.metrics.observe_first_token(out.metrics.ttft_s)
            if out.finished:
                del self._sinks[out.request_id]
                self.num_finished += 1
                comp = out.outputs[0]
                if self.metrics:
                    self.metrics.observe_finish(len(out.prompt_token_ids), out.num_cached_tokens,
                                                len(comp.token_ids), comp.finish_reason, out.metrics.e2e_s,
                                                out.tenant)
                # Operator log: ids, tenant and counts only -- never prompt or output text.
                log.info("request %s finished (tenant=%s, prompt_tokens=%d, cached_tokens=%d, "
                         "output_tokens=%d, reason=%s)", out.request_id, out.tenant,
                         len(out.prompt_token_ids), out.num_cached_tokens, len(comp.token_ids),
                         comp.finish_reason)
                if comp.finish_reason == "error":
                    sink.put("error", RequestFailed(_error_text(out)))
                    continue
            sink.put("output", out)

    def _fail_all(self, message: str) -> None:
        """Answer every in-flight request with :class:`EngineUnavailable` and free its blocks."""
        for rid in list(self._sinks):
            sink = self._sinks.pop(rid)
            if rid in self.engine.requests:
                try:
                    self.engine.abort_request(rid)
                except Exception:  # noqa: BLE001 -- the engine is already failing; keep going
                    pass
            sink.put("error", EngineUnavailable(message))

    def _shutdown(self) -> None:
        self._fail_all("the server is shutting down")
        with self._cond:
            pending, self._pending = self._pending, []
        for cmd in pending:
            if cmd[0] == "add":
                cmd[-1].put("error", EngineUnavailable("the server is shutting down"))
            elif cmd[0] == "call":
                cmd[2].cancel()


def _error_text(out) -> str:
    """The engine's message for a failed request (on the output or its completion)."""
    return (getattr(out, "error", None) or getattr(out.outputs[0], "error", None)
            or "the engine failed this request")
