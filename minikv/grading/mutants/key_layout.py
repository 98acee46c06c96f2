"""Wrong answers to exercise 2d: key layouts that leak between users or tenants, or that over-key.

Each starts from a sound idea (derive keys on the server, key private parts) and gets one scope
wrong: a leak shares a block beyond who may see it, an over-keyed layout shares less than it
may -- isolated, but every user of a tenant pays for its documents again.
"""
from __future__ import annotations

import hashlib
import hmac

from ...security.encoding import encode_fields as _typed
from ...security.keys import derive_tenant_key as _tenant_key
from ._table import entries


def _checked(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end):
    """The contract's input checks, so that each mutant fails for its own reason."""
    for value in (tenant, user):
        if value is not None and not isinstance(value, str):
            raise TypeError("ids are str or None")
    if tenant is None and user is not None:
        raise ValueError("a user without a tenant")
    if block_size < 1 or not 0 <= public_len <= tenant_end <= n_tokens:
        raise ValueError("boundaries out of order")
    return _tenant_key(engine_secret, tenant)


def _user_key(tenant_key, user):
    return hmac.digest(tenant_key, _typed("minikv/user-key/v1", user), "sha256")


def _lay(n_tokens, block_size, public_len, tenant_end, tenant_key, user_key, last_token=True):
    """Scope by the block's last token (``last_token``) or, wrongly, by its first."""
    out = []
    for i in range(n_tokens // block_size):
        at = (i + 1) * block_size if last_token else i * block_size + 1
        out.append(None if at <= public_len else tenant_key if at <= tenant_end else user_key)
    return out


def layout_tenant_part_per_user(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end):
    """Over-keying: 'private is safer', so the tenant's documents are keyed per user too.  Isolated,
    but no two users of a tenant ever share its documents: every user prefills them again."""
    user_key = _user_key(_checked(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end), user)
    return _lay(n_tokens, block_size, public_len, tenant_end, user_key, user_key)


def layout_user_part_tenant_key(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end):
    """The user part keyed with the tenant's key only: any other user of the tenant can probe one
    user's private history (a cross-user leak inside the tenant)."""
    tenant_key = _checked(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end)
    return _lay(n_tokens, block_size, public_len, tenant_end, tenant_key, tenant_key)


def layout_straddle_looser(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end):
    """Scopes each block by its FIRST token: a block that straddles a boundary takes the looser
    key, so the first private tokens after each boundary are shared."""
    tenant_key = _checked(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end)
    return _lay(n_tokens, block_size, public_len, tenant_end, tenant_key, _user_key(tenant_key, user),
                last_token=False)


def layout_user_not_bound(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end):
    """The user key is HMAC(secret, user), not tied to the tenant: 'bob' of acme and 'bob' of globex
    share their private blocks."""
    tenant_key = _checked(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end)
    user_key = hmac.digest(engine_secret, _typed("minikv/user-key/v1", user), "sha256")
    return _lay(n_tokens, block_size, public_len, tenant_end, tenant_key, user_key)


def layout_joined_names(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end):
    """The user key is HMAC over f'{tenant}:{user}': ('a:b', 'c') and ('a', 'b:c') are one user,
    and user None is user 'None'."""
    tenant_key = _checked(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end)
    user_key = hmac.digest(engine_secret, f"{tenant}:{user}".encode(), "sha256")
    return _lay(n_tokens, block_size, public_len, tenant_end, tenant_key, user_key)


def layout_orphan_user(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end):
    """Correct keys, but a user with no tenant is accepted and keyed as the anonymous tenant's:
    an unauthenticated request can claim any user name there."""
    if block_size < 1 or not 0 <= public_len <= tenant_end <= n_tokens:
        raise ValueError("boundaries out of order")
    for value in (tenant, user):
        if value is not None and not isinstance(value, str):
            raise TypeError("ids are str or None")
    tenant_key = _tenant_key(engine_secret, tenant)
    return _lay(n_tokens, block_size, public_len, tenant_end, tenant_key, _user_key(tenant_key, user))


def layout_names_hashed(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end):
    """Checks the secret's length, then keys every part by a plain SHA-256 of the typed names: isolated
    and shared as it should be, but any client who knows the names computes every key, and a new engine
    secret changes none of them."""
    _checked(engine_secret, tenant, user, n_tokens, block_size, public_len, tenant_end)
    tenant_key = hashlib.sha256(_typed("minikv/tenant-key/v1", tenant)).digest()
    user_key = hashlib.sha256(_typed("minikv/user-key/v1", tenant, user)).digest()
    return _lay(n_tokens, block_size, public_len, tenant_end, tenant_key, user_key)


MUTANTS = {
    "2d": entries(("tenant-part-per-user", layout_tenant_part_per_user),
                  ("user-part-tenant-key", layout_user_part_tenant_key),
                  ("straddle-looser", layout_straddle_looser), ("user-not-bound", layout_user_not_bound),
                  ("joined-names", layout_joined_names), ("orphan-user", layout_orphan_user),
                  ("names-hashed", layout_names_hashed)),
}

DIAGNOSES = {
    ("2d", "tenant-part-per-user"): "over-keying the tenant part", ("2d", "user-part-tenant-key"): "cross-user leak",
    ("2d", "straddle-looser"): "straddling block takes the looser key",
    ("2d", "user-not-bound"): "user key not bound to its tenant", ("2d", "joined-names"): "untyped user encoding",
    ("2d", "orphan-user"): "a user without a tenant", ("2d", "names-hashed"): "keys a client can compute",
}
