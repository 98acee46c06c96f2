"""Graders for exercises 1 and 2: the encoding, the chained hash, tenant keys and their plumbing.

This module gathers them under one name (``runner`` and the tests import it); each concept
lives in its own module:

* :mod:`.chained_hash` -- exercise 1: ``check_encode_fields`` (1a), ``check_chained_hash`` (1b)
* :mod:`.tenant_keys` -- exercise 2: ``check_tenant_key_derivation`` (2a),
  ``check_tenant_keyed_hasher`` (2b), ``check_block_keys`` (2c)
* :mod:`.hashing_workload` -- the engine run both end with: the learner's code inside a real
  engine, compared with minikv's reference on the same requests (``engine_stage_*``)

Each grader checks the contract on direct calls first (cheap, precise messages), then runs the
learner's code inside a real engine and compares what the cache did with what the engine's own
reference implementation (``minikv.security``) does on exactly the same requests.
"""
from __future__ import annotations

from .chained_hash import (KEY_A, KEY_B, TRICKY_BLOCKS, TRICKY_FIELDS, check_block_hash_properties,
                           check_chained_hash, check_encode_fields)
from .engines import ENGINE_SECRET
from .hashing_workload import (DOC, LEAD, MOVED, SYSTEM, WORKLOAD, compare_with_reference, engine_stage_block_keys,
                               engine_stage_hasher, engine_stage_key_derivation, reference_cached, run_workload,
                               tenant_name)
from .tenant_keys import SECRET_A, SECRET_B, check_block_keys, check_tenant_key_derivation, check_tenant_keyed_hasher

__all__ = [
    "check_encode_fields", "check_chained_hash", "check_tenant_key_derivation", "check_tenant_keyed_hasher",
    "check_block_keys", "engine_stage_hasher", "engine_stage_key_derivation", "engine_stage_block_keys",
    "reference_cached", "run_workload", "compare_with_reference", "check_block_hash_properties", "tenant_name",
    "TRICKY_FIELDS", "TRICKY_BLOCKS", "WORKLOAD", "SYSTEM", "DOC", "LEAD", "MOVED",
    "SECRET_A", "SECRET_B", "KEY_A", "KEY_B", "ENGINE_SECRET",
]
