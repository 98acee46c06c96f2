"""Visualizations of the KV block pool and reusable plots for the lessons.

Three layers, each usable on its own:

* ``layout`` -- pure functions: snapshot -> cells + legend (what to draw; unit-testable);
* ``draw``   -- matplotlib: ``draw_pool``, ``draw_frames_strip`` (static pictures);
* ``widgets`` -- ipywidgets: ``PoolExplorer`` (a slider through ``step()`` snapshots).

``plots`` holds the lesson charts (TTFT histograms, ROC/AUC, hit rate, bars, block-size sweep).
Everything reads :class:`minikv.engine.snapshot.PoolSnapshot` only, never the live engine.
``PoolExplorer`` is imported lazily so that scripts without ipywidgets can still draw.
"""
from minikv.viz.draw import draw_frames_strip, draw_pool, figure_to_png
from minikv.viz.layout import (OKABE_ITO, TENANT_PALETTE, Cell, LegendEntry, PoolLayout,
                               assign_tenant_colors, layout_pool)
from minikv.viz.plots import (plot_bars, plot_granularity_sweep, plot_hit_rate_vs_tenants,
                              plot_roc, plot_timing_strip, plot_ttft_distributions, roc_curve)

__all__ = [
    "OKABE_ITO", "TENANT_PALETTE", "Cell", "LegendEntry", "PoolLayout", "assign_tenant_colors",
    "layout_pool", "draw_pool", "draw_frames_strip", "figure_to_png", "PoolExplorer",
    "render_png", "plot_ttft_distributions", "plot_roc", "roc_curve",
    "plot_hit_rate_vs_tenants", "plot_bars", "plot_granularity_sweep", "plot_timing_strip",
]


def __getattr__(name: str):
    if name in ("PoolExplorer", "render_png", "pool_explorer"):
        from minikv.viz import widgets
        return getattr(widgets, name)
    raise AttributeError(f"module 'minikv.viz' has no attribute {name!r}")
