"""``minikv gateway``: the course's defenses in front of an engine you did not write.

Everything earlier in the course hardens minikv itself.  A real deployment runs vLLM or
SGLang, whose cache isolation is a *salt* that the request carries (vLLM's ``cache_salt``,
the fix for CVE-2025-46570).  A salt in the request is a salt the client chooses -- and can
copy.  The gateway moves that choice to the server side, where lesson 07 says it belongs:

=========================  ==============================================================
module                     one concept
=========================  ==============================================================
:mod:`.salt`               API key -> identity (the strict keys loader of ``minikv serve``);
                           identity -> keyed, length-prefixed salt
:mod:`.probe`              the start-up check that the upstream really isolates by salt
:mod:`.routing`            several upstreams: prefix affinity keyed by (salt, prefix)
:mod:`.proxy`              forwarding: fresh headers, salt replaced, fail closed, cancel
:mod:`.oversight`          the upstream's tokens, the keyed trail, the probing detector
:mod:`.app`                the HTTP app: limits, the request path, operator endpoints
:mod:`.cli`                ``minikv gateway``: start-up checks, then serve
=========================  ==============================================================

**What a public prefix leaks, and why only minikv upstreams get one.**  A public prefix is a
system prompt every tenant may share, so its KV blocks are computed once.  vLLM 0.32 mixes the
salt into the hash of block 0, and every later block chains on it: a salted request shares
*nothing* with other salts, public part included.  ``minikv serve --shared-prefix TEXT`` keys
the whole blocks inside the declared prefix with the shared key and everything after them with
the tenant's (salted) key.  What then leaks, exactly: whether *some* tenant recently sent the
public prefix (its blocks are warm), i.e. that the service is in use -- the prefix text is
public by definition.  What does not leak: anything after the last whole block of the prefix
(the partial block that holds the prefix's end and the tenant's first tokens is private), and
so neither what any tenant asked nor whether it repeated a question.
"""
from __future__ import annotations

__all__ = ["create_gateway_app", "GatewayConfig", "derive_salt", "Identity", "SaltAwareRouter", "probe_upstream"]


def __getattr__(name: str):   # lazy: ``minikv --help`` must not import FastAPI or httpx
    import importlib

    where = {"create_gateway_app": ".app", "GatewayConfig": ".app", "derive_salt": ".salt",
             "Identity": ".salt", "SaltAwareRouter": ".routing", "probe_upstream": ".probe"}
    if name in where:
        return getattr(importlib.import_module(where[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
