"""The server's internal outcomes of a request, which the app turns into HTTP statuses."""
from __future__ import annotations


class RequestRejected(Exception):
    """The engine refused a request (bad input): HTTP 400.  ``__cause__`` is the engine's error."""


class EngineUnavailable(Exception):
    """The engine is shutting down or failed: HTTP 503."""


class RequestFailed(Exception):
    """The engine failed *this* request (finish reason ``"error"``) and kept serving the others:
    HTTP 500 for this request only."""
