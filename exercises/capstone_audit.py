# GENERATED from solutions/capstone_audit.py by `python -m minikv.grading.make_exercises`.
# This file is yours: replace every `raise NotImplementedError` with your implementation,
# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the
# reference solution uses.  Course maintainers: edit solutions/capstone_audit.py and regenerate; never
# edit this file by hand.
# minikv-stub: f6f4490cccbf145b
"""Capstone (lesson 12): audit the mystery fleet.

You are the auditor of a fleet of minikv servers.  Some are misconfigured; you do not know which,
nor how.  ``fleet`` (a dict) gives you what an auditor gets:

* ``fleet["nodes"]``: the nodes' API roots (``http://127.0.0.1:PORT/v1``);
* ``fleet["api_keys"]``: ``{key: tenant}`` for two test tenants (alice, bob);
* ``fleet["auditor_key"]``: opens each node's published audit trail;
* ``fleet["kinds"]``: the finding kinds you may report (below).

Each node also publishes ``GET <root>/fleet/node`` (its block size and its operator-declared
public prefix: cross-tenant hits *on it* are intended) and ``GET <root>/fleet/trail`` (its
request-level audit trail, JSONL; auditor key), where ``<root>`` is the URL without ``/v1``.

Return one finding per misconfigured node: ``{"node": <its URL as given>, "kind": <kind>}``.

``shared_cache``        ``cache_isolation="shared"``;
``tenant_key_dropped``  the server loses the tenant before the engine: every request reaches the hash
                        without one;
``first_block_only``    tenant keys on the first block only, behind the public prefix (lesson 07);
``weak_hash``           the ``poly`` hash with ``verify_hits=False`` (lesson 06);
``client_salt_key``     the node keys its cache by a request's ``cache_salt`` alone when one is sent
                        (vLLM's contract, but with no tenant behind the salt).

Lesson 12 works ``shared_cache`` through; the other four tests are yours to design, each with a
control that proves it could have seen what it looks for.

Use only public tools and HTTP: ``minikv audit isolation`` (``minikv.audit.isolation_server``),
``minikv audit detect`` (run the command: the detector module itself is off limits),
``minikv.attacks.collisions`` and ``httpx``.  The lab model's tokenizer is byte-level (ids 3..258
are the bytes 0..255; one ASCII character is one token), its vocabulary has 259 ids, and a prompt
may be a list of token ids.  ``make grade`` builds a fresh fleet from a new seed in another
process (seven nodes: every kind at least once, and one or two clean nodes) and checks your
findings against its answer key: found, missed, false alarm.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

import httpx

from minikv.attacks.collisions import poly_collision
from minikv.audit.isolation_server import audit_server

VOCAB = 259




def audit_fleet(fleet: dict) -> list[dict]:
    """Audit every node of ``fleet``; return ``[{"node": url, "kind": kind}, ...]``.

    Stuck?  ``make hint EX=C`` (three levels, one per call).
    """
    raise NotImplementedError("audit_fleet: not implemented yet (read the docstring, then write your code here)")
