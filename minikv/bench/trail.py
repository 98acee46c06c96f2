"""The ``trail`` section: bytes of audit trail per request at each ``audit_level``.

Measured by :func:`minikv.audit.trail_size.trail_bytes_per_request` on its fixed workload, on
tiny-random whatever ``--model`` says: the trail's size depends on blocks and requests, not on
weights.  An operator keeps a trail on only if it can afford the disk.
"""
from __future__ import annotations

WORKLOAD = "200 requests, 4 tenants, prefix caching on, 128 blocks"


def bench_trail() -> dict:
    """Audit-trail bytes per request at each ``audit_level`` (tiny-random, :data:`WORKLOAD`: a
    pool that fills and evicts)."""
    from ..audit.trail_size import trail_bytes_per_request

    return {"bytes_per_request": trail_bytes_per_request(), "model": "tiny-random",
            "workload": f"minikv.audit.trail_size: {WORKLOAD}"}


def format_trail(report: dict) -> list[str]:
    lines = ["  audit trail, bytes per request (tiny-random, 200 requests, 4 tenants, prefix caching on):"]
    for level, size in report["bytes_per_request"].items():
        lines.append(f"    audit_level={level:<8} {size:9,.0f} bytes/request")
    return lines
