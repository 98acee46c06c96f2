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
``audit``           4a-4b   an audit that can fail: both directions, batched
``stats``           5a-5b   a one-sided test, "faster => hit", ties worth 1/2
==================  ======  ====================================================

Every implementation is re-exported here, so ``mutants.KeyedFirstBlockOnly`` (as the lessons
write it) keeps working.
"""
from __future__ import annotations

import importlib

# Lazy (PEP 562), like ``minikv.grading``: a lab's mutant guesser runs in a fresh interpreter per
# victim, and must not import every exercise's mutants (torch, the engine) to get there.
#: the per-exercise modules whose tables MUTANTS, DIAGNOSES and NEGATIVE_CONTROLS merge, in order
_TABLES = ("hashing", "tenant_keys", "key_layout", "scrubbing", "scrub_budget", "audit", "stats")
#: implementation name -> the module that defines it (the names lessons write as ``mutants.X``)
_EXPORTS = {name: module for module, names in {
    "scrubbing": ("zero_on_a_copy", "place_wipe_hits", "place_on_release", "place_keep_evicted",
                  "place_finished_only", "place_skip_aborted", "place_needs_a_request",
                  "zero_k_only", "zero_layer0_only", "zero_wrong_dim", "zero_out_of_place"),
    "scrub_budget": ("BudgetEagerOnFree", "BudgetEveryAlloc", "BudgetCachedOnly", "BudgetWipeOnCache",
                     "BudgetZeroEachEviction", "BudgetMarkOnRelease"),
    "hashing": ("encode_untyped", "encode_no_length", "encode_json_like", "hash_untyped_concat",
                "hash_unchained", "hash_packed_no_boundaries", "hash_ignores_tenant"),
    "tenant_keys": ("derive_unkeyed", "derive_none_is_empty", "derive_concat", "derive_no_secret_check",
                    "KeyedSaltNeverUsed", "KeyedFirstBlockOnly", "KeyedTruncated", "keys_salt_last_block_only",
                    "keys_salt_never_passed", "keys_straddling_block_public", "keys_unchained"),
    "key_layout": ("layout_tenant_part_per_user", "layout_user_part_tenant_key", "layout_straddle_looser",
                   "layout_user_not_bound", "layout_joined_names", "layout_orphan_user"),
    "audit": ("verdict_one_direction", "verdict_wrong_order", "audit_one_direction", "audit_sequential",
              "audit_everything_cross", "audit_no_copy"),
    "stats": ("ks_wrong_alternative", "ks_two_sided", "auc_flipped", "auc_ignores_ties"),
}.items() for name in names}


def _tables() -> dict:
    """``MUTANTS`` (exercise id -> [(name, implementation, what is wrong)], in exercise order),
    ``DIAGNOSES`` ((exercise id, mutant name) -> words the grader's verdict must contain: the bug
    class it names) and ``NEGATIVE_CONTROLS`` (exercise id -> correct implementations that differ
    only in method: graders must ACCEPT them), merged from the per-exercise modules."""
    modules = [importlib.import_module(f".{m}", __name__) for m in _TABLES]
    return {"MUTANTS": {k: v for m in modules for k, v in m.MUTANTS.items()},
            "DIAGNOSES": {k: v for m in modules for k, v in m.DIAGNOSES.items()},
            "NEGATIVE_CONTROLS": {k: v for m in modules for k, v in getattr(m, "NEGATIVE_CONTROLS", {}).items()}}


def __getattr__(name: str):
    if name in ("MUTANTS", "DIAGNOSES", "NEGATIVE_CONTROLS"):
        globals().update(_tables())
        return globals()[name]
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["MUTANTS", "DIAGNOSES", "NEGATIVE_CONTROLS", *_EXPORTS]
