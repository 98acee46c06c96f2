"""Matplotlib drawing of pool layouts.  All decisions were made in ``layout.py``; this copies them.

Why ``Figure`` objects and not ``plt.subplots``?  pyplot keeps every figure it creates in a global
registry until someone calls ``plt.close``.  A widget that renders a PNG per slider position would
leak one figure per frame, and in a notebook a pyplot figure returned from a cell is shown twice
(once as the cell's value, once when the inline backend flushes).  A plain
:class:`matplotlib.figure.Figure` is never registered, is freed like any Python object, and -- via
:class:`ReprFigure` -- still shows itself once as a PNG when it is a cell's value.  So in a lesson
write ``fig = draw_pool(snap); fig`` (or ``display(fig)``); ``plt.show()`` is not needed.
"""
from __future__ import annotations

from collections.abc import Sequence
from io import BytesIO

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from minikv.engine.snapshot import PoolSnapshot
from minikv.viz.layout import (DEFAULT_MAX_COLS, OKABE_ITO, Cell, LegendEntry, PoolLayout,
                               assign_tenant_colors, blend, layout_pool)

CELL = 0.9  # side of a block square; the grid pitch is 1, so 0.1 of white gap
CELL_INCHES = 0.5
WARNING_COLOR = OKABE_ITO["vermillion"]


class ReprFigure(Figure):
    """A Figure that IPython displays as a PNG even when no inline backend is active."""

    def _repr_png_(self) -> bytes:
        return figure_to_png(self)


def new_figure(width: float, height: float) -> ReprFigure:
    """A fresh, unregistered figure (no pyplot state, nothing to close)."""
    return ReprFigure(figsize=(width, height), layout="constrained")


def figure_to_png(fig: Figure, dpi: int = 100) -> bytes:
    """Render ``fig`` to PNG bytes through Agg: the non-interactive path, safe in any kernel."""
    buf = BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, facecolor="white", bbox_inches="tight",
                pad_inches=0.1)
    return buf.getvalue()


def _draw_cell(ax: Axes, cell: Cell, show_ids: bool) -> None:
    x, y = cell.col, -cell.row
    if cell.state == "used" and cell.fill < 1.0:
        # Empty slots in a pale tint, written slots in full colour from the bottom up.
        ax.add_patch(Rectangle((x, y), CELL, CELL, facecolor=blend(cell.facecolor, amount=0.7),
                               edgecolor="none"))
        ax.add_patch(Rectangle((x, y), CELL, CELL * cell.fill, facecolor=cell.facecolor,
                               edgecolor="none"))
        face = "none"
    else:
        face = cell.facecolor
    ax.add_patch(Rectangle((x, y), CELL, CELL, facecolor=face, edgecolor=cell.edgecolor,
                           linewidth=cell.linewidth, linestyle=cell.linestyle,
                           hatch=cell.hatch))
    mid = CELL / 2
    if cell.label:
        ax.text(x + mid, y + mid, cell.label, ha="center", va="center", fontsize=10,
                fontweight="bold", color=cell.label_color,
                bbox=dict(boxstyle="round,pad=0.1", fc="white", ec="none", alpha=0.8)
                if cell.hatch else None)
    if cell.badge:
        # "!" on vermillion reads as a warning; "P" on black as a neutral note.  The symbol
        # itself carries the meaning, so colour-blind readers lose nothing.
        ax.text(x + CELL - 0.06, y + CELL - 0.06, cell.badge, ha="right", va="top",
                fontsize=8, fontweight="bold", color="white",
                bbox=dict(boxstyle="circle,pad=0.15", ec="none",
                          fc=WARNING_COLOR if cell.badge == "!" else "black"))
    if show_ids:
        ax.text(x + 0.05, y + 0.04, str(cell.block_id), ha="left", va="bottom", fontsize=5.5,
                color=cell.label_color if cell.state == "used" else "#555555", alpha=0.8)


def _legend_handles(entries: Sequence[LegendEntry]) -> list[Rectangle]:
    return [Rectangle((0, 0), 1, 1, facecolor=e.facecolor, edgecolor=e.edgecolor,
                      linewidth=e.linewidth, linestyle=e.linestyle, hatch=e.hatch, label=e.label)
            for e in entries]


def draw_layout(ax: Axes, layout: PoolLayout, show_ids: bool = True,
                legend: bool = True, title: str | None = None) -> None:
    """Draw a precomputed :class:`PoolLayout` onto ``ax``."""
    ax.set_aspect("equal")
    ax.axis("off")
    if not layout.cells:
        ax.text(0.5, 0.5, "(empty pool: 0 blocks)", ha="center", va="center",
                transform=ax.transAxes, color="#555555")
    for cell in layout.cells:
        _draw_cell(ax, cell, show_ids)
    ax.set_xlim(-0.1, max(layout.ncols, 1))
    ax.set_ylim(-max(layout.nrows, 1) + 0.9, 1.0)
    title = layout.summary if title is None else title
    if title:
        ax.set_title(title, fontsize=9, loc="left")
    if legend and layout.legend:
        ax.legend(handles=_legend_handles(layout.legend), loc="upper center",
                  bbox_to_anchor=(0.5, -0.02), ncol=min(4, len(layout.legend)), fontsize=8,
                  frameon=False, handlelength=2.0, handleheight=1.4)


def _figure_size(nrows: int, ncols: int, n_legend: int, legend: bool) -> tuple[float, float]:
    width = max(5.0, ncols * CELL_INCHES + 0.6)
    legend_rows = -(-n_legend // 4) if legend else 0
    return width, max(1, nrows) * CELL_INCHES + 0.6 + 0.3 * legend_rows


def draw_pool(snapshot: PoolSnapshot, ax: Axes | None = None, mode: str = "tenant",
              colors: dict[str, str] | None = None, max_cols: int = DEFAULT_MAX_COLS,
              show_ids: bool = True, legend: bool = True, title: str | None = None) -> Figure:
    """Draw the block pool of one snapshot; return the Figure (``ax.figure`` if ``ax`` given).

    ``mode="tenant"`` colours blocks by writer and labels ref counts (lesson 02);
    ``mode="sharing"`` highlights shared, cross-tenant and public blocks (lesson 03).
    ``title`` defaults to the frame's one-line summary.
    """
    lay = layout_pool(snapshot, mode=mode, colors=colors, max_cols=max_cols)
    if ax is None:
        fig = new_figure(*_figure_size(lay.nrows, lay.ncols, len(lay.legend), legend))
        ax = fig.add_subplot()
    draw_layout(ax, lay, show_ids=show_ids, legend=legend, title=title)
    return ax.figure


def _pick_frames(snapshots: Sequence[PoolSnapshot], steps: Sequence[int] | None,
                 max_panels: int) -> list[PoolSnapshot]:
    if steps is None:
        n = len(snapshots)
        k = min(n, max_panels)
        idx = sorted({round(i * (n - 1) / max(k - 1, 1)) for i in range(k)})
        return [snapshots[i] for i in idx]
    by_step = {s.step: s for s in snapshots}
    missing = [s for s in steps if s not in by_step]
    if missing:
        raise ValueError(f"no snapshot with step {missing}; available steps: {sorted(by_step)}")
    return [by_step[s] for s in steps]


def draw_frames_strip(snapshots: Sequence[PoolSnapshot], steps: Sequence[int] | None = None,
                      mode: str = "tenant", max_cols: int = DEFAULT_MAX_COLS,
                      panels_per_row: int = 2, show_ids: bool = False) -> Figure:
    """A static multi-panel picture of chosen frames, with one shared legend.

    Widgets only live in a running kernel; this gives the notebook a deterministic picture that
    survives export and review.  ``steps`` are ``PoolSnapshot.step`` values (default: up to four
    frames spread evenly from first to last).  Colours are assigned over *all* snapshots, so they
    match the interactive explorer.
    """
    if not snapshots:
        raise ValueError("draw_frames_strip needs at least one snapshot")
    frames = _pick_frames(snapshots, steps, max_panels=4)
    colors = assign_tenant_colors(snapshots)
    layouts = [layout_pool(s, mode=mode, colors=colors, max_cols=max_cols) for s in frames]
    nrows = max(lay.nrows for lay in layouts)
    ncols = max(lay.ncols for lay in layouts)
    per_row = max(1, min(panels_per_row, len(frames)))
    grid_rows = -(-len(frames) // per_row)
    w, h = _figure_size(nrows, ncols, 0, legend=False)
    legend_h = 0.3 * -(-len(layouts[0].legend) // 4) + 0.2
    fig = new_figure(w * per_row, h * grid_rows + legend_h)
    axes = fig.subplots(grid_rows, per_row, squeeze=False).ravel()
    for ax, lay, snap in zip(axes, layouts, frames):
        draw_layout(ax, lay, show_ids=show_ids, legend=False, title=f"step {snap.step}")
        ax.text(0, -0.02, lay.summary, transform=ax.transAxes, fontsize=7, va="top",
                color="#333333")
    for ax in axes[len(frames):]:
        ax.axis("off")
    fig.legend(handles=_legend_handles(layouts[0].legend), loc="outside lower center",
               ncol=min(4, len(layouts[0].legend)), fontsize=8, frameon=False,
               handlelength=2.0, handleheight=1.4)
    return fig
