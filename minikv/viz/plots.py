"""Reusable plot helpers for the lessons: plain arrays in, a matplotlib Figure out.

Each helper takes ``ax=None``: without it, it makes its own unregistered figure (see ``draw.py``
for why no pyplot); with it, it draws into your axes and returns ``ax.figure``, so several plots
can share one figure.  Colours are Okabe-Ito; "hit" is always blue and "miss" always orange, so
the timing plots of different lessons read the same way.

The ROC helpers are implemented here in numpy (not imported from ``minikv.audit.stats``) so that a
lesson can show the twenty lines that turn two lists of timings into an AUC: the AUC is the
probability that a random cache hit is faster than a random miss (ties count one half), i.e. the
Mann-Whitney U statistic divided by ``len(hit) * len(miss)``.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from minikv.audit.stats import roc_auc
from minikv.viz.draw import new_figure
from minikv.viz.layout import OKABE_ITO

HIT_COLOR = OKABE_ITO["blue"]
MISS_COLOR = OKABE_ITO["orange"]
SERIES_COLORS = (OKABE_ITO["blue"], OKABE_ITO["orange"], OKABE_ITO["bluish_green"],
                 OKABE_ITO["reddish_purple"], OKABE_ITO["sky_blue"], OKABE_ITO["vermillion"],
                 OKABE_ITO["yellow"])
MARKERS = ("o", "s", "^", "D", "v", "P", "X")


def _axes(ax: Axes | None, size: tuple[float, float] = (6.0, 4.0)) -> Axes:
    if ax is not None:
        return ax
    return new_figure(*size).add_subplot()


def _tidy(ax: Axes) -> None:
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)


def _as_array(x, name: str) -> np.ndarray:
    arr = np.asarray(x, dtype=float).ravel()
    if arr.size == 0:
        raise ValueError(f"{name} is empty")
    return arr


def plot_ttft_distributions(hit, miss, ax: Axes | None = None,
                            title: str = "Time to first token: cache hit vs miss",
                            unit: str = "ms", bins: int = 30) -> Figure:
    """Overlaid histograms of TTFT for hits and misses, with a dashed line at each median.

    Values are plotted as given, in ``unit``.  Shared bin edges make the two shapes comparable;
    the gap between the medians is the signal an attacker thresholds on.
    """
    hit, miss = _as_array(hit, "hit"), _as_array(miss, "miss")
    ax = _axes(ax)
    edges = np.histogram_bin_edges(np.concatenate([hit, miss]), bins=bins)
    for data, color, name in ((hit, HIT_COLOR, "hit"), (miss, MISS_COLOR, "miss")):
        med = float(np.median(data))
        ax.hist(data, bins=edges, color=color, alpha=0.55, edgecolor="white",
                label=f"{name} (n={data.size}, median {med:.3g} {unit})")
        ax.axvline(med, color=color, linestyle="--", linewidth=1.5)
    ax.set_xlabel(f"TTFT ({unit})")
    ax.set_ylabel("requests")
    ax.set_title(title)
    ax.legend(frameon=False)
    _tidy(ax)
    return ax.figure


def roc_curve(hit, miss) -> tuple[np.ndarray, np.ndarray]:
    """ROC points for "is this a hit?" with score = -time (faster means more likely a hit).

    Sweeping the threshold from strict to lax, a request is called a hit when its score is at
    least the threshold: TPR is the fraction of true hits caught, FPR the fraction of misses
    wrongly called hits.  Returns ``(fpr, tpr)`` from (0, 0) to (1, 1).
    """
    hit, miss = _as_array(hit, "hit"), _as_array(miss, "miss")
    scores = np.concatenate([-hit, -miss])
    is_hit = np.concatenate([np.ones(hit.size), np.zeros(miss.size)])
    order = np.argsort(-scores, kind="mergesort")
    scores, is_hit = scores[order], is_hit[order]
    # one ROC point per distinct threshold: the last index of each run of equal scores
    last = np.r_[np.nonzero(np.diff(scores))[0], scores.size - 1]
    tpr = np.r_[0.0, np.cumsum(is_hit)[last] / hit.size]
    fpr = np.r_[0.0, np.cumsum(1 - is_hit)[last] / miss.size]
    return fpr, tpr


def plot_roc(hit, miss, ax: Axes | None = None,
             published: Mapping[str, float | tuple[float, float]] | None = None,
             title: str = "Telling hits from misses by timing", label: str = "measured") -> Figure:
    """ROC curve of the timing classifier, its AUC in the legend, and the chance diagonal.

    ``published`` adds reference results: ``{"Gu et al. (GPT-4o)": 0.99}`` lists an AUC in the
    legend; ``{"paper, best threshold": (0.05, 0.93)}`` marks an operating point (FPR, TPR).
    """
    ax = _axes(ax, (5.0, 5.0))
    fpr, tpr = roc_curve(hit, miss)
    auc = roc_auc(hit, miss)  # = the area under this curve (trapezoids; ties count one half)
    ax.plot(fpr, tpr, color=HIT_COLOR, linewidth=2, drawstyle="default",
            label=f"{label} (AUC = {auc:.2f})")
    ax.plot([0, 1], [0, 1], color="#999999", linestyle=":", linewidth=1,
            label="chance (AUC = 0.50)")
    for i, (name, ref) in enumerate((published or {}).items()):
        color = SERIES_COLORS[(i + 1) % len(SERIES_COLORS)]
        if isinstance(ref, (tuple, list)):
            ax.plot([ref[0]], [ref[1]], linestyle="none", marker=MARKERS[i % len(MARKERS)],
                    markersize=8, color=color, label=f"{name} (FPR {ref[0]:.2f}, TPR {ref[1]:.2f})")
        else:
            ax.plot([], [], linestyle="none", marker=MARKERS[i % len(MARKERS)], color=color,
                    label=f"{name} (published AUC = {float(ref):.2f})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1.01)
    ax.set_aspect("equal")
    ax.set_xlabel("false positive rate (misses called hits)")
    ax.set_ylabel("true positive rate (hits detected)")
    ax.set_title(title)
    ax.legend(loc="lower right", frameon=False, fontsize=8)
    _tidy(ax)
    return ax.figure


def plot_hit_rate_vs_tenants(ns: Sequence[int], rates_by_label: Mapping[str, Sequence[float]],
                             ax: Axes | None = None,
                             title: str = "Prefix-cache hit rate vs number of tenants",
                             ylabel: str = "hit rate") -> Figure:
    """One line per configuration (e.g. isolation mode), hit rate in [0, 1] shown as percent.

    Isolation costs hit rate exactly when tenants would have shared prefixes; plotting against
    the tenant count shows how that cost grows.
    """
    ax = _axes(ax)
    for i, (name, rates) in enumerate(rates_by_label.items()):
        if len(rates) != len(ns):
            raise ValueError(f"{name!r}: {len(rates)} rates for {len(ns)} tenant counts")
        ax.plot(ns, rates, color=SERIES_COLORS[i % len(SERIES_COLORS)],
                marker=MARKERS[i % len(MARKERS)], linewidth=2, label=name)
    ax.set_xlabel("tenants sharing the engine")
    ax.set_ylabel(ylabel)
    ax.set_xticks(list(ns))
    ax.set_ylim(0, 1.05)
    ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
    ax.set_title(title)
    ax.legend(frameon=False)
    ax.grid(axis="y", alpha=0.3)
    _tidy(ax)
    return ax.figure


def plot_bars(labels: Sequence[str], values: Sequence[float], ax: Axes | None = None,
              title: str | None = None, ylabel: str | None = None,
              colors: Sequence[str] | None = None, value_fmt: str = "{:.2f}",
              horizontal: bool = False) -> Figure:
    """A plain bar chart with each value printed on its bar (no need to read an axis).

    One colour by default: the bars differ by their label, not their hue.  Pass ``colors``
    (one per bar) to single out e.g. the insecure configuration.
    """
    if len(labels) != len(values):
        raise ValueError(f"{len(labels)} labels for {len(values)} values")
    ax = _axes(ax, (max(4.0, 0.9 * len(labels) + 1.5), 3.5) if not horizontal
               else (6.0, max(2.5, 0.45 * len(labels) + 1.0)))
    colors = list(colors) if colors else [OKABE_ITO["blue"]] * len(labels)
    pos = np.arange(len(labels))
    if horizontal:
        bars = ax.barh(pos, values, color=colors)
        ax.set_yticks(pos, labels)
        ax.invert_yaxis()
        if ylabel:
            ax.set_xlabel(ylabel)
    else:
        bars = ax.bar(pos, values, color=colors)
        ax.set_xticks(pos, labels)
        if ylabel:
            ax.set_ylabel(ylabel)
    ax.bar_label(bars, labels=[value_fmt.format(v) for v in values], padding=2, fontsize=8)
    if title:
        ax.set_title(title)
    _tidy(ax)
    return ax.figure


def draw_strip(ax: Axes, x: float, values: np.ndarray, color: str, width: float = 0.5) -> None:
    """One arm of a timing strip at ``x``: a box of its quartiles (whiskers, no fliers), every value
    as a dot spread evenly across the box (outliers included, the same picture on every call), and
    the median printed above the highest dot."""
    ax.boxplot(values, positions=[x], widths=width, showfliers=False, medianprops=dict(color="black"),
               boxprops=dict(color=color), whiskerprops=dict(color=color), capprops=dict(color=color))
    spread = np.linspace(-0.36 * width, 0.36 * width, values.size) if values.size > 1 else np.zeros(1)
    ax.scatter(x + spread, values, s=14, color=color, alpha=0.8, zorder=3)
    mid = float(np.median(values))
    ax.annotate(f"median {mid:,.0f}" if abs(mid) >= 100 else f"median {mid:.3g}", (x, float(values.max())),
                xytext=(0, 4), textcoords="offset points", ha="center", fontsize=8)


def plot_timing_strip(groups: Mapping[str, Sequence[float]], ax: Axes | None = None,
                      title: str | None = None, ylabel: str = "TTFT (ms)",
                      colors: Sequence[str] | None = None, log: bool = False) -> Figure:
    """Every repeat of every arm as a dot, over a box of its quartiles, median printed above.

    A timing comparison is a comparison of distributions: one pair of bars cannot tell a gap from
    noise, and the dots and boxes show both.  ``groups`` maps an arm's label to its values (in the
    unit ``ylabel`` names); dots are spread evenly across each box, so the picture is the same on
    every call.
    """
    data = {label: _as_array(values, label) for label, values in groups.items()}
    ax = _axes(ax, (max(4.0, 1.2 * len(data) + 1.5), 3.5))
    colors = list(colors) if colors else list(SERIES_COLORS)
    for i, (label, values) in enumerate(data.items()):
        draw_strip(ax, i, values, colors[i % len(colors)])
    ax.set_xticks(range(len(data)), [f"{label}\n(n={v.size})" for label, v in data.items()])
    if log:
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.margins(y=0.12)
    _tidy(ax)
    return ax.figure


def plot_granularity_sweep(block_sizes: Sequence[int], probes_per_token: Sequence[float],
                           ax: Axes | None = None,
                           title: str = "Cost of a prompt-stealing attack vs block size",
                           logy: bool = False) -> Figure:
    """Probes an attacker needs per recovered token, against the cache's block size.

    The cache only answers "hit or miss" per whole block, so bigger blocks make each guess cover
    more unknown tokens and the search space per probe grows.  The x axis is log2 because block
    sizes are powers of two; pass ``logy=True`` when the costs span orders of magnitude.
    """
    if len(block_sizes) != len(probes_per_token):
        raise ValueError(f"{len(block_sizes)} block sizes for {len(probes_per_token)} values")
    ax = _axes(ax)
    ax.plot(block_sizes, probes_per_token, color=OKABE_ITO["vermillion"], marker="o",
            linewidth=2)
    ax.set_xscale("log", base=2)
    ax.set_xticks(list(block_sizes), [str(b) for b in block_sizes])
    ax.minorticks_off()
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel("block size (tokens per KV block)")
    ax.set_ylabel("probes per recovered token")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    _tidy(ax)
    return ax.figure
