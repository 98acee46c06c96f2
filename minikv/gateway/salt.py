"""Who is asking, and which cache domain that earns them: identity and the salt.

vLLM's answer to cross-tenant prefix-cache probing (CVE-2025-46570) is ``cache_salt``, a field
of the request body that vLLM mixes into the hash of the first KV block, so requests with
different salts can never hit each other's blocks.  But a body field is written by whoever
writes the request: a client can copy a victim's salt and share its cache again (vLLM's
documentation debate, docs PR #53347; PR #57609 proposes an ``X-Cache-Salt`` header that wins
over the body).  The salt is only a defense when *the server side* chooses it.  This module
is that server side, for a gateway:

* **Identity comes only from the API key.**  The keys file is loaded by the same strict
  loader as ``minikv serve`` (:func:`minikv.serve.auth.load_api_keys`: constant-time lookup,
  duplicate keys refused).  Each value is ``"tenant"`` or ``"tenant/user"``: the user, too,
  comes from the operator's file, never from the request.
* **The salt is keyed and length-prefixed.**  ``HMAC-SHA256(gateway secret,
  encode_fields(label, scope, tenant[, user]))``.  Keyed: without the secret nobody can
  compute a tenant's salt, not even from its name (a LiteLLM PR, #27925, used an unkeyed
  ``sha256(api_key)``).  Length-prefixed (:func:`minikv.security.encoding.encode_fields`): the
  pair ``("ab", "c")`` and ``("a", "bc")`` give different salts, and a user scope salt never
  equals a tenant scope salt.  The tinfoil router's ``cachesalt`` (PR #386) is built the same
  careful way; the pinned vector in ``tests/test_gateway_salt.py`` freezes ours.
* The salt goes out base64url-encoded (43 characters), which vLLM's string field accepts.
"""
from __future__ import annotations

import base64
import hmac
from dataclasses import dataclass

from ..security.encoding import encode_fields
from ..security.keys import check_secret
from ..serve.auth import ApiKeys, load_api_keys

SALT_LABEL = "minikv/gateway-salt/v1"
SCOPES = ("tenant", "user")


@dataclass(frozen=True)
class Identity:
    """The authenticated caller: ``tenant`` (isolation and limits) and optional ``user``."""

    tenant: str
    user: str | None = None


def parse_identity(value: str) -> Identity:
    """``"acme"`` -> Identity("acme"); ``"acme/bob"`` -> Identity("acme", "bob") (first ``/``)."""
    tenant, sep, user = value.partition("/")
    if not tenant or (sep and not user):
        raise ValueError(f"identity {value!r} must be 'tenant' or 'tenant/user' with both parts non-empty")
    return Identity(tenant, user if sep else None)


class GatewayKeys:
    """API key -> :class:`Identity`, resolved in constant time by :class:`ApiKeys`."""

    def __init__(self, keys: ApiKeys, scope: str = "tenant"):
        if scope not in SCOPES:
            raise ValueError(f"salt scope {scope!r} is not one of {', '.join(SCOPES)}")
        self._keys, self.scope = keys, scope
        self.api_keys = keys   # the underlying keys, for checks across files (serve.auth.check_disjoint)
        self._identities = {}
        for name in keys.tenants:   # the *values* of the file
            self._identities[name] = parse_identity(name)
        if scope == "user":
            missing = sorted(n for n, i in self._identities.items() if i.user is None)
            if missing:
                raise ValueError(f"--salt-scope user needs 'tenant/user' for every key; {missing[0]!r} has no user")
        self.tenants = tuple(sorted({i.tenant for i in self._identities.values()}))

    def resolve(self, authorization: str | bytes | None) -> Identity | None:
        name = self._keys.resolve(authorization)
        return None if name is None else self._identities[name]


def load_gateway_keys(path, scope: str = "tenant") -> GatewayKeys:
    """The keys file (strict loader of ``minikv serve``), then identities; ValueError on problems."""
    try:
        return GatewayKeys(load_api_keys(path, what="tenant or tenant/user"), scope)
    except ValueError as exc:
        named = str(exc).startswith((str(path), "--"))   # already names the file or its flag
        raise ValueError(f"{path}: {exc}") if not named else exc from None


def derive_salt(secret: bytes, identity: Identity, scope: str = "tenant") -> str:
    """The cache salt of ``identity`` under ``scope`` (``"tenant"`` or ``"user"``).

    Deterministic, so a tenant's requests keep hitting each other's blocks; unrelated across
    tenants (and across users under ``"user"``); uncomputable without ``secret``."""
    if scope not in SCOPES:
        raise ValueError(f"salt scope {scope!r} is not one of {', '.join(SCOPES)}")
    if not isinstance(identity, Identity):
        raise TypeError(f"identity must be an Identity, got {type(identity).__name__}")
    if scope == "user" and identity.user is None:
        raise ValueError(f"tenant {identity.tenant!r} has no user, but the salt scope is 'user'")
    fields = (SALT_LABEL, scope, identity.tenant) + ((identity.user,) if scope == "user" else ())
    mac = hmac.digest(check_secret(secret, "gateway secret"), encode_fields(*fields), "sha256")
    return base64.urlsafe_b64encode(mac).rstrip(b"=").decode("ascii")
