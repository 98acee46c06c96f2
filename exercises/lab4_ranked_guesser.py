# GENERATED from solutions/lab4_ranked_guesser.py by `python -m minikv.grading.make_exercises`.
# This file is yours: replace every `raise NotImplementedError` with your implementation,
# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the
# reference solution uses.  Course maintainers: edit solutions/lab4_ranked_guesser.py and regenerate; never
# edit this file by hand.
# minikv-stub: 158d39b932aa6ee8
"""Lab L4 (lesson 04, open design): beat the exhaustive search with a ranked guesser.

The oracle is L1's: a victim sent ``card["prefix"] + SECRET + card["suffix"]`` to a server whose
prefix cache is shared, and ``OracleClient(card).cached_tokens(text)`` tells you how many leading
tokens of ``text`` the server took from its cache (one character, one token; blocks of
``card["block_size"]``).  This time the secret is text, not a PIN, and you hold a model of it:
``card["prior"][prev][c]`` is the probability that character ``c`` follows character ``prev``
(a bigram model over ``card["alphabet"]``; the victim's text was sampled from exactly this model,
starting after the prefix's last character).  It stands in for lesson 04's SmolLM2 ranking, which
would be too slow to grade on a small CPU.

Contract: return the secret (a ``str`` of ``card["secret_len"]`` characters), using only what
``OracleClient`` answers.  The grader runs your function sealed against 5 victims (``make grade``
draws fresh secrets on every grade; the lesson's check uses fixed ones) and scores the **median
probes per token**, printed beside the reference's figure and an exhaustive search's on the same
secrets.  It passes when you recover every
secret, confirmed by the oracle, at no more than 1.5 times the reference's median.  Any strategy is
allowed; the prior is your lever.  Off limits (the grader refuses the file): ``minikv.attacks``,
``minikv.security``, ``minikv.audit.detector`` and ``solutions``.
"""
from __future__ import annotations

import itertools

from minikv.audit.oracle_client import OracleClient


def guess_secret(card: dict) -> str:
    """Recover the victim's secret; return it as a ``str`` of ``card["secret_len"]`` characters.

    ``card``: the lab card (``base_url``, ``api_key``, ``prefix``, ``suffix``, ``secret_len``,
    ``alphabet``, ``block_size``, ``quota_blocks``, ``prior``).  Open the oracle with
    ``OracleClient(card)``.

    Stuck?  ``make hint EX=L4`` (three levels, one per call).
    """
    raise NotImplementedError("guess_secret: not implemented yet (read the docstring, then write your code here)")
