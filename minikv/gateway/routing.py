"""Which upstream serves a request: prefix affinity whose key includes the salt.

With several upstream engines, sending prompts that start alike to the same engine is what
makes a prefix cache pay off (SGLang's cache-aware router, llm-d's prefix scorer).  But a
router is shared state too.  Lesson 10 shows two ways it leaks: a route index shared across
tenants (the prefix a victim sent recently decides where *my* identical prefix goes), and a
shared fallback pointer that every miss advances.  The Kubernetes inference gateway's
prefix-aware scorer ignored ``cache_salt`` altogether (its issue #1631): two tenants with the
same prefix were steered to one pod, where the salt then kept their blocks apart -- but the
routing decision had already told each something about the other.

This router keeps no state a request can observe.  The upstream is chosen by **rendezvous
(highest-random-weight) hashing**: for each upstream ``u``, score ``SHA-256(encode_fields(label,
salt, head, u))`` and take the highest.  ``head`` is the first ``prefix_tokens`` token ids of
the prompt.  Consequences:

* the same (salt, prompt head) always lands on the same upstream: a tenant's repeats hit;
* the choice is a function of *this request alone* -- no index, no pointer -- so nothing
  another tenant sent can change it, and different tenants' identical prefixes land on
  unrelated upstreams (their salts differ);
* removing an upstream moves only the keys that lived on it (the property rendezvous hashing
  is known for), so a restart does not reshuffle every tenant's cache.

The price: no load awareness.  A hot (salt, prefix) pins one upstream; the fix -- spilling to
the least-loaded upstream -- would bring back state shared across tenants, so it must then be
per salt.  An upstream that refuses the connection is skipped for the next in the ranking
(the gateway does that, per request): that reveals only availability, which every tenant sees
anyway.
"""
from __future__ import annotations

import hashlib
from typing import Sequence

from ..security.encoding import encode_fields

ROUTE_LABEL = "minikv/gateway-route/v1"


class SaltAwareRouter:
    """Rendezvous hashing over ``upstreams`` on the key (salt, first ``prefix_tokens`` tokens)."""

    def __init__(self, upstreams: Sequence[str], prefix_tokens: int = 128):
        if not upstreams:
            raise ValueError("at least one upstream URL is required")
        if len(set(upstreams)) != len(upstreams):
            raise ValueError("upstream URLs must be distinct")
        if isinstance(prefix_tokens, bool) or not isinstance(prefix_tokens, int) or prefix_tokens < 1:
            raise ValueError(f"prefix_tokens must be an int >= 1, got {prefix_tokens!r}")
        self.upstreams, self.prefix_tokens = tuple(upstreams), prefix_tokens

    def ranking(self, salt: str, token_ids: Sequence[int]) -> list[str]:
        """All upstreams, best first, for this (salt, prompt head)."""
        if not isinstance(salt, str) or not salt:
            raise ValueError("routing needs the request's salt: an unsalted request must never be routed")
        head = tuple(int(t) for t in token_ids[:self.prefix_tokens])

        def score(upstream: str) -> bytes:
            return hashlib.sha256(encode_fields(ROUTE_LABEL, salt, head, upstream)).digest()
        return sorted(self.upstreams, key=score, reverse=True)

    def route(self, salt: str, token_ids: Sequence[int]) -> str:
        """The upstream for this (salt, prompt head): the top of :meth:`ranking`."""
        return self.ranking(salt, token_ids)[0]
