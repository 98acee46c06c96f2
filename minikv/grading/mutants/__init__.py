"""Realistic wrong implementations of every exercise: each grader must reject all of them.

Every mutant is a mistake someone has made (or easily would): ``tests/test_grading.py`` proves
that each grader fails on each of its mutants, and lessons 07/08 run a few of them through the
graders to show what the checks catch.  ``MUTANTS[exercise_id]`` lists ``(name, implementation,
what is wrong)``.

One module per exercise, so a mutant sits next to the others that miss the same idea:

==================  ======  ====================================================
module              ex      the idea each mutant misses
==================  ======  ====================================================
``hashing``         1a-1b   an injective encoding; a chained, tenant-aware key
``tenant_keys``     2a-2c   a secret-derived tenant key, in every private block
``key_layout``      2d      one key per scope: public, tenant, user (stricter wins)
``scrubbing``       3a-3c   zero exactly the recycled blocks, all of K and V
``scrub_budget``    3d      zero what a handover needs, then, and nothing else
``audit``           4a-4b   an audit that can fail: both directions, batched
``stats``           5a-5b   a one-sided test, "faster => hit", ties worth 1/2
==================  ======  ====================================================

Every implementation is re-exported here, so ``mutants.KeyedFirstBlockOnly`` (as the lessons
write it) keeps working.
"""
from __future__ import annotations

from . import audit, hashing, key_layout, scrub_budget, scrubbing, stats, tenant_keys
from .audit import (audit_everything_cross, audit_no_copy, audit_one_direction, audit_sequential,
                    verdict_one_direction, verdict_wrong_order)
from .key_layout import (layout_joined_names, layout_orphan_user, layout_straddle_looser,
                         layout_tenant_part_per_user, layout_user_not_bound, layout_user_part_tenant_key)
from .hashing import (encode_json_like, encode_no_length, encode_untyped, hash_ignores_tenant,
                      hash_packed_no_boundaries, hash_unchained, hash_untyped_concat)
from .scrub_budget import (BudgetCachedOnly, BudgetEagerOnFree, BudgetEveryAlloc, BudgetMarkOnRelease,
                           BudgetWipeOnCache, BudgetZeroEachEviction)
from .scrubbing import (place_finished_only, place_keep_evicted, place_needs_a_request, place_on_release,
                        place_skip_aborted, place_wipe_hits, zero_k_only, zero_layer0_only, zero_on_a_copy,
                        zero_out_of_place, zero_wrong_dim)
from .stats import auc_flipped, auc_ignores_ties, ks_two_sided, ks_wrong_alternative
from .tenant_keys import (KeyedFirstBlockOnly, KeyedSaltNeverUsed, KeyedTruncated, derive_concat,
                          derive_no_secret_check, derive_none_is_empty, derive_unkeyed, keys_salt_last_block_only,
                          keys_salt_never_passed, keys_straddling_block_public, keys_unchained)

#: exercise id -> [(name, implementation, what is wrong)], in exercise order.
MUTANTS: dict[str, list[tuple[str, object, str]]] = {
    **hashing.MUTANTS, **tenant_keys.MUTANTS, **key_layout.MUTANTS, **scrubbing.MUTANTS, **scrub_budget.MUTANTS, **audit.MUTANTS, **stats.MUTANTS,
}

#: (exercise id, mutant name) -> words the grader's verdict must contain: the bug class it names
DIAGNOSES: dict[tuple[str, str], str] = {
    **hashing.DIAGNOSES, **tenant_keys.DIAGNOSES, **key_layout.DIAGNOSES, **scrubbing.DIAGNOSES, **scrub_budget.DIAGNOSES, **audit.DIAGNOSES, **stats.DIAGNOSES,
}

#: exercise id -> correct implementations that differ only in method: graders must ACCEPT them
NEGATIVE_CONTROLS = {**stats.NEGATIVE_CONTROLS, **scrub_budget.NEGATIVE_CONTROLS}

__all__ = [
    "MUTANTS", "DIAGNOSES", "NEGATIVE_CONTROLS",
    "zero_on_a_copy", "place_wipe_hits", "place_on_release", "place_keep_evicted", "place_finished_only",
    "place_skip_aborted", "place_needs_a_request",
    "encode_untyped", "encode_no_length", "encode_json_like",
    "hash_untyped_concat", "hash_unchained", "hash_packed_no_boundaries", "hash_ignores_tenant",
    "derive_unkeyed", "derive_none_is_empty", "derive_concat", "derive_no_secret_check",
    "KeyedSaltNeverUsed", "KeyedFirstBlockOnly", "KeyedTruncated",
    "keys_salt_last_block_only", "keys_salt_never_passed", "keys_straddling_block_public", "keys_unchained",
    "layout_tenant_part_per_user", "layout_user_part_tenant_key", "layout_straddle_looser", "layout_user_not_bound",
    "layout_joined_names", "layout_orphan_user",
    "zero_k_only", "zero_layer0_only", "zero_wrong_dim", "zero_out_of_place",
    "BudgetEagerOnFree", "BudgetEveryAlloc", "BudgetCachedOnly", "BudgetWipeOnCache", "BudgetZeroEachEviction",
    "BudgetMarkOnRelease",
    "verdict_one_direction", "verdict_wrong_order",
    "audit_one_direction", "audit_sequential", "audit_everything_cross", "audit_no_copy",
    "ks_wrong_alternative", "ks_two_sided", "auc_flipped", "auc_ignores_ties",
]
