"""Sealing KV blocks for a store outside the process: tier keys, a MAC, and per-tenant encryption.

A KV tier (host memory, Redis: :mod:`minikv.tiers`) is a new trust boundary.  Whoever
can *write* to a shared store can hand an engine K/V it never computed -- cache poisoning one
level below the pool.  Whoever can *read* it reads every tenant's K/V, and lesson 05's layer-0
inversion turns K/V back into prompt tokens.  So every block leaves the process sealed:

* **The key** (:func:`tier_key`) is ``minikv/kv/v2/``, then the engine's *space*
  (:func:`tier_space`: a digest of the model's weights, the dtype and the block geometry), then
  the hex of the block hash the pool already uses: chained over the whole prefix and keyed with
  the tenant's server-side key.  No token id or text appears in it; a reader of the store learns
  only opaque names.  The space lets a fleet of mixed models and dtypes share one store: each
  engine looks up only values it could use, and never overwrites (or, refusing them, deletes)
  another model's.
  (UNSAFE ``kv_tier_keys="content"`` uses the same chain *without* the tenant key: LMCache
  #4825's ``cache_salt=''``, where two tenants' identical prefixes share one name.)
* **Integrity**: every value is authenticated over its *binding* (:func:`binding`), which names
  what the K/V are: the tier key, the model, the dtype, the block geometry and the block's
  tokens.  The tokens are bound but never stored: the engine knows which tokens it is looking
  up, so a value computed for other tokens (a hash collision, a swapped key) fails exactly as an
  outside write does.  A failing value is never used.
* **Secrecy**: the body is the K/V encrypted with AES-256-GCM under a key derived from the
  operator secret and the block's *domain* (the tenant, or "public" for an operator-declared
  shared prefix), with the binding and the value's header as associated data.  GCM is an AEAD:
  its tag *is* the MAC, under a key only the operator's engines can derive, so a sealed value
  carries no second one.  (Version 1 of this format also put an HMAC-SHA256 over every
  ciphertext: the same guarantee, paid twice -- it was 60% of the cost of opening a block.)
* UNSAFE ``kv_tier_encrypt=False`` stores the raw bytes, as LMCache and SGLang's HiCache do
  today -- but still with ``HMAC-SHA256(mac_key, binding || header || body)``: integrity is never
  optional, only secrecy is.

Every key is derived on the server from the engine secret with typed, length-prefixed fields
(:func:`~minikv.security.encoding.encode_fields`, one versioned label per purpose); no client
names or chooses one.  ``cryptography`` is imported only when a sealer is built.
"""
from __future__ import annotations

import hashlib
import hmac
import os
import struct

from .encoding import encode_fields
from .keys import check_secret

__all__ = ["NAMESPACE", "SealError", "Sealer", "binding", "tier_key", "tier_space", "derive_tier_keys"]

NAMESPACE = b"minikv/kv/v2/"  # versioned: a new value format gets a new namespace, never a clash
MAC_LABEL = "minikv/tier-mac/v1"
AEAD_LABEL = "minikv/tier-aead/v1"
BUDGET_LABEL = "minikv/tier-budget/v1"
_MAGIC = b"MKV2"
_FLAGS = struct.Struct(">4sB")  # magic, 1 = encrypted
_MAC_LEN, _NONCE_LEN = 32, 12


class SealError(ValueError):
    """A stored value failed verification (bad MAC, wrong format, failed decryption)."""


def tier_space(model: str, dtype: str, geometry: tuple[int, ...]) -> bytes:
    """The part of every key an engine writes that says which K/V it can use: 16 hex digits of
    a digest of its model (:meth:`~minikv.engine.model.LlamaModel.fingerprint`), dtype and block
    geometry.  Not a secret and not a MAC: the binding still checks all three on every value."""
    digest = hashlib.sha256(encode_fields("minikv/tier-space/v1", model, dtype, tuple(geometry))).hexdigest()
    return digest[:16].encode()


def tier_key(space: bytes, block_hash: bytes) -> bytes:
    """The store key of a block: namespace / space / the hex of its (tenant-keyed, chained) hash."""
    if not isinstance(space, bytes) or len(space) != 16:
        raise TypeError(f"space must be the 16 bytes tier_space returns, got {space!r}")
    if not isinstance(block_hash, (bytes, bytearray)) or not block_hash:
        raise TypeError(f"block_hash must be non-empty bytes, got {type(block_hash).__name__}")
    return NAMESPACE + space + b"/" + bytes(block_hash).hex().encode()


def binding(key: bytes, model: str, dtype: str, geometry: tuple[int, ...], tokens) -> bytes:
    """What a sealed value is bound to: a value moved to another key, or read by an engine with
    another model, dtype or block geometry, or for other tokens, fails verification."""
    return encode_fields("minikv/tier-binding/v1", bytes(key), model, dtype, tuple(geometry), tuple(tokens))


def derive_tier_keys(secret: bytes) -> tuple[bytes, bytes]:
    """(MAC key, AEAD root key) from the engine secret: one label each, never the secret itself."""
    s = check_secret(secret)
    return (hmac.digest(s, encode_fields(MAC_LABEL), "sha256"),
            hmac.digest(s, encode_fields(AEAD_LABEL), "sha256"))


class Sealer:
    """Seals and opens block values for one engine (one secret, model, dtype, geometry).

    ``encrypt=False`` is the UNSAFE cleartext setting (still MACed: integrity is never optional).
    """

    def __init__(self, secret: bytes, *, encrypt: bool = True):
        self._mac_key, self._aead_root = derive_tier_keys(secret)
        self._budget_key = hmac.digest(check_secret(secret), encode_fields(BUDGET_LABEL), "sha256")
        self.encrypt = encrypt
        self._aeads: dict = {}  # domain -> AESGCM, derived once per domain
        if encrypt:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM  # noqa: F401 -- fail early
        self.num_refused = 0

    def _aead(self, domain: tuple):
        aead = self._aeads.get(domain)
        if aead is None:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            key = hmac.digest(self._aead_root, encode_fields(AEAD_LABEL, *domain), "sha256")
            aead = self._aeads[domain] = AESGCM(key)
        return aead

    def tenant_tag(self, tenant: str | None) -> str:
        """An opaque, stable name for ``tenant`` in the store (its byte budget's counter): a
        keyed hash, so the store never holds a tenant's name."""
        return hmac.digest(self._budget_key, encode_fields(tenant), "sha256")[:8].hex()

    def seal(self, payload: bytes, bound: bytes, domain: tuple) -> bytes:
        """``payload`` (a block's K/V bytes) sealed for ``bound`` (:func:`binding`) in ``domain``
        (``("domain", key)``, ``("public",)``, or ``("shared",)`` under the UNSAFE content keys).

        Encrypted: ``header | nonce | AES-GCM(payload, aad = bound | header)``.
        Cleartext (UNSAFE): ``header | HMAC-SHA256(bound | header | payload) | payload``."""
        head = _FLAGS.pack(_MAGIC, int(self.encrypt))
        if self.encrypt:
            nonce = os.urandom(_NONCE_LEN)  # random 96-bit nonces: safe far beyond 2**32 values per key
            return head + nonce + self._aead(domain).encrypt(nonce, payload, bound + head)
        h = hmac.new(self._mac_key, bound + head, "sha256")
        h.update(payload)  # not bound + head + payload: that would copy the block once more
        return head + h.digest() + payload

    def open(self, value: bytes, bound: bytes, domain: tuple, out: bytearray | None = None) -> bytearray:
        """The payload of a sealed ``value``, or :class:`SealError` if anything fails to verify.

        The payload comes back as a writable ``bytearray`` that the caller may hand to
        ``torch.frombuffer`` as is: ``out`` if given (and the right size), else a fresh one.  A
        block is ~0.7 MB on SmolLM2, and every copy or fresh buffer of it (a slice of ``bytes``
        copies; a new large buffer is page-faulted in) costs a fair part of its decryption."""
        head_len = _FLAGS.size
        if not isinstance(value, (bytes, bytearray)) or len(value) < head_len + max(_MAC_LEN, _NONCE_LEN + 16):
            raise SealError("value too short to be a sealed block")
        magic, encrypted = _FLAGS.unpack_from(value)
        if magic != _MAGIC or encrypted != int(self.encrypt):
            raise SealError("wrong format or encryption setting")
        view, head = memoryview(value), bytes(value[:head_len])
        if self.encrypt:
            from cryptography.exceptions import InvalidTag
            nonce, sealed = view[head_len:head_len + _NONCE_LEN], view[head_len + _NONCE_LEN:]
            aead = self._aead(domain)
            try:
                if hasattr(aead, "decrypt_into"):  # recent cryptography releases: straight into our buffer
                    n = len(sealed) - 16  # the plaintext: the ciphertext less GCM's tag
                    out = out if out is not None and len(out) == n else bytearray(n)
                    aead.decrypt_into(nonce, sealed, bound + head, out)
                else:
                    out = bytearray(aead.decrypt(bytes(nonce), bytes(sealed), bound + head))
            except InvalidTag:
                raise SealError("authentication failed (outside write, bit flip, swapped key, another "
                                "model/dtype, or another tenant's key)") from None
            return out
        mac, body = view[head_len:head_len + _MAC_LEN], view[head_len + _MAC_LEN:]
        h = hmac.new(self._mac_key, bound + head, "sha256")
        h.update(body)
        if not hmac.compare_digest(mac, h.digest()):
            raise SealError("MAC mismatch (outside write, bit flip, swapped key, or another model/dtype)")
        return bytearray(body)
