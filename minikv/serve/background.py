"""Serve an app from a thread of this process: for tests, notebooks and in-process audits.

A real deployment runs ``minikv serve`` (uvicorn in the foreground).  Tests and notebooks need
the same server *next to* the code that talks to it, so that a cell can start a server, attack
or audit it over real HTTP, and stop it again.  Three details make that reliable:

* the listening socket is bound *before* the thread starts, on port 0, so the kernel picks a
  free port and there is no window in which another process can take it;
* it binds to loopback (127.0.0.1) by default: a course server with well-known demo keys
  must not be reachable from the network;
* uvicorn's logging config is left alone, so nothing it logs lands in a notebook's output.
"""
from __future__ import annotations

import logging
import socket
import threading
import time


class BackgroundServer:
    """uvicorn serving ``app`` from a thread of this process, on loopback and a free port.

    The listening socket is bound before the thread starts (no port race), uvicorn's logging
    config is left alone (no handlers added: nothing reaches a notebook's stderr) and ``stop()``
    shuts down gracefully (the app's lifespan stops the engine thread)::

        with BackgroundServer(app) as srv:
            httpx.get(srv.base_url + "/models", headers=...)
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning",
                 access_log: bool = False):
        self.app, self.host, self.port = app, host, port
        self.log_level, self.access_log = log_level, access_log
        self._server = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        import uvicorn

        if self._thread is not None:
            return self
        # IPPROTO_TCP named, not left 0: asyncio sets TCP_NODELAY only on sockets whose proto says TCP,
        # and accepted connections inherit it.  With proto 0, Nagle's algorithm held each response's
        # body behind the client's delayed ACK of its headers: every keep-alive request took ~45 ms
        # on loopback (0.4 ms with it), and a lab attack of 738 requests spent 35 s waiting on it.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        self._sock = sock
        config = uvicorn.Config(self.app, log_config=None, log_level=self.log_level,
                                access_log=self.access_log, lifespan="on", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=_run_quietly, args=(self._server, sock),
                                        name="minikv-uvicorn", daemon=True)
        errors = _ErrorRecorder()  # why start-up failed, when it does (uvicorn only logs it)
        logging.getLogger("uvicorn.error").addHandler(errors)
        try:
            self._thread.start()
            deadline = time.monotonic() + timeout
            while not self._server.started:
                alive = self._thread.is_alive()
                if not alive or time.monotonic() > deadline:
                    self.stop()
                    why = errors.reason() or ("" if not alive else f"not started within {timeout:g} s")
                    raise RuntimeError("the server did not start" + (f": {why}" if why else ""))
                time.sleep(0.01)
        finally:
            logging.getLogger("uvicorn.error").removeHandler(errors)
        return self

    def signal_stop(self) -> None:
        """Ask uvicorn to shut down, without waiting for it (see :func:`stop_all`)."""
        if self._server is not None:
            self._server.should_exit = True

    def stop(self, timeout: float = 30.0) -> None:
        self.signal_stop()
        if self._thread is not None:
            self._thread.join(timeout)
        if self._sock is not None:
            self._sock.close()
        self._thread = self._server = self._sock = None

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def stop_all(servers: list[BackgroundServer], timeout: float = 30.0) -> None:
    """Stop several servers at once: every one is told to shut down before any is waited for, so
    the shutdowns (each a graceful close of its connections and its engine thread) overlap, and
    stopping a fleet takes as long as its slowest node rather than the sum of them all."""
    for s in servers:
        s.signal_stop()
    for s in servers:
        s.stop(timeout)


def _run_quietly(server, sock: socket.socket) -> None:
    """``server.run`` in the server thread.  When start-up fails (the app's lifespan refused, say),
    uvicorn calls ``sys.exit(3)``: written for a process of its own, in a thread that only ends the
    thread, with an "unhandled exception in thread" report on the way.  ``start()`` already turns
    the failure into a ``RuntimeError`` carrying the reason, so the exit is taken as the thread's end."""
    try:
        server.run(sockets=[sock])
    except SystemExit:
        pass


class _ErrorRecorder(logging.Handler):
    """Keeps the errors uvicorn logs while a server starts, so that a failed start can say why
    (the app's lifespan raising, say) in the exception rather than only in a log nobody reads."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def reason(self) -> str:
        """The first exception logged, as ``Type: message``.  uvicorn logs it either with
        ``exc_info`` or, for a lifespan that raised, as the traceback text starlette sends it;
        of a traceback only its last line (the exception) is kept."""
        for r in self.records:
            if r.exc_info and r.exc_info[1] is not None:
                return f"{type(r.exc_info[1]).__name__}: {r.exc_info[1]}"
            text = r.getMessage().strip()
            if text.startswith("Traceback"):
                return text.splitlines()[-1].strip()
        return self.records[0].getMessage().strip() if self.records else ""
