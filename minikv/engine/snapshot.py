"""A frozen picture of the block pool, for visualizations, tests and lessons.

The engine's live state (the block manager, the scheduler's queues) changes on every
``step()``.  A lesson that wants to scrub back and forth through time therefore cannot keep a
reference to it; it needs *copies*.  ``LLMEngine.snapshot()`` builds one of these (with
:func:`capture`) when asked, and everything in ``minikv.viz`` draws from them alone, so drawing
code never touches the engine.  What only a picture needs -- who holds each block -- is worked
out here, from the running sequences' block tables, never tracked while the engine runs.

The words are those of ``minikv.engine.lifecycle``: a block is ``free``, ``used`` or ``cached``
(ref count 0 but hittable, so evictable); ``registered`` (in the hash table) covers cached blocks
and used ones that others may hit.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BlockView:
    """One physical KV block, as seen at one instant."""

    block_id: int
    ref_count: int  # running sequences whose block table holds this block
    num_tokens: int  # slots written so far (0..block_size)
    registered: bool  # in the prefix-cache hash table (can be hit): cached, or used and stored
    hash_hex: str | None  # short hex of the block hash, when registered
    tenant: str | None  # tenant of the request that wrote the block
    request_id: str | None  # request that wrote the block
    holders: tuple[str, ...] = ()  # request ids currently holding the block
    holder_tenants: tuple[str | None, ...] = ()
    public: bool = False  # inside an operator-declared shared prefix

    @property
    def state(self) -> str:
        """``"used"`` (held by a request), ``"cached"`` (held by none, hittable) or ``"free"``."""
        if self.ref_count > 0:
            return "used"
        return "cached" if self.registered else "free"

    @property
    def shared(self) -> bool:
        """Held by more than one request right now: the prefix cache at work."""
        return self.ref_count > 1

    @property
    def cross_tenant(self) -> bool:
        """Held at once by requests of different tenants (a public block may be: see
        ``lifecycle.crosses_tenants``)."""
        return len(set(self.holder_tenants)) > 1


@dataclass(frozen=True)
class PoolSnapshot:
    """The whole pool plus the scheduler's queues after one engine step."""

    step: int
    block_size: int
    blocks: tuple[BlockView, ...]  # index == block_id
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    request_tenants: dict = field(default_factory=dict)  # request_id -> tenant

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        """Blocks on the free list (not the cached ones: see ``num_cached``)."""
        return sum(b.state == "free" for b in self.blocks)

    @property
    def num_cached(self) -> int:
        """Blocks held by no request but kept for hits (evictable)."""
        return sum(b.state == "cached" for b in self.blocks)

    def blocks_per_tenant(self) -> dict[str, int]:
        """Blocks in use, counted by the tenant that wrote them (``"anon"`` for None)."""
        counts = Counter(tenant_label(b.tenant) for b in self.blocks if b.state == "used")
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        """One line of text that describes the frame; tests and the browser check read it."""
        per = " ".join(f"{t}={n}" for t, n in self.blocks_per_tenant().items()) or "none"
        return (f"step {self.step}: used[{per}] free={self.num_free} "
                f"cached={self.num_cached} running={len(self.running)} "
                f"waiting={len(self.waiting)}")


def capture(block_manager, step: int, running=(), waiting=()) -> PoolSnapshot:
    """Copy ``block_manager``'s pool and the scheduler's queues (sequences).  A block's holders
    are the running sequences whose block table holds it, in the order they were admitted."""
    holders: dict[int, list] = {}
    for seq in running:
        for bid in seq.block_table:
            holders.setdefault(bid, []).append(seq)
    views = tuple(
        BlockView(b.block_id, b.ref_count, b.num_tokens, b.hash is not None,
                  b.hash.hex()[:8] if b.hash is not None else None, b.writer_tenant, b.writer_request,
                  tuple(s.request_id for s in holders.get(b.block_id, ())),
                  tuple(s.tenant for s in holders.get(b.block_id, ())), b.public)
        for b in block_manager.blocks)
    return PoolSnapshot(step, block_manager.block_size, views, tuple(s.request_id for s in running),
                        tuple(s.request_id for s in waiting), {s.request_id: s.tenant for s in (*running, *waiting)})


def tenant_label(tenant: str | None) -> str:
    """How a tenant is shown to humans: the anonymous tenant is ``anon``."""
    return "anon" if tenant is None else tenant
