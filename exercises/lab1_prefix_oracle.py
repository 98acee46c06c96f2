# GENERATED from solutions/lab1_prefix_oracle.py by `python -m minikv.grading.make_exercises`.
# This file is yours: replace every `raise NotImplementedError` with your implementation,
# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the
# reference solution uses.  Course maintainers: edit solutions/lab1_prefix_oracle.py and regenerate; never
# edit this file by hand.
# minikv-stub: 4df931cdc0377bd1
"""Lab L1 (lesson 04): steal a secret through the ``cached_tokens`` count oracle.

A victim sent ``card["prefix"] + SECRET + card["suffix"]`` to a server whose prefix cache is
*shared* across tenants.  You are another tenant.  You know the template around the secret, its
length (``card["secret_len"]``) and its alphabet (``card["alphabet"]``), and the server's block
size.  Your only instrument is :class:`~minikv.audit.oracle_client.OracleClient`:
``oracle.cached_tokens(text)`` sends ``text`` and returns how many leading tokens the server
served from its cache.  The lab model's tokenizer is byte-level: one character, one token.

Contract: return the secret, using only what ``OracleClient`` answers; the grader counts your
requests and compares them with an exhaustive block-by-block search (median over 5 fresh
secrets).  Fewer requests than the secret's information needs (log2 of each block's candidates)
is refused as a side door; more than the exhaustive search's worst case fails.  Which probes the
cache can answer at all is what lesson 04 shows you -- work that out before you write a loop.

The grader runs your function in a fresh process against a server in another process, with a
secret drawn at grade time; it counts your requests on the server and compares them with an
exhaustive block-by-block search.  Off limits (the grader refuses the file):
``minikv.attacks`` (it holds the reference attack), ``minikv.security``,
``minikv.audit.detector`` and ``solutions``.
"""
from __future__ import annotations

import itertools

from minikv.audit.oracle_client import OracleClient


def extract_secret(card: dict) -> str:
    """Recover the victim's secret; return it as a ``str`` of ``card["secret_len"]`` characters.

    ``card``: the lab card (``base_url``, ``api_key``, ``prefix``, ``suffix``, ``secret_len``,
    ``alphabet``, ``block_size``, ``quota_blocks``).  Open the oracle with
    ``OracleClient(card)``.

    Stuck?  ``make hint EX=L1`` (three levels, one per call).
    """
    raise NotImplementedError("extract_secret: not implemented yet (read the docstring, then write your code here)")
