"""Exercise 2 (lesson 07): tenant-keyed block hashing with server-side, per-tenant keys.

A shared prefix cache answers "did anyone recently send this prefix?" to every tenant (lesson
04).  The structural fix: make the cache key depend on a key that only the server knows and
that differs per tenant.  Then tenant B's probes can only ever hit B's own blocks.

* 2a ``derive_tenant_key`` -- the server derives a tenant's key from its engine secret with
  HMAC (clients never see, choose or copy it: unlike vLLM's client-chosen ``cache_salt``);
* 2b ``TenantKeyedHasher`` -- a ``BlockHasher`` keyed by that key (HMAC-SHA256), in every block;
* 2c ``block_keys`` -- the plumbing: the chain of keys of one prompt, tenant key included in
  every block after the operator-declared public prefix.  Real bugs live here: a salt that
  only reaches some blocks, or never reaches the key at all (SGLang #23300).

Grade with ``check_tenant_key_derivation``, ``check_tenant_keyed_hasher``, ``check_block_keys``.
"""
from __future__ import annotations

import hmac

# Your typed encoding from exercise 1a (grade 1a first: every key below is built on it).
from .ex1_chained_hash import encode_fields

# The engine's labels and minimum secret length, as literals (the engine uses the same strings;
# its own wire format may differ from your 1a, so its keys need not equal yours byte for byte --
# the grader runs YOUR keys inside the engine).  Never import minikv.security (the reference
# implementation): the grader refuses a file that does, and says why.
MIN_SECRET_BYTES = 16
TENANT_LABEL = "minikv/tenant-key/v1"
SHARED_LABEL = "minikv/shared-key/v1"
BLOCK_LABEL = "minikv/keyed-block/v1"

def derive_tenant_key(engine_secret: bytes, tenant: str | None) -> bytes:
    """Return the 32-byte cache key of ``tenant`` (``None`` = anonymous requests).

    Contract:

    * a keyed pseudo-random function of the tenant (HMAC-SHA256 keyed by the engine secret, its
      message labelled ``TENANT_LABEL``): deterministic, 32 bytes;
    * different tenants -> different keys; ``None``, ``""`` and ``"None"`` are three tenants, and two
      names that merely look alike (Unicode forms, non-ASCII letters) are different tenants too;
    * depends on the secret: another engine secret gives unrelated keys, and a client who knows
      only tenant names cannot compute any key (no ``sha256(tenant)``!);
    * never reveals the secret (the key is not the secret, nor contains it);
    * raises ``TypeError`` if ``engine_secret`` is not bytes and ``ValueError`` if it is
      shorter than ``MIN_SECRET_BYTES`` (a short secret can be brute-forced, and then every
      tenant key with it).

    Stuck?  ``make hint EX=2a`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    if not isinstance(engine_secret, (bytes, bytearray)):
        raise TypeError(f"engine_secret must be bytes, got {type(engine_secret).__name__}")
    if len(engine_secret) < MIN_SECRET_BYTES:
        raise ValueError(f"engine_secret must be at least {MIN_SECRET_BYTES} bytes, got {len(engine_secret)}")
    if tenant is not None and not isinstance(tenant, str):
        # 7 and "7" would otherwise be two spellings of one tenant in the caller's head
        raise TypeError(f"tenant must be a str or None, got {tenant!r}")
    # The secret is the HMAC *key*; the tenant is the *message*, typed, so that None, "" and "None"
    # are three different messages, and a name containing a separator cannot fake another name.
    message = encode_fields(TENANT_LABEL, tenant)
    return hmac.digest(bytes(engine_secret), message, "sha256")
    # END SOLUTION


class TenantKeyedHasher:
    """A ``BlockHasher`` keyed per tenant: ``hasher(parent, tokens, extra, tenant_key) -> bytes``.

    ``TenantKeyedHasher(engine_secret)`` builds it; the engine then calls it for every full
    block with the ``tenant_key`` it derived server-side (``None`` under
    ``cache_isolation="shared"`` and for blocks of an operator-declared public prefix).

    Contract:

    * ``__init__`` raises ``ValueError`` for a secret shorter than ``MIN_SECRET_BYTES`` bytes and
      derives a *shared key* from it (label ``SHARED_LABEL``) for blocks with ``tenant_key=None``;
    * ``__call__`` returns a 32-byte HMAC-SHA256 keyed per *domain* (a tenant block's own key, or
      the shared key for ``tenant_key=None``); its message covers ``BLOCK_LABEL``, the parent,
      the tokens and the extra keys without ambiguity, and says which kind of domain the block
      is in, so tenant and shared blocks can never share a key;
    * the key enters **every** block, not only the first: with ``chain_hashes=True`` keying the
      first block would carry the key down the chain, but a block whose parent is a *public*
      (unkeyed) block, or an engine with ``chain_hashes=False``, would then lose it;
    * chained and typed like exercise 1 (parent and tokens covered, no ambiguity).

    Stuck?  ``make hint EX=2b`` (three levels, one per call).
    """

    def __init__(self, engine_secret: bytes):
        # BEGIN SOLUTION
        if not isinstance(engine_secret, (bytes, bytearray)) or len(engine_secret) < MIN_SECRET_BYTES:
            raise ValueError(f"engine_secret must be at least {MIN_SECRET_BYTES} bytes")
        self._shared_key = hmac.digest(bytes(engine_secret), encode_fields(SHARED_LABEL), "sha256")
        # END SOLUTION

    def __call__(self, parent: bytes | None, tokens: tuple[int, ...], extra: tuple,
                 tenant_key: bytes | None) -> bytes:
        # BEGIN SOLUTION
        key = self._shared_key if tenant_key is None else tenant_key
        message = encode_fields(BLOCK_LABEL, parent, tuple(tokens), tuple(extra), tenant_key is not None)
        return hmac.digest(key, message, "sha256")
        # END SOLUTION


def block_keys(hasher, token_ids: list[int], block_size: int, tenant_key: bytes | None = None,
               public_len: int = 0) -> list[bytes]:
    """The cache keys of every *full* block of ``token_ids``, chained, as the engine computes them.

    Block ``i`` holds ``token_ids[i*block_size:(i+1)*block_size]``; a trailing partial block has
    no key.  Its key is ``hasher(parent, block_tokens, (), key_i)`` where ``parent`` is block
    ``i-1``'s key (``None`` for block 0) and ``key_i`` is ``None`` when the block lies entirely
    inside the first ``public_len`` tokens (an operator-declared shared prefix, e.g. a system
    prompt every tenant may share) and ``tenant_key`` otherwise.

    Contract: the same list as the engine's ``BlockManager.block_hash`` for every block (the
    grader installs your function in a real engine and checks both directions of isolation).

    Stuck?  ``make hint EX=2c`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    keys: list[bytes] = []
    parent = None
    for i in range(len(token_ids) // block_size):
        block = tuple(token_ids[i * block_size:(i + 1) * block_size])
        key = None if (i + 1) * block_size <= public_len else tenant_key
        parent = hasher(parent, block, (), key)
        keys.append(parent)
    return keys
    # END SOLUTION


# The label of a user's key (exercise 2d).  The engine has no user keys of its own: 2d is a
# layout a server builds on top of the engine's one-key-per-block seam.
USER_LABEL = "minikv/user-key/v1"


def key_layout(engine_secret: bytes, tenant: str | None, user: str | None, n_tokens: int, block_size: int,
               public_len: int, tenant_end: int) -> list[bytes | None]:
    """Open design: the domain key of every full block of a prompt with public, tenant and user parts.

    A prompt of ``n_tokens`` tokens has three parts, declared by the server (never the client):

    * ``[0, public_len)`` -- **public**: a system prompt every tenant and user may share;
    * ``[public_len, tenant_end)`` -- **per tenant**: the tenant's own documents and instructions,
      which every user *of that tenant* may share, and nobody else;
    * ``[tenant_end, n_tokens)`` -- **per user**: private to the one user ``user`` of ``tenant``.

    Return one entry per *full* block (``n_tokens // block_size`` of them, a trailing partial
    block has none): the ``tenant_key`` argument the engine's keyed hasher gets for that block
    (the engine chains the blocks itself).  ``None`` means "the shared domain": the engine then
    keys the block with the shared key it derived from its secret.

    Which keys you use and how you derive them is yours to design.  The grader installs your
    layout in a real engine and checks these properties:

    * **isolation**: two requests get the same key for a block only if they may share that
      block: anyone for a public block, the same tenant for a per-tenant block, the same
      (tenant, user) for a per-user block.  A block that straddles a boundary holds tokens of
      two parts and takes the scope of the *stricter* one;
    * **server-side keys**: every non-shared key comes from ``engine_secret`` through a keyed MAC
      over typed fields (your 2a and 1a), so a client that knows names cannot compute a key;
      tenant ``None`` (anonymous), ``""`` and ``"None"`` are three tenants, and user ``None``
      (the tenant's requests with no user), ``""`` and ``"None"`` three users; a user is only
      ever a user *of a tenant* ("bob" of acme is not "bob" of globex);
    * **reuse**: deterministic, and sharing everything isolation allows: the grader measures
      the hit rate on a fixed workload and requires the reference layout's (an over-keyed
      layout is isolated, and slow);
    * **errors**: ``TypeError`` for a tenant or user that is neither ``str`` nor ``None`` and for
      a secret that is not bytes; ``ValueError`` for a user without a tenant (``tenant=None``
      with a user), a short secret, or part boundaries out of order
      (``0 <= public_len <= tenant_end <= n_tokens`` must hold) or ``block_size < 1``.

    Stuck?  ``make hint EX=2d`` (three levels, one per call).
    """
    # BEGIN SOLUTION
    for name, value in (("tenant", tenant), ("user", user)):
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a str or None, got {value!r}")
    if tenant is None and user is not None:
        # users are named by their tenant's auth layer: a user with no tenant has no namespace
        raise ValueError(f"user {user!r} has no tenant: a user is always a user of some tenant")
    if block_size < 1 or not 0 <= public_len <= tenant_end <= n_tokens:
        raise ValueError(f"need block_size >= 1 and 0 <= public_len <= tenant_end <= n_tokens, got "
                         f"{block_size}, {public_len}, {tenant_end}, {n_tokens}")
    tenant_key = derive_tenant_key(engine_secret, tenant)  # checks the secret, too
    # The user's key is derived FROM the tenant's key, so a user name is bound to its tenant.
    user_key = hmac.digest(tenant_key, encode_fields(USER_LABEL, user), "sha256")
    layout: list[bytes | None] = []
    for i in range(n_tokens // block_size):
        end = (i + 1) * block_size  # the block's last token is end - 1: its strictest part decides
        layout.append(None if end <= public_len else tenant_key if end <= tenant_end else user_key)
    return layout
    # END SOLUTION
