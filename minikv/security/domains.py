"""Isolation domains and the tenants who own them.

An engine isolates by *domain*: a string naming whose blocks may be shared.  Usually it is the
API key's tenant.  A client's ``cache_salt`` (``minikv serve --trust-client-salt``) narrows it:
the domain ``"<tenant>#salt-<digest>"`` is the tenant's, split off.  Isolation works per domain,
but what a tenant *pays with* -- a KV tier's byte quota -- must be counted per tenant, or every
fresh salt would be a fresh quota (the many-accounts attack, for the price of one).
"""
from __future__ import annotations

SALT_MARK = "#salt-"  # reserved in tenant names (the server refuses names that contain it)


def tenant_of(domain: str | None) -> str | None:
    """The API-key tenant that owns ``domain`` (the domain itself unless salted)."""
    if domain is None or SALT_MARK not in domain:
        return domain
    return domain.partition(SALT_MARK)[0]
