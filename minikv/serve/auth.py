"""API key -> tenant: the only place where the server learns who is asking.

The tenant is the isolation domain whose prefix cache a request may hit, so it must come from
something a client cannot forge or copy from another client: its secret API key, looked up in an
operator-written JSON file (``{"<api key>": "<tenant>", ...}``).  Nothing in a request body can
name a tenant (see :mod:`minikv.serve.app`).

The lookup is constant-time.  A naive ``keys[token]`` or ``==`` returns faster the earlier a
guessed key goes wrong, and that difference is measurable over a network with enough samples --
the same kind of timing side channel this course measures on the prefix cache.  Hence
:class:`ApiKeys` hashes and compares with ``hmac.compare_digest``, over every key.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Mapping


class ApiKeys:
    """API key -> tenant, resolved in constant time.

    Every configured key is compared (no early exit), and what is compared are SHA-256 digests
    of equal length, so neither the position of the first wrong character nor the key's length
    shows in the response time.
    """

    def __init__(self, mapping: Mapping[str, str]):
        if not isinstance(mapping, Mapping) or not mapping:
            raise ValueError("api keys must be a non-empty mapping of key -> tenant")
        entries = []
        for key, tenant in mapping.items():
            if not isinstance(key, str) or not key.strip() or key != key.strip():
                raise ValueError("every API key must be a non-empty string without surrounding spaces")
            if not isinstance(tenant, str) or not tenant:
                raise ValueError("every tenant name must be a non-empty string")
            entries.append((hashlib.sha256(key.encode()).digest(), tenant))
        self._entries = tuple(entries)
        self.tenants = tuple(sorted(set(mapping.values())))

    def __repr__(self) -> str:  # never print keys
        return f"ApiKeys({len(self._entries)} keys, tenants={list(self.tenants)})"

    def resolve(self, authorization: str | None) -> str | None:
        """The tenant of a ``Bearer`` header, or None (missing, malformed or unknown key)."""
        if not authorization:
            return None
        scheme, _, token = authorization.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        digest = hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()
        found = None
        for key_digest, tenant in self._entries:
            if hmac.compare_digest(key_digest, digest):
                found = tenant
        return found


def load_api_keys(path: str | os.PathLike) -> ApiKeys:
    """Read a JSON object ``{"<api key>": "<tenant>", ...}``."""
    with open(path, encoding="utf-8") as fh:
        try:
            data = json.load(fh)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object mapping API key -> tenant name")
    return ApiKeys(data)
