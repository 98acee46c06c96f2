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

# BEGIN SOLUTION
MIN_SAMPLES, MAX_ROUNDS = 6, 40
# END SOLUTION


def extract_secret_by_timing(card: dict) -> str:
    """Recover the victim's secret from ``oracle.ttft_ms`` alone; return it as a ``str``.

    ``card`` is the lab card (see lab L1); open the oracle with ``OracleClient(card)``.

    Stuck?  ``make hint EX=L2`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    bs, n, alphabet = card["block_size"], card["secret_len"], card["alphabet"]
    prefix, suffix = card["prefix"], card["suffix"]
    clock = card.get("virtual_clock", {})
    # A hit on the block saves its computed tokens' cost; drop a candidate once it trails the best by
    # more than half that gap.  Before that, every survivor gets MIN_SAMPLES samples: with fewer, one
    # lucky sample of a wrong candidate, or spikes on most of the right one's, decide too much.
    margin = clock.get("per_token_ms", 0.25) * bs / 2
    rng = random.Random(0)
    junk_len = (card["quota_blocks"] + 1) * bs + 1
    found = ""
    with OracleClient(card) as oracle:
        def flush():
            # one fresh prompt of quota+1 blocks: our older entries are recycled, the victim's stay
            oracle.ttft_ms("".join(rng.choice("qwertyuiopasdfghjklzxcvbnm") for _ in range(junk_len)))

        def robust(xs):
            # the second-fastest sample: spikes only ever add time, so it ignores one lucky draw of
            # noise and any number of spikes short of all but one of the samples
            return sorted(xs)[1]

        while len(found) < n:
            start = len(prefix) + len(found)
            block_end = (start // bs + 1) * bs
            u = min(block_end - start, n - len(found))
            tail = suffix[:block_end - start - u]
            samples = {"".join(g): [] for g in itertools.product(alphabet, repeat=u)}
            alive, rounds = list(samples), 0
            while len(alive) > 1 and rounds < MAX_ROUNDS:
                for guess in alive:                        # distinct texts: no self-priming inside
                    samples[guess].append(oracle.ttft_ms(prefix + found + guess + tail + "#"))
                flush()                                    # ...and none across rounds
                rounds += 1
                if rounds >= MIN_SAMPLES:                  # drop only what clearly trails the best
                    best = min(robust(samples[g]) for g in alive)
                    alive = [g for g in alive if robust(samples[g]) <= best + margin]
            found += min(alive, key=lambda g: robust(samples[g]))
    return found
    # END SOLUTION
