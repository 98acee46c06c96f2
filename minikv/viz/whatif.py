"""Lesson 03's live what-if widget: change a cache setting, re-run a workload, see what follows.

``PoolExplorer`` (``widgets.py``) replays snapshots that were computed once.  ``WhatIf`` instead
owns a *live* engine: every time a control changes, :func:`run_whatif` forks a fresh engine with
the chosen settings (``LLMEngine.fork`` shares the weights, so no reload), plays one small fixed
multi-tenant workload on it, and the widget redraws

* the block pool at the end of the run (``draw_pool(mode="sharing")``, the lesson's picture),
* the prefix-cache hit rate of each tenant (``plot_bars``),
* and how many block hits crossed a tenant boundary (a block written by one tenant, reused by
  another) -- the number that lesson 04 turns into an oracle.

Everything in a run is deterministic (greedy decoding, fixed prompts, a fresh pool each time), so
:meth:`WhatIfResult.summary` is one reproducible line of text: the unit tests, the static cell
under the widget and the browser test all assert on it.  Timing is *not* in that line: wall-clock
numbers differ between runs, counts do not.

How a cross-tenant hit is counted: the engine announces every block transition to its block
manager's ``listeners`` as ``(transition, block_ids, seq)``.  On ``"hit"`` (and ``"adopt"``, the
same reuse found at commit), each block's ``writer_tenant`` is compared with the requesting
``seq.tenant``.  Hits on blocks of an operator-declared public prefix (``block.public``) are
counted apart: sharing them is by design.

The default model is ``tiny-random`` (builds in about a second, a run takes well under a second
on a laptop CPU); pass a lesson's loaded ``LLM`` to drive SmolLM2 instead.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

from minikv.engine.config import CACHE_ISOLATION, SCRUB_POLICIES
from minikv.engine.lifecycle import REUSES
from minikv.engine.sampling import SamplingParams
from minikv.viz.draw import draw_pool, figure_to_png, new_figure
from minikv.viz.plots import plot_bars

SYSTEM = "You are the support assistant of Acme Bank. Answer politely."
# (tenant, question): alice and bob each repeat themselves (same-tenant hits); every request
# starts with the same system prompt (what a shared cache lets tenants reuse from each other).
WORKLOAD = (("alice", "How do I reset my password?"), ("bob", "What is the savings rate?"),
            ("alice", "How do I reset my password?"), ("carol", "Where is the nearest branch?"),
            ("bob", "What is the savings rate?"))
TENANTS = ("alice", "bob", "carol")
POOL_BLOCKS = 64
QUOTAS = ("unlimited", "default", 2, 4, 8)  # "default": None, the engine's quota (1/8 of the pool)
SUMMARY_CLASS = "minikv-whatif-summary"


@dataclass(frozen=True)
class Scenario:
    """The settings the widget's controls edit (``EngineConfig`` fields, except ``public_system``:
    True declares the system prompt an operator ``shared_prefixes`` entry).  The quota ``"default"``
    stands for ``None`` (a dropdown cannot hold None: ipywidgets reads it as "nothing selected")."""
    cache_isolation: str = "shared"
    block_size: int = 8
    scrub: str = "on_alloc"
    max_cached_blocks_per_tenant: int | str | None = "unlimited"
    public_system: bool = False

    def label(self) -> str:
        return (f"isolation={self.cache_isolation} block_size={self.block_size} scrub={self.scrub} "
                f"quota={self.max_cached_blocks_per_tenant} public_system={'on' if self.public_system else 'off'}")


@dataclass
class WhatIfResult:
    """What one run of the workload did: per-tenant token counts and the kinds of block hits."""
    scenario: Scenario
    cached: dict = field(default_factory=dict)  # tenant -> prompt tokens served from the cache
    prompt: dict = field(default_factory=dict)  # tenant -> prompt tokens sent
    same_tenant_hits: int = 0  # block hits on a block the same tenant wrote
    cross_tenant_hits: int = 0  # block hits on another tenant's private block: the leak
    public_hits: int = 0  # block hits on an operator-declared public block: by design
    snapshot: object = None  # the pool at the end (minikv.engine.snapshot.PoolSnapshot)

    def hit_rate(self, tenant: str) -> float:
        return self.cached[tenant] / self.prompt[tenant] if self.prompt.get(tenant) else 0.0

    def summary_parts(self) -> tuple[str, str, str]:
        """The settings, the hit rates, the hit counts: :meth:`summary` joins them with ``|``."""
        rates = " ".join(f"{t}={100 * self.hit_rate(t):.0f}%" for t in self.prompt)
        return (self.scenario.label(), f"hit rate {rates}",
                f"same-tenant hits={self.same_tenant_hits} cross-tenant hits={self.cross_tenant_hits} "
                f"public hits={self.public_hits}")

    def summary(self) -> str:
        return " | ".join(self.summary_parts())


def lines_html(*lines: str) -> str:
    """Text for an ``ipywidgets.HTML`` that wraps: one ``<div>`` per line.  A ``Label`` never
    wraps (its CSS is ``white-space: nowrap``): a long summary would run past the right edge."""
    return "".join(f'<div style="white-space: normal; overflow-wrap: anywhere; line-height: 1.4">'
                   f"{html.escape(line)}</div>" for line in lines)


def _system_ids(tok) -> list[int]:
    return tok(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n", add_special_tokens=False).input_ids


def _question_ids(tok, question: str) -> list[int]:
    return tok(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n",
               add_special_tokens=False).input_ids


def default_llm():
    """The tiny-random model with prefix caching on (built on first use)."""
    from minikv.llm import LLM
    return LLM("tiny-random", num_blocks=POOL_BLOCKS, enable_prefix_caching=True)


def run_whatif(llm, scenario: Scenario = Scenario()) -> WhatIfResult:
    """Fork ``llm`` with ``scenario``'s settings (a fresh, empty pool), play :data:`WORKLOAD` one
    request at a time (one output token each), and count what the cache did."""
    if scenario.cache_isolation not in CACHE_ISOLATION:
        raise ValueError(f"cache_isolation must be one of {CACHE_ISOLATION}, got {scenario.cache_isolation!r}")
    tok = llm.get_tokenizer()
    public = [_system_ids(tok)] if scenario.public_system else []
    quota = scenario.max_cached_blocks_per_tenant
    fork = llm.fork(num_blocks=POOL_BLOCKS, enable_prefix_caching=True, block_size=scenario.block_size,
                    cache_isolation=scenario.cache_isolation, scrub=scenario.scrub,
                    max_cached_blocks_per_tenant=None if quota == "default" else quota,
                    shared_prefixes=public)
    res = WhatIfResult(scenario, cached={t: 0 for t in TENANTS}, prompt={t: 0 for t in TENANTS})
    bm = fork.engine.block_manager

    def on_event(transition, ids, seq):
        if transition not in REUSES or seq is None:  # a hit, or an adoption at commit
            return
        for bid in ids:
            block = bm.blocks[bid]
            if block.public:
                res.public_hits += 1
            elif block.writer_tenant == seq.tenant:
                res.same_tenant_hits += 1
            else:
                res.cross_tenant_hits += 1

    bm.listeners.append(on_event)
    params = SamplingParams(max_tokens=1, temperature=0.0)
    for tenant, question in WORKLOAD:
        out = fork.generate([_system_ids(tok) + _question_ids(tok, question)], params, tenant=tenant)[0]
        res.cached[tenant] += out.num_cached_tokens
        res.prompt[tenant] += len(out.prompt_token_ids)
    bm.listeners.remove(on_event)  # the fork is dropped; no listener keeps it alive
    res.snapshot = fork.engine.snapshot()
    return res


def draw_whatif(res: WhatIfResult):
    """One figure: the pool after the run (left) and each tenant's hit rate (right).  The static
    fallback under the widget and the widget's own picture are this same figure."""
    fig = new_figure(12.0, 3.6)
    pool_ax, bar_ax = fig.subplots(1, 2, width_ratios=[2.2, 1])
    draw_pool(res.snapshot, ax=pool_ax, mode="sharing", show_ids=False,
              title=f"pool after the run; cross-tenant block hits: {res.cross_tenant_hits}")
    plot_bars(list(res.prompt), [100 * res.hit_rate(t) for t in res.prompt], ax=bar_ax,
              value_fmt="{:.0f}%", ylabel="prompt tokens from cache (%)", title="hit rate per tenant")
    bar_ax.set_ylim(0, 100)
    return fig


class WhatIf:
    """The widget: five controls, a summary (CSS class ``minikv-whatif-summary``: settings, hit
    rates and hit counts on lines of their own, so the counts stay in view at any width) and a
    picture.  ``whatif.isolation.value = "tenant"`` re-runs and redraws, exactly as a click does;
    ``whatif.result`` is the latest :class:`WhatIfResult`."""

    def __init__(self, llm=None, scenario: Scenario = Scenario(), dpi: int = 80) -> None:
        import ipywidgets as w
        self.llm = llm if llm is not None else default_llm()
        self.dpi = dpi
        self.isolation = w.Dropdown(options=CACHE_ISOLATION, value=scenario.cache_isolation,
                                    description="cache_isolation")
        self.block_size = w.Dropdown(options=(4, 8, 16, 32), value=scenario.block_size,
                                     description="block_size")
        self.scrub = w.Dropdown(options=SCRUB_POLICIES, value=scenario.scrub, description="scrub")
        self.quota = w.Dropdown(options=[("default (pool/8)" if q == "default" else str(q), q) for q in QUOTAS],
                                value=scenario.max_cached_blocks_per_tenant, description="quota")
        self.public = w.Checkbox(value=scenario.public_system, description="system prompt public")
        for c in (self.isolation, self.block_size, self.scrub, self.quota):
            c.style.description_width = "110px"
        self.isolation.add_class("minikv-whatif-isolation")
        self.summary = w.HTML(layout=w.Layout(width="auto"))  # three wrapping lines: see lines_html
        self.summary.add_class(SUMMARY_CLASS)
        self.image = w.Image(format="png")
        self.widget = w.VBox([w.HBox([self.isolation, self.block_size, self.scrub]),
                              w.HBox([self.quota, self.public]), self.summary, self.image])
        self.widget.add_class("minikv-whatif")
        for c in (self.isolation, self.block_size, self.scrub, self.quota, self.public):
            c.observe(self._on_change, names="value")
        self.refresh()

    @property
    def scenario(self) -> Scenario:
        return Scenario(self.isolation.value, self.block_size.value, self.scrub.value,
                        self.quota.value, self.public.value)

    def _on_change(self, _change) -> None:
        self.refresh()

    def refresh(self) -> WhatIfResult:
        """Re-run the workload with the controls' settings and redraw."""
        self.result = run_whatif(self.llm, self.scenario)
        self.summary.value = lines_html(*self.result.summary_parts())
        self.image.value = figure_to_png(draw_whatif(self.result), dpi=self.dpi)
        return self.result

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


__all__ = ["Scenario", "WhatIfResult", "run_whatif", "draw_whatif", "WhatIf", "WORKLOAD"]
