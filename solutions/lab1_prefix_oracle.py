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
    # BEGIN SOLUTION
    bs, n, alphabet = card["block_size"], card["secret_len"], card["alphabet"]
    prefix, suffix = card["prefix"], card["suffix"]
    found = ""
    with OracleClient(card) as oracle:
        while len(found) < n:
            start = len(prefix) + len(found)
            block_end = (start // bs + 1) * bs              # the block holding the next unknown
            u = min(block_end - start, n - len(found))      # unknown characters in that block
            tail = suffix[:block_end - start - u]           # the block's known rest, if any
            for guess in itertools.product(alphabet, repeat=u):
                # "#" goes past the block: the last prompt token is never served from cache
                probe = prefix + found + "".join(guess) + tail + "#"
                if oracle.cached_tokens(probe) >= block_end:
                    found += "".join(guess)
                    break
            else:
                raise RuntimeError(f"no filling of the block ending at {block_end} hit: "
                                   "is the cache isolated?")
    return found
    # END SOLUTION
