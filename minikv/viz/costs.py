"""Charts of what caching saves, and of a published figure beside the one measured here.

Two kinds of lesson figure live here:

* ``plot_decode_cost`` (lesson 01): work per generated token (exact, from the token counts) next to
  time per generated token (this machine), with and without a KV cache;
* ``plot_published_vs_measured``: one horizontal bar per source, published values in grey with their
  citation in the label, the values measured in the notebook in colour, so that the comparison the
  course asks for ("the paper's number beside ours") is one picture.

Plain numbers in, an unregistered Figure out (see ``draw.py``).
"""
from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure

from minikv.viz.draw import new_figure
from minikv.viz.layout import OKABE_ITO
from minikv.viz.plots import HIT_COLOR, MISS_COLOR, _tidy

PUBLISHED_COLOR = "#9E9E9E"


def plot_decode_cost(positions: Sequence[int], t_cache: Sequence[float], t_nocache: Sequence[float]) -> Figure:
    """Left: token positions processed per decode step (1 with a cache, the whole sequence without).
    Right: the measured seconds per step, drawn in ms.  ``positions`` is the sequence length at each
    step; the two timing lists have one entry per step."""
    if not len(positions) == len(t_cache) == len(t_nocache):
        raise ValueError(f"{len(positions)} positions, {len(t_cache)} cached and {len(t_nocache)} "
                         "uncached timings: one of each per step")
    fig = new_figure(11, 3.8)
    work, time = fig.subplots(1, 2)
    work.plot(positions, [1] * len(positions), "o-", color=HIT_COLOR, label="with cache")
    work.plot(positions, positions, "s-", color=MISS_COLOR, label="without cache")
    work.set(xlabel="sequence length at this step", ylabel="token positions processed",
             title="work per generated token (exact)")
    time.plot(positions, [1e3 * t for t in t_cache], "o-", color=HIT_COLOR, label="with cache")
    time.plot(positions, [1e3 * t for t in t_nocache], "s-", color=MISS_COLOR, label="without cache")
    time.set(xlabel="sequence length at this step", ylabel="ms per step",
             title="time per generated token (this machine)")
    time.set_ylim(bottom=0)
    for ax in (work, time):
        ax.legend(frameon=False)
        _tidy(ax)
    return fig


def plot_published_vs_measured(rows: Sequence[tuple[str, float, bool]], xlabel: str, title: str,
                               value_fmt: str = "{:.2f}", reference: float | None = None) -> Figure:
    """Horizontal bars: ``rows`` are ``(label, value, measured)``; measured bars are coloured, published
    ones grey (put the citation in the label).  ``reference`` draws a dotted vertical line, e.g. 1.0
    for "no difference" or 0.5 for a chance AUC."""
    if not rows:
        raise ValueError("rows is empty: nothing to compare")
    fig = new_figure(8, 0.45 * len(rows) + 1.3)
    ax = fig.add_subplot()
    labels = [r[0] for r in rows]
    values = [float(r[1]) for r in rows]
    colors = [OKABE_ITO["vermillion"] if r[2] else PUBLISHED_COLOR for r in rows]
    bars = ax.barh(range(len(rows)), values, color=colors)
    ax.set_yticks(range(len(rows)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.bar_label(bars, labels=[value_fmt.format(v) for v in values], padding=2, fontsize=8)
    if reference is not None:
        ax.axvline(reference, color="black", linestyle=":", linewidth=1)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10, loc="left")
    ax.set_xlim(0, max(values) * 1.15)
    _tidy(ax)
    return fig
