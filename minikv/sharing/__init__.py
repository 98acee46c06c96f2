"""Selective sharing (``cache_isolation="selective"``), plugged into an engine through its hooks.

The strategies (``strategies.py``) decide which blocks leave their tenant's domain.  The engine
never imports them: ``minikv.LLM`` hands it :func:`attach_sharing` among its ``attach`` plug-ins,
which builds the strategy the config names and hooks it in -- a block-lifecycle listener, and
the engine's ``admit_hooks`` (a new request's domains) and ``finish_hooks`` (a finished request,
for the monitor).
"""
from __future__ import annotations

from .strategies import STRATEGIES, Flag, ReuseMonitor, make_sharing

__all__ = ["STRATEGIES", "Flag", "ReuseMonitor", "attach_sharing", "make_sharing"]


def attach_sharing(engine) -> None:
    """Plug the strategy of ``engine.config`` into ``engine`` (``engine.sharing``; None, and
    nothing hooked, unless ``cache_isolation="selective"`` with prefix caching on)."""

    def decide(kind: str, **fields) -> None:  # one "sharing" record in the operator's trail
        if engine.audit:
            engine.audit.sharing(kind, **fields)

    c = engine.config
    # The content key is derived from the engine's secret here, in the composition, and kept
    # inside the strategy object: it never leaves the server.
    engine.sharing = sharing = make_sharing(c, engine.block_manager, engine._secret, engine.tenant_key, decide)
    if sharing is None:
        return
    sharing.sensitive = [engine.encode_prompt(p)[0] for p in c.sensitive_prefixes]
    engine.block_manager.listeners.append(sharing.on_block_event)
    engine.admit_hooks.append(sharing.admit)
    engine.finish_hooks.append(sharing.finish)
