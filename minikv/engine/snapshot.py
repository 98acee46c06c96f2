"""A frozen picture of the block pool, for visualizations, tests and lessons.

The engine's live state (the block manager, the scheduler's queues) changes on every
``step()``.  A lesson that wants to scrub back and forth through time therefore cannot keep a
reference to it; it needs *copies*.  ``LLMEngine.snapshot()`` builds one of these after each step,
and everything in ``minikv.viz`` draws from them alone, so drawing code never touches the engine.
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
    cached: bool  # registered in the prefix-cache hash table (can be hit)
    hash_hex: str | None  # short hex of the block hash, when cached
    tenant: str | None  # tenant of the request that wrote the block
    request_id: str | None  # request that wrote the block
    holders: tuple[str, ...] = ()  # request ids currently holding the block
    holder_tenants: tuple[str | None, ...] = ()
    public: bool = False  # inside an operator-declared shared prefix

    @property
    def state(self) -> str:
        """``"used"`` (held by a request), ``"cached"`` (free but hittable) or ``"free"``."""
        if self.ref_count > 0:
            return "used"
        return "cached" if self.cached else "free"

    @property
    def shared(self) -> bool:
        """Held by more than one request right now: the prefix cache at work."""
        return self.ref_count > 1

    @property
    def cross_tenant(self) -> bool:
        """Held at once by requests of different tenants: what isolation must prevent
        (except for public, operator-declared shared prefixes)."""
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
        return sum(b.state == "free" for b in self.blocks)

    @property
    def num_cached_free(self) -> int:
        return sum(b.state == "cached" for b in self.blocks)

    def blocks_per_tenant(self) -> dict[str, int]:
        """Blocks in use, counted by the tenant that wrote them (``"anon"`` for None)."""
        counts = Counter(tenant_label(b.tenant) for b in self.blocks if b.state == "used")
        return dict(sorted(counts.items()))

    def summary(self) -> str:
        """One line of text that describes the frame; tests and the browser check read it."""
        per = " ".join(f"{t}={n}" for t, n in self.blocks_per_tenant().items()) or "none"
        return (f"step {self.step}: used[{per}] free={self.num_free} "
                f"cached={self.num_cached_free} running={len(self.running)} "
                f"waiting={len(self.waiting)}")


def tenant_label(tenant: str | None) -> str:
    """How a tenant is shown to humans: the anonymous tenant is ``anon``."""
    return "anon" if tenant is None else tenant
