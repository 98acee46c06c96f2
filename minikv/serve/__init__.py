"""``minikv serve``: an OpenAI-compatible HTTP server around one engine.

* ``app``     -- FastAPI app: endpoints, API-key -> tenant resolution, errors (``create_app``),
                 and ``BackgroundServer`` (uvicorn in a thread on 127.0.0.1, for tests/notebooks)
* ``auth``    -- API keys -> tenant, the strict keys-file loader (``ApiKeys``, ``load_api_keys``)
* ``limits``  -- per-tenant limits: rate, concurrency, queue, decode budget (``ServeLimits``)
* ``routes``  -- the two generation routes and the admission before them (``add_openai_routes``),
                 shared with ``minikv gateway``
* ``tokenize`` -- prompt tokenization on a worker thread, control-token checks for chat
* ``runner``  -- the engine loop thread and the asyncio bridge (``EngineRunner``)
* ``metrics`` -- Prometheus metrics in a per-app registry (``ServerMetrics``)
* ``cli``     -- ``minikv serve`` flags, shared engine/policy flags (``add_serve_parser``, ``app_from_args``)

Names are resolved lazily so that ``minikv.serve.cli`` (argparse only) imports without FastAPI
or torch.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "create_app": "app", "create_metrics_app": "app", "BackgroundServer": "background",
    "ApiKeys": "auth", "load_api_keys": "auth", "ServeLimits": "limits", "APIError": "protocol",
    "EngineRunner": "runner", "RequestFailed": "errors", "RequestRejected": "errors",
    "EngineUnavailable": "errors", "ServerMetrics": "metrics", "add_serve_parser": "cli",
    "add_engine_arguments": "cli", "engine_kwargs_from_args": "cli",
}
__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
