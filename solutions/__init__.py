"""Reference solutions of the minikv course exercises (lessons 07 and 08).

This package is the single source of the exercises: every solution carries
``# BEGIN SOLUTION`` / ``# END SOLUTION`` markers, and ``exercises/`` is generated from it
by ``python -m minikv.grading.make_exercises`` (the markers' contents become
``raise NotImplementedError``).  ``tests/test_grading.py`` checks that the two are in sync,
that every grader passes on these solutions, and that it fails on the stubs and on
realistic wrong implementations (``minikv.grading.mutants``).

=========================  ===========================================================  ======
module                     what you implement                                           lesson
=========================  ===========================================================  ======
``ex1_chained_hash``       1a typed, length-prefixed ``encode_fields``;                 07
                           1b chained, domain-separated ``chained_block_hash``
``ex2_tenant_keys``        2a ``derive_tenant_key`` (HMAC of the engine secret);        07
                           2b ``TenantKeyedHasher``; 2c ``block_keys`` (key plumbing)
``ex3_scrubbing``          3a ``zero_blocks``; 3b the ``ScrubOnAlloc`` scrubber         08
``ex4_isolation_audit``    4 a concurrent, two-directional ``isolation_audit``          08
``ex5_timing_stats``       5a one-sided ``ks_test``; 5b ``roc_auc``                     07
=========================  ===========================================================  ======

Grade with ``make grade`` (your ``exercises/``) or ``python -m solutions.grade`` (these).
"""
