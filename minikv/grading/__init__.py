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
from .hashing import check_chained_hash, check_encode_fields
from .isolation import check_audit_verdict, check_isolation_audit
from .key_layout import check_key_layout
from .scrub_budget import check_scrub_budget
from .scrubbing import check_scrub_placement, check_zero_blocks
from .stats import check_ks_test, check_roc_auc
from .tenant_keys import check_block_keys, check_tenant_key_derivation, check_tenant_keyed_hasher
from .written_mutants import check_written_mutants

__all__ = [
    "check_encode_fields", "check_chained_hash", "check_tenant_key_derivation", "check_tenant_keyed_hasher",
    "check_block_keys", "check_key_layout", "check_zero_blocks", "check_scrub_placement", "check_written_mutants",
    "check_scrub_budget",
    "check_audit_verdict", "check_isolation_audit", "check_ks_test", "check_roc_auc",
]
