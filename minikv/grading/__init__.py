"""Graders for the minikv course exercises (lessons 07 and 08), in the ARENA style.

Every ``check_*`` function takes the learner's implementation, runs it -- inside a real
minikv engine where the exercise plugs into one of the engine's seams -- and prints one line:
``✅ check_x passed: ...`` or ``❌ check_x failed: ...`` followed by a hint.  It returns
``True``/``False`` and never raises, so lesson cells can call it freely; ``quiet=True``
suppresses the printing.

``minikv.grading.runner.EXERCISES`` lists the graders, one per exercise id (1a ... 5b), with
what each checks; ``make grade`` prints that table.

One module per exercise: ``hashing`` (1, and the engine run that every hashing grader ends
with), ``tenant_keys`` (2a-2c), ``key_layout`` (2d, an open design scored by its hit rate),
``scrubbing`` (3a, 3b), ``written_mutants`` (3c, write the mutant) and ``scrub_budget`` (3d, an open
design scored by its cost), ``isolation`` (4), ``stats`` (5);
``engines`` builds the small real engines they run.  ``minikv.grading.mutants`` holds realistic wrong
implementations of each exercise, one module per exercise (the tests prove every grader rejects them);
``minikv.grading.make_exercises`` generates ``exercises/`` from ``solutions/``;
``minikv.grading.runner`` is ``make grade``.
"""
# Lazy (PEP 562): a learner's file, a mutant or a sealed child that imports one light grading module
# (an oracle client, a guesser) must not pay for torch, scipy and the engine that the graders below
# import -- a fresh interpreter per graded call would pay seconds for them each time.
from .._lazy import lazy_exports

_EXPORTS = {
    "check_encode_fields": "hashing", "check_chained_hash": "hashing",
    "check_audit_verdict": "isolation", "check_isolation_audit": "isolation",
    "check_key_layout": "key_layout",
    "check_scrub_budget": "scrub_budget",
    "check_zero_blocks": "scrubbing", "check_scrub_placement": "scrubbing",
    "check_ks_test": "stats", "check_roc_auc": "stats",
    "check_block_keys": "tenant_keys", "check_tenant_key_derivation": "tenant_keys",
    "check_tenant_keyed_hasher": "tenant_keys",
    "check_written_mutants": "written_mutants",
}
__getattr__ = lazy_exports(__name__, _EXPORTS, globals())

__all__ = list(_EXPORTS)
