# GENERATED from solutions/lab2_timing.py by `python -m minikv.grading.make_exercises`.
# This file is yours: replace every `raise NotImplementedError` with your implementation,
# then run `make grade` (or the check cell in the lesson).  The imports below are the ones the
# reference solution uses.  Course maintainers: edit solutions/lab2_timing.py and regenerate; never
# edit this file by hand.
# minikv-stub: b94e5e84840da77a
"""Lab L2 (lesson 04): steal the same secret from time to first token alone.

Same victim, same shared cache, same template as lab L1 -- but this server does not report
``cached_tokens``.  ``oracle.ttft_ms(text)`` returns the time to first token of ``text`` in
milliseconds.  A cache hit skips prefill work, so a probe whose block was cached by the victim
answers a little sooner.  In the graded run the server's clock is *virtual*
(``card["virtual_clock"]``): a fixed cost per computed prompt token plus noise and occasional
spikes, so one sample per candidate is not enough: you need repeats.

**Self-priming.**  Every probe you send stores its blocks in the shared cache.  Probe a wrong
candidate twice in a row and the second answer is fast -- because of *your own* first probe.
The server keeps at most ``card["quota_blocks"]`` cached blocks per tenant and recycles a
tenant's oldest entries first, so your old probes age out once you have stored that many newer
blocks; the victim's blocks (under the victim's quota) stay.  Your repeats must only be sent
after your earlier probe of the same text has aged out.

The grader runs your function in a fresh process, with a secret drawn at grade time, counts
your requests on the server, and checks on the server which of your answers came from your own
cache entries.  Off limits: ``minikv.attacks``, ``minikv.security``, ``minikv.audit.detector``
and ``solutions``.
"""
from __future__ import annotations

import itertools
import random

from minikv.audit.oracle_client import OracleClient



def extract_secret_by_timing(card: dict) -> str:
    """Recover the victim's secret from ``oracle.ttft_ms`` alone; return it as a ``str``.

    ``card`` is the lab card (see lab L1); open the oracle with ``OracleClient(card)``.

    Stuck?  ``make hint EX=L2`` (three levels, one per call).
    """
    raise NotImplementedError("extract_secret_by_timing: not implemented yet (read the docstring, then write your code here)")
