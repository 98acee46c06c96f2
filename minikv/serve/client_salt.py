"""``minikv serve --trust-client-salt``: vLLM's ``cache_salt``, spoken by minikv.

By default ``minikv serve`` ignores ``cache_salt``: the tenant of the API key is the whole
isolation domain, and a client has no say in it.  vLLM works the other way round: it has no
tenants, and a request's ``cache_salt`` (a string in the body) is mixed into the hash of its
first KV block, so requests with different salts never share blocks and requests with the
same salt -- whoever sent them -- do.  With ``--trust-client-salt``, minikv speaks that
protocol too, which is what lets the same gateway (``minikv gateway``) sit in front of
either engine, and lets learners turn the same knob in both.

How: the salt narrows the tenant's domain.  A salted request runs in the domain
``"<tenant>#salt-<h>"`` where ``h = SHA-256(encode_fields(label, tenant, salt))`` (hex, 128
bits); the engine derives that domain's key from its secret like any tenant's.  Typed,
length-prefixed fields keep ``("ab", "c")`` and ``("a", "bc")`` apart, the tenant stays part of
the domain (the same salt under two API keys of different tenants is two domains: a salt can
narrow a tenant's domain, never widen it into another tenant's), and only a hash of the salt
reaches logs and the audit trail.  Since the engine's chained block hashes all derive from the
domain key, this isolates exactly like vLLM's "mix the salt into block 0".  Blocks inside an
operator-declared ``--shared-prefix`` stay shared across salts (they use the shared key).

What the flag costs: each salt is a tenant to the engine -- its own fair-share queue, its own
cached-block quota -- so a client with many salts gets many quotas, like an attacker with
many accounts.  Request rate, concurrency, the decode budget and the ``/metrics`` label
(:func:`minikv.security.domains.tenant_of`) stay per API key's tenant.  Salts need
``cache_isolation="tenant"`` (the default): under ``"shared"`` there are no domain keys to
narrow, and the salt changes nothing (the gateway's start-up probe then refuses that upstream,
as it should).
"""
from __future__ import annotations

import hashlib

from ..security.domains import SALT_MARK
from ..security.encoding import encode_fields
from .protocol import APIError

DOMAIN_LABEL = "minikv/serve-salt-domain/v1"
MAX_SALT_CHARS = 1024


def client_salt(body: dict) -> str | None:
    """The request's ``cache_salt``: None when absent, else a non-empty string (400 otherwise)."""
    salt = body.get("cache_salt")
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise APIError(400, "'cache_salt' must be a non-empty string", param="cache_salt", code="invalid_type")
    if len(salt) > MAX_SALT_CHARS:
        raise APIError(400, f"'cache_salt' has {len(salt)} characters; at most {MAX_SALT_CHARS}",
                       param="cache_salt")
    return salt


def salted_domain(tenant: str, salt: str | None) -> str:
    """The engine-side isolation domain of ``tenant``'s request with ``salt`` (None: the tenant)."""
    if salt is None:
        return tenant
    digest = hashlib.sha256(encode_fields(DOMAIN_LABEL, tenant, salt)).hexdigest()[:32]
    return f"{tenant}{SALT_MARK}{digest}"


def check_tenant_names(**tenant_lists) -> None:
    """Refuse tenant names that could be mistaken for a salted domain (ValueError).

    Refused whether or not salts are trusted: tier quotas and ``/metrics`` charge a domain to the
    part before the mark (:func:`minikv.security.domains.tenant_of`), so a tenant named
    ``"bob#salt-x"`` would spend bob's tier quota and report under bob's label.  Each keyword
    names a keys flag (``api_keys`` is ``--api-keys``) and gives its tenant names."""
    for flag, tenants in tenant_lists.items():
        bad = sorted(t for t in tenants if SALT_MARK in t)
        if bad:
            raise ValueError(f"--{flag.replace('_', '-')}: tenant name {bad[0]!r} contains {SALT_MARK!r}, which "
                             f"minikv reserves for salted domains (it would be counted as tenant "
                             f"{bad[0].partition(SALT_MARK)[0]!r}); rename it")
