"""KV-cache isolation primitives: key encoding, block hashing, key derivation, scrubbing.

* :mod:`.encoding`   -- typed, length-prefixed field encoding (no ambiguous concatenation)
* :mod:`.keys`       -- engine secret -> per-tenant, shared and operator keys (server-side)
* :mod:`.hashing`    -- ``BlockHasher`` implementations and ``make_hasher(name, secret)``
* :mod:`.scrub`      -- ``Scrubber`` implementations and ``make_scrubber(name)``

Nothing here imports torch at import time, so the torch-free block manager can use it.  The
collision *search* against the unsafe hashers is attack tooling: :mod:`minikv.attacks.collisions`.
"""

from .encoding import decode_fields, encode_fields
from .hashing import HASHERS, UNSAFE_HASHES, BlockHasher, make_hasher
from .keys import derive_operator_key, derive_shared_key, derive_tenant_key, new_engine_secret
from .scrub import SCRUBBERS, UNSAFE_SCRUBBERS, NoScrub, Scrubber, ScrubOnAlloc, ScrubOnFree, make_scrubber

__all__ = [
    "encode_fields", "decode_fields",
    "BlockHasher", "HASHERS", "UNSAFE_HASHES", "make_hasher",
    "new_engine_secret", "derive_tenant_key", "derive_operator_key", "derive_shared_key",
    "Scrubber", "NoScrub", "ScrubOnFree", "ScrubOnAlloc", "SCRUBBERS", "UNSAFE_SCRUBBERS", "make_scrubber",
]
