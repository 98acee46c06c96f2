"""A lab of in-process servers for a lesson: start, address, and always stop them.

Lesson 09 audits two servers that differ in one setting (``cache_isolation="shared"`` and
``"tenant"``).  Each is the real OpenAI-compatible app (:func:`minikv.serve.create_app`) served by
uvicorn in a background thread on 127.0.0.1, on a free port that is never printed, writing the
operator's JSONL audit trail into a working folder.  A notebook cell that fails must not leave a
server running, so every cell that talks to the servers runs inside ``with lab.guard():``, which
stops them all on any exception (including a keyboard interrupt) and re-raises it.

    lab = ServerLab(model, keys, workdir, operator_keys={"op-key": "operator"})
    with lab.guard():
        lab.start("shared", cache_isolation="shared")
        httpx.post(lab.url("shared") + "/chat/completions", ...)
    lab.stop()
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from minikv.llm import LLM
from minikv.serve.app import create_app
from minikv.serve.background import BackgroundServer


class ServerLab:
    """Named in-process servers with their engines and audit trails (``trails[name]``)."""

    def __init__(self, model: str, api_keys: Mapping[str, str], workdir: str | Path,
                 operator_keys: Mapping[str, str] | None = None, **engine_defaults):
        self.model, self.api_keys, self.workdir = model, dict(api_keys), Path(workdir)
        self.operator_keys = dict(operator_keys or {})
        self.engine_defaults = engine_defaults
        self.servers: dict[str, BackgroundServer] = {}
        self.llms: dict[str, LLM] = {}
        self.trails: dict[str, Path] = {}

    def start(self, name: str, **settings) -> BackgroundServer:
        """Build an engine with ``engine_defaults | settings``, an audit trail at
        ``workdir/trail-<name>.jsonl`` (one line per cache decision), and serve it."""
        if name in self.servers:
            raise ValueError(f"a server named {name!r} is already running")
        trail = self.workdir / f"trail-{name}.jsonl"
        llm = LLM(self.model, audit_log=str(trail), audit_level="block", **{**self.engine_defaults, **settings})
        app = create_app(llm, self.api_keys, model_name=self.model, report_cached_tokens=True,
                         operator_keys=self.operator_keys or None)
        self.servers[name] = BackgroundServer(app).start()   # 127.0.0.1, a free port, its own thread
        self.llms[name], self.trails[name] = llm, trail
        return self.servers[name]

    def url(self, name: str) -> str:
        """The server's OpenAI base URL (``.../v1``)."""
        if name not in self.servers:
            raise KeyError(f"no running server named {name!r} (running: {sorted(self.servers)})")
        return self.servers[name].base_url

    def stop(self) -> None:
        """Stop every server and close its audit trail (safe to call twice)."""
        for server in self.servers.values():
            server.stop()
        for llm in self.llms.values():
            if llm.engine.audit is not None:
                llm.engine.audit.close()
        self.servers.clear()

    @contextmanager
    def guard(self) -> Iterator[ServerLab]:
        """Run a block; on any exception stop all servers, then re-raise."""
        try:
            yield self
        except BaseException:
            self.stop()
            raise
