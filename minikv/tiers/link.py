"""The tier link: the block manager's KV connector (torch-free bookkeeping above, sealed bytes below).

The block manager decides *when* a block leaves or re-enters the pool; this object does the
moving, through the block manager's hooks (``kv_connector`` and a listener: :func:`attach_tiers`,
which the composition root ``minikv.LLM`` runs; the engine imports nothing from here).  Each call
is one lifecycle transition (:mod:`~minikv.engine.lifecycle`):

* ``on_block_event`` (a block-manager listener): on ``store``, a full block is sealed and written
  to the ``"store"`` tiers (Redis), so other instances may hit it; its tier key is remembered
  (``keys``, by block id) until the block is evicted.  A re-keyed block (selective sharing's
  ``promote``/``isolate``) forgets its tier key: its stored copy was filed under its old domain,
  and is never offloaded under the new one.
* ``offload(block, seq)`` -- the ``offload`` transition, just before an ``evict``: the block is
  sealed and written to the ``"evict"`` tiers (host).  The lifecycle table then runs the scrub
  hook ``on_offload``: the pool's plaintext copy is zeroed, as the tier holds the K/V now.
* ``fetch(seq, i)`` + ``load(block_id, found)`` -- the ``onload`` transition: on a pool miss the
  tiers are asked in order; the first value that *verifies* (MAC, decryption: ``Sealer.open``) is
  copied into a free pool block, which is then registered like a block this engine computed.  A
  value that fails is dropped from its tier, counted (``stats["refused"]``), logged, never used.

Writers: a sealed value carries, inside its MAC and encryption, the fingerprint of the tenant that
wrote the block (``WRITER``: a keyed tag, never the name).  An onloaded block is then recorded in
the trail as *that* tenant's (the name if this instance has seen it, else ``tier-writer:<tag>``),
so a cross-tenant tier hit -- possible only under UNSAFE content keys -- is a cross-tenant hit in
this instance's own trail, not a block the reader seems to have written itself.  Byte quotas in
a shared store are charged to the API-key tenant (``security.domains.tenant_of``): a salted
domain is its tenant's, and a fresh salt is no fresh quota.

Blocking tiers (``blocking = True``: Redis) are called through :class:`~minikv.tiers.offthread.OffThread`:
off the step thread, with the tier's deadline; a stalled store is a miss, never a stalled step.

Keys (``tier_keys``): ``"tenant"`` (default) files a block under the hash the pool uses, keyed
with its tenant's key.  UNSAFE ``"content"`` files it under the same chain *without* any tenant
key and seals it in one shared domain: LMCache #4825's ``cache_salt=''``; a tenant on another
instance then hits -- and can time -- what this one's tenants cached, while each pool stays
tenant-keyed.
"""
from __future__ import annotations

import logging
import struct
import time

import torch

from ..engine.kv_connector import Found
from ..engine.lifecycle import Transition
from ..security.domains import tenant_of
from ..security.sealing import SealError, Sealer, binding, tier_key, tier_space
from .kv_tiers import make_tier
from .offthread import OffThread

log = logging.getLogger("minikv.tiers")

WRITER = struct.Struct("!4s8s")  # b"MKW1", then the writer's tenant tag: the head of every payload
WRITER_MAGIC = b"MKW1"
UNKNOWN_WRITER = "tier-writer:"  # + tag: a writer this instance has not served (another instance's tenant)
MAX_NAMES = 4096  # tags remembered per link (a salted domain is one more; the table is cleared when full)


class TierLink:
    def __init__(self, config, pool, blocks, hasher, secret: bytes, model, tiers=None):
        self.pool, self.pool_blocks, self.hasher, self.mode = pool, blocks, hasher, config.kv_tier_keys
        tiers = list(tiers) if tiers is not None else [make_tier(s) for s in config.kv_tiers]
        self.tiers = [OffThread(t, t.deadline) if getattr(t, "blocking", False) else t for t in tiers]
        self.sealer = Sealer(secret, encrypt=config.kv_tier_encrypt)
        self.bs = pool.block_size
        self.model = model.fingerprint()  # the weights' digest, not a path: see LlamaModel.fingerprint
        self.dtype = str(pool.dtype).removeprefix("torch.")
        self.geometry = (pool.num_layers, pool.block_size, pool.num_kv_heads, pool.head_dim)
        self.nbytes = pool.kv_blocks[0][0].nbytes * pool.num_layers  # one block, every layer, K and V
        self.stats = dict(offloaded=0, stored=0, onloaded=0, refused=0, misses=0, seal_s=0.0, open_s=0.0)
        self.hits_by_tier = {t.name: 0 for t in self.tiers}
        self.keys: dict[int, tuple] = {}  # block id -> (tier key, tokens, domain) while registered
        self._scratch = bytearray(WRITER.size + self.nbytes)  # fetch decrypts here; load copies it into the pool
        self._names: dict[str, str | None] = {}  # tenant tag -> the tenant, for those seen here

    def tag(self, tenant: str | None) -> str:
        """``tenant``'s opaque tag (``Sealer.tenant_tag``), remembered so a tier hit names it."""
        t = self.sealer.tenant_tag(tenant)
        if t not in self._names:
            if len(self._names) >= MAX_NAMES:
                self._names.clear()
            self._names[t] = tenant
        return t

    def writer_of(self, tag: str, reader: str | None) -> str | None:
        """The tenant that wrote a block, from the tag sealed in it: the reader itself, a tenant
        this instance has seen, or ``tier-writer:<tag>``."""
        if tag == self.tag(reader):
            return reader
        return self._names.get(tag, UNKNOWN_WRITER + tag)

    # ---------------------------------------------------------------- what a block is, in a tier
    @property
    def space(self) -> bytes:
        """This engine's part of the store (model, dtype, geometry): see ``sealing.tier_space``."""
        return tier_space(self.model, self.dtype, self.geometry)

    def key_of(self, seq, i: int) -> bytes:
        """The tier key of ``seq``'s block ``i``: its pool hash (tenant-keyed), or under UNSAFE
        ``"content"`` the chain of its tokens alone."""
        if self.mode == "tenant":
            return tier_key(self.space, seq.block_hashes[i])
        chain = seq.tier_hashes
        while len(chain) <= i:
            j = len(chain)
            chain.append(self.hasher(chain[j - 1] if j else None, seq.block_tokens(j, self.bs), (), None))
        return tier_key(self.space, chain[i])

    def domain_of(self, seq, i: int) -> tuple:
        """The encryption domain: the block's tenant key (a public block: "public"); one shared
        domain under ``"content"``, which is what lets another tenant decrypt it."""
        if self.mode == "content":
            return ("shared",)
        dk = seq.domain_key(i, self.bs)
        return ("domain", dk) if dk is not None else ("public",)

    def _bound(self, key: bytes, tokens) -> bytes:
        return binding(key, self.model, self.dtype, self.geometry, tokens)

    # ---------------------------------------------------------------- pool -> tiers
    def _seal_block(self, bid: int, key: bytes, tokens, domain: tuple, writer: str | None) -> bytes:
        kv = self.pool._kv[:, bid]  # [layers, bs, 2, heads, dim]: one block's K and V
        head = WRITER.pack(WRITER_MAGIC, bytes.fromhex(self.tag(writer)))
        payload = head + kv.contiguous().view(torch.uint8).cpu().numpy().tobytes()
        t0 = time.perf_counter()
        value = self.sealer.seal(payload, self._bound(key, tokens), domain)
        self.stats["seal_s"] += time.perf_counter() - t0
        return value

    def _write(self, block, when: str) -> int:
        targets = [t for t in self.tiers if t.when == when]
        if not targets or block.block_id not in self.keys:
            return 0
        key, tokens, domain = self.keys[block.block_id]
        value = self._seal_block(block.block_id, key, tokens, domain, block.writer_tenant)
        quota = self.sealer.tenant_tag(tenant_of(block.writer_tenant))  # the API-key tenant pays
        return sum(t.put(key, value, quota) for t in targets)

    def on_block_event(self, transition, ids: list[int], seq) -> None:
        if transition == Transition.STORE and seq is not None:
            pos = {bid: i for i, bid in enumerate(seq.block_table)}
            for bid in ids:
                i = pos[bid]
                self.keys[bid] = (self.key_of(seq, i), seq.block_tokens(i, self.bs), self.domain_of(seq, i))
                self.stats["stored"] += bool(self._write(self.pool_blocks[bid], "store"))
        elif transition in (Transition.PROMOTE, Transition.ISOLATE, Transition.EVICT):
            for bid in ids:
                self.keys.pop(bid, None)

    def offload(self, block, seq=None) -> bool:
        """Write ``block`` to the evict-into tiers (host) before the pool drops it."""
        done = bool(self._write(block, "evict"))
        self.stats["offloaded"] += done
        return done

    # ---------------------------------------------------------------- tiers -> pool
    def fetch(self, seq, i: int) -> Found | None:
        """A verified payload for ``seq``'s block ``i`` from the first tier that has one, or None.
        The payload is this link's scratch buffer: valid until the next ``fetch`` (``load`` it first)."""
        key = self.key_of(seq, i)
        tokens, domain = seq.block_tokens(i, self.bs), self.domain_of(seq, i)
        bound = self._bound(key, tokens)
        for tier in self.tiers:
            value = tier.get(key)
            if value is None:
                continue
            t0 = time.perf_counter()
            try:
                payload = self.sealer.open(value, bound, domain, out=self._scratch)
                if len(payload) != WRITER.size + self.nbytes or payload[:4] != WRITER_MAGIC:
                    raise SealError(f"payload of {len(payload)} bytes, expected a writer and {self.nbytes}")
            except SealError as exc:
                self.stats["refused"] += 1
                log.warning("kv tier %s: a value failed verification and was dropped: %s", tier.name, exc)
                tier.evict(key)
                continue
            finally:
                self.stats["open_s"] += time.perf_counter() - t0
            self.hits_by_tier[tier.name] += 1
            writer = self.writer_of(bytes(payload[4:WRITER.size]).hex(), seq.tenant)
            return Found((payload, (key, tokens, domain)), writer)
        self.stats["misses"] += 1
        return None

    def load(self, bid: int, found: Found) -> None:
        """Copy a verified payload (``Sealer.open``'s writable bytes) into pool block ``bid`` (every
        slot: nothing stale survives); the block is now filed under the key it came from."""
        payload, self.keys[bid] = found.data
        src = torch.frombuffer(payload, dtype=torch.uint8, offset=WRITER.size).view(self.pool.dtype)
        self.pool._kv[:, bid].copy_(src.view(self.pool._kv[:, bid].shape))
        self.stats["onloaded"] += 1


    def wait(self) -> None:
        """Wait until no tier call is still running off the step thread (tests, shutdown)."""
        for t in self.tiers:
            if isinstance(t, OffThread):
                t.wait()


def attach_tiers(engine) -> "TierLink | None":
    """Plug the tiers ``engine``'s config names in below its block manager (as its KV connector,
    plus a listener), and set ``engine.tiers`` to the link (None: no tier, the pool alone)."""
    c, bm = engine.config, engine.block_manager
    engine.tiers = None
    if not c.kv_tiers:
        return None
    link = TierLink(c, engine.pool, bm.blocks, bm.hasher, engine._secret, engine.model)
    bm.kv_connector = link
    bm.listeners.append(link.on_block_event)
    engine.tiers = link
    return link
