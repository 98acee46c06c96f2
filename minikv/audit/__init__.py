"""Auditing prompt-cache isolation, from outside (timing) and from inside (the operator trail).

* ``stats``    -- the reference test: one-sided KS at alpha = 1e-8 + ROC AUC (Gu et al., ICML 2025)
* ``gu``       -- recomputes Gu et al.'s published verdicts from their raw timings
* ``timing``   -- runs their protocol against any OpenAI-compatible endpoint
* ``detector`` -- flags cross-tenant hits, prompt probing and eviction pressure in the JSONL trail
* ``trail``, ``rotation`` -- the trail itself (levels, schema v2) and its rotation
* ``cli``      -- the ``minikv audit ...`` subcommands

Names are resolved lazily: the engine imports ``minikv.audit.trail`` on its hot path, and that
must not drag in scipy, httpx or matplotlib through this package's ``__init__``.
"""
from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "GU_ALPHA": "stats", "AuditResult": "stats", "audit_samples": "stats", "ks_test": "stats",
    "roc_auc": "stats", "min_samples_for": "stats",
    "gu_verdicts": "gu", "gu_table": "gu", "load_gu_runs": "gu", "find_gu_zip": "gu",
    "run_timing_audit": "timing", "TimingReport": "timing", "TimingPlan": "timing",
    "TimingAuditError": "timing_client",
    "Finding": "detector", "detect": "detector", "load_trail": "detector", "load_trails": "detector",
    "add_audit_parser": "cli",
}

__all__ = sorted(_EXPORTS)


__getattr__ = lazy_exports(__name__, _EXPORTS, globals())
