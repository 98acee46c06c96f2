"""Who is asking, when a gateway asks for them: the one header only a gateway key may send.

A ``minikv gateway`` in front of ``minikv serve`` authenticates its tenants itself and calls the
server with its own key.  Without more, the server sees every tenant behind the gateway as one
tenant -- the gateway's -- so one tenant's flood spends the request rate, concurrency slots and
decode budget of all of them, and the others get the 429s.

So the operator may mark keys as *gateway* keys (``--gateway-keys``, a keys file of the usual
shape: gateway key -> gateway name).  A request authenticated with a gateway key may name the
tenant it is made for in ``X-Minikv-Tenant``; the server then serves it as the tenant
``"<gateway name>/<tenant>"``: its own limits, its own fair share, its own cache domain.
The rules, each closing a hole:

* **Only a gateway key may assert.**  A tenant key sending the header is refused (403), never
  ignored: a client that tries to speak for someone else should hear that it cannot.
* **Asserted tenants live under the gateway's name.**  A gateway can never speak for a tenant
  of the server's own keys file (``alice`` direct and ``gw/alice`` are two domains), nor for
  another gateway's tenants.
* **The name is checked and their number bounded.**  Printable, at most
  :data:`MAX_TENANT_CHARS` characters, no salt mark (:mod:`.client_salt`), and at most
  :data:`MAX_ASSERTED_TENANTS` distinct names per server: every tenant costs a limiter record
  and ``/metrics`` labels, and even a trusted gateway's bug must not grow them without bound.
* **A gateway key without the header is the gateway itself** (its start-up probe, say): one
  tenant named after the gateway, like any key.
"""
from __future__ import annotations

from .auth import ApiKeys
from .client_salt import SALT_MARK
from .protocol import APIError

TENANT_HEADER = b"x-minikv-tenant"
MAX_TENANT_CHARS = 128
MAX_ASSERTED_TENANTS = 4096


def header(scope_headers, name: bytes) -> bytes | None:
    """The raw value of header ``name`` (lower-case bytes) in an ASGI scope's header list."""
    return next((v for k, v in scope_headers if k == name), None)


def _asserted_name(raw: bytes) -> str:
    try:
        name = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise APIError(400, "X-Minikv-Tenant is not UTF-8", param="X-Minikv-Tenant") from None
    if not name or len(name) > MAX_TENANT_CHARS or not name.isprintable() or SALT_MARK in name:
        raise APIError(400, f"X-Minikv-Tenant {name[:40]!r} must be 1-{MAX_TENANT_CHARS} printable characters "
                            f"without {SALT_MARK!r}", param="X-Minikv-Tenant")
    return name


class TenantResolver:
    """API key (and, for gateway keys, ``X-Minikv-Tenant``) -> the tenant a request runs as."""

    def __init__(self, keys: ApiKeys, gateway_keys: ApiKeys | None = None):
        self.keys, self.gateway_keys = keys, gateway_keys
        self._asserted: set[str] = set()

    def __call__(self, scope_headers) -> str | None:
        """The tenant, or None when the key is unknown (the caller answers 401)."""
        auth, asserted = header(scope_headers, b"authorization"), header(scope_headers, TENANT_HEADER)
        tenant = self.keys.resolve(auth)
        gateway = self.gateway_keys.resolve(auth) if self.gateway_keys is not None else None
        if gateway is None:
            if tenant is not None and asserted is not None:
                raise APIError(403, "only a gateway key may send X-Minikv-Tenant; this key is a tenant's",
                               "permission_error", param="X-Minikv-Tenant", code="tenant_assertion_refused")
            return tenant
        if asserted is None:
            return gateway
        name = f"{gateway}/{_asserted_name(asserted)}"
        if name not in self._asserted:
            if len(self._asserted) >= MAX_ASSERTED_TENANTS:
                raise APIError(403, f"gateways asserted more than {MAX_ASSERTED_TENANTS} distinct tenants; "
                                    "refusing new ones", "permission_error", param="X-Minikv-Tenant",
                               code="too_many_tenants")
            self._asserted.add(name)
        return name
