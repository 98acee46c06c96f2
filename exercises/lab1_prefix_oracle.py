# GENERATED from solutions/lab1_prefix_oracle.py by `python -m minikv.grading.make_exercises`.
# This file is yours: replace every `raise NotImplementedError` with your implementation,
# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the
# reference solution uses.  Course maintainers: edit solutions/lab1_prefix_oracle.py and regenerate; never
# edit this file by hand.
# minikv-stub: 30049b6ec0becd83
"""Lab L1 (lesson 04): steal a secret through the ``cached_tokens`` count oracle.

A victim sent ``card["prefix"] + SECRET + card["suffix"]`` to a server whose prefix cache is
*shared* across tenants.  You are another tenant.  You know the template around the secret, its
length (``card["secret_len"]``) and its alphabet (``card["alphabet"]``), and the server's block
size.  Your only instrument is :class:`~minikv.audit.oracle_client.OracleClient`:
``oracle.cached_tokens(text)`` sends ``text`` and returns how many leading tokens the server
served from its cache.  The lab model's tokenizer is byte-level: one character, one token.

Three facts decide your probes (lesson 04):

* the cache answers per **whole block**: a block of ``block_size`` tokens is a hit only if every
  one of its tokens matches, so a block holding ``u`` unknown characters costs up to
  ``len(alphabet) ** u`` probes (the secret need not start on a block boundary);
* the server always computes the **last** prompt token, so a block can only be reported cached
  when your probe goes on past it;
* every probe you send is cached too (the cache is shared): sending one text twice answers
  "hit" the second time, from *your own* entry.

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
