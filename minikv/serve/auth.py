"""API key -> tenant: the only place where the server learns who is asking.

The tenant is the isolation domain whose prefix cache a request may hit, so it must come from
something a client cannot forge or copy from another client: its secret API key, looked up in an
operator-written JSON file (``{"<api key>": "<tenant>", ...}``).  Nothing in a request body can
name a tenant (see :mod:`minikv.serve.app`).  Operators get keys of their own, in a second file
of the same shape (``--operator-keys``): they unlock ``/metrics``, never the model.

Three rules, each learned from a real failure:

* **The lookup is constant-time.**  A naive ``keys[token]`` or ``==`` returns faster the earlier
  a guessed key goes wrong, and that difference is measurable over a network with enough
  samples -- the same kind of timing side channel this course measures on the prefix cache.
  Hence :class:`ApiKeys` compares SHA-256 digests with ``hmac.compare_digest``, over every key.
* **Keys are bytes, compared as UTF-8.**  HTTP headers arrive as bytes; Starlette decodes them
  as latin-1, so a key with a non-ASCII character would only match a client that (wrongly)
  sent latin-1.  The app hands :meth:`ApiKeys.resolve` the raw header bytes instead.
* **The keys file is strict.**  A JSON object with a duplicate key is legal JSON, and Python
  keeps the *last* value: one tenant silently vanishes.  A deeply nested file crashes the
  parser with ``RecursionError``.  :func:`load_api_keys` refuses both, and any non-string
  value or bad encoding, with a one-line :class:`ValueError`.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
from typing import Mapping

from ..security.keys import read_secret_file


class ApiKeys:
    """API key -> tenant (or operator name), resolved in constant time.

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
                raise ValueError(f"the tenant of every API key must be a non-empty string, got {tenant!r}")
            entries.append((hashlib.sha256(key.encode("utf-8")).digest(), tenant))
        self._entries = tuple(entries)
        self.tenants = tuple(sorted(set(mapping.values())))

    def __repr__(self) -> str:  # never print keys
        return f"ApiKeys({len(self._entries)} keys, tenants={list(self.tenants)})"

    def resolve(self, authorization: str | bytes | None) -> str | None:
        """The tenant of a ``Bearer`` header, or None (missing, malformed or unknown key).

        ``authorization`` is the raw header value: bytes as they came off the wire (compared as
        UTF-8), or a str (tests, and callers that already decoded it correctly)."""
        if not authorization:
            return None
        raw = authorization.encode("utf-8", "surrogatepass") if isinstance(authorization, str) else authorization
        scheme, _, token = raw.partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return None
        digest = hashlib.sha256(token).digest()
        found = None
        for key_digest, tenant in self._entries:
            if hmac.compare_digest(key_digest, digest):
                found = tenant
        return found


    def shared_entries(self, other: "ApiKeys") -> list[tuple[int, int]]:
        """``(i, j)`` (1-based) for every key that is entry i here and entry j of ``other``."""
        return [(i, j) for i, (a, _) in enumerate(self._entries, 1)
                for j, (b, _) in enumerate(other._entries, 1) if hmac.compare_digest(a, b)]


def check_disjoint(**files: "ApiKeys | None") -> None:
    """Refuse (ValueError) a key that appears in two keys files, naming the flags and the
    entries' positions (never the key): a key has one role.  An operator key that is also a
    tenant key would let that tenant read ``/metrics``; a gateway key that is also a tenant key
    would let whoever holds it speak for any tenant of the gateway."""
    named = [(flag, keys) for flag, keys in files.items() if keys is not None]
    for a, (flag_a, keys_a) in enumerate(named):
        for flag_b, keys_b in named[a + 1:]:
            both = keys_a.shared_entries(keys_b)
            if both:
                i, j = both[0]
                fa, fb = (f"--{f.replace('_', '-')}" for f in (flag_a, flag_b))
                raise ValueError(f"entry {i} of {fa} and entry {j} of {fb} are the same key; "
                                 "a key must have one role")


MAX_KEYS_FILE_BYTES = 16 << 20


def _strict_object(pairs: list) -> dict:
    """``object_pairs_hook`` that refuses duplicate keys (json keeps the last one silently)."""
    out: dict = {}
    first: dict = {}
    for i, (key, value) in enumerate(pairs, 1):
        if key in out:  # name entries by position: a key must never be printed, not even in part
            raise ValueError(f"entry {i} repeats the key of entry {first[key]}; each key must appear once")
        out[key], first[key] = value, i
    return out


def load_api_keys(path: str | os.PathLike, what: str = "tenant", flag: str = "--api-keys") -> ApiKeys:
    """Read a JSON object ``{"<api key>": "<tenant>", ...}``; every problem is a one-line
    :class:`ValueError` that names the file and the entry's position (never a key).  ``flag``
    names the option in errors about the file itself (a FIFO, a device, too large, missing)."""
    raw = read_secret_file(path, flag, MAX_KEYS_FILE_BYTES)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 (bad byte at offset {exc.start})") from None
    try:
        data = json.loads(text, object_pairs_hook=_strict_object)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not valid JSON ({exc.msg}, line {exc.lineno})") from None
    except RecursionError:
        raise ValueError(f"{path}: nested too deeply; expected a flat object of key -> {what}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object mapping API key -> {what} name")
    for i, value in enumerate(data.values(), 1):
        if not isinstance(value, str):
            raise ValueError(f"{path}: entry {i}: the {what} must be a string, got {type(value).__name__}")
    try:
        return ApiKeys(data)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
