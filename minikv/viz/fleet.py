"""Figures for lesson 10 (edge and multi-instance serving): the fleet, its router, churn, quotas.

Each function takes plain data that the lesson computed (numbers, lists, dicts) and returns an
unregistered :class:`~matplotlib.figure.Figure` (see ``draw.py`` for why no pyplot), so the lesson
cell shows the call and the experiment, not thirty lines of styling.  Colours follow the course
convention: vermillion for the insecure or attacker-favourable series, blue/green for the safe one.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from minikv.viz.draw import new_figure
from minikv.viz.layout import OKABE_ITO
from minikv.viz.plots import _tidy, draw_strip

_BOX = dict(boxstyle="round,pad=0.4", lw=1.2)


def _finish(ax: Axes, xlabel: str, ylabel: str, title: str) -> Figure:
    """Labels, a left-aligned title, the legend and no top/right spines: the lesson-10 chart style."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10, loc="left")
    ax.legend(fontsize=9)
    _tidy(ax)
    return ax.figure


def draw_fleet(num_instances: int = 3) -> Figure:
    """The setup of lesson 10: tenants -> router (with its index of recent routes) -> instances,
    each with its own pool, hash table, LRU, secret and audit trail, all reading one copy of the
    weights.  The router's index is the state that a single engine did not have."""
    if not 1 <= num_instances <= 5:
        raise ValueError(f"num_instances must be 1..5 to fit the picture, got {num_instances!r}")
    fig = new_figure(10, 3.4)
    ax = fig.add_subplot()
    ax.text(0.05, 0.5, "tenants\n(alice, bob,\nmallory, ...)", ha="center", va="center", fontsize=9,
            bbox=dict(_BOX, fc="#EEEEEE"))
    ax.text(0.32, 0.5, "router\nindex of recent routes:\nprefix hash -> instance", ha="center",
            va="center", fontsize=9, bbox=dict(_BOX, fc=OKABE_ITO["orange"], alpha=0.85))
    ys = [0.5] if num_instances == 1 else [0.85 - 0.7 * i / (num_instances - 1) for i in range(num_instances)]
    for i, y in enumerate(ys):
        ax.text(0.68, y, f"edge-{i}: own KV pool, hash table,\nLRU, secret, audit trail", ha="center",
                va="center", fontsize=9, bbox=dict(_BOX, fc=OKABE_ITO["sky_blue"], alpha=0.85))
        ax.annotate("", xy=(0.545, y), xytext=(0.435, 0.5), arrowprops=dict(arrowstyle="->", lw=1.2))
        ax.plot([0.82, 0.88], [y, 0.5], color="gray", lw=1, ls=":")
    ax.annotate("", xy=(0.2, 0.5), xytext=(0.11, 0.5), arrowprops=dict(arrowstyle="->", lw=1.2))
    ax.text(0.94, 0.5, "weights\n(one copy,\nread-only)", ha="center", va="center", fontsize=9,
            bbox=dict(_BOX, fc=OKABE_ITO["bluish_green"], alpha=0.85))
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.axis("off")
    ax.set_title("A fleet: the router remembers where each prefix went; instances share weights, "
                 "not caches", fontsize=10, loc="left")
    return fig


def plot_probe_ttfts(results: Mapping[str, tuple[Sequence[Mapping], float]]) -> Figure:
    """One column per fleet: the TTFT of every one-shot probe, right names (vermillion, left) and
    wrong names (blue, right) each as dots over a box of their quartiles, median printed above,
    and the attacker's own threshold (dashed).

    ``results`` maps a fleet label to ``(rows, threshold_s)``, each row a dict with ``right``
    (bool) and ``ttft`` (seconds).  Log scale: cold and cached prefills differ by a factor.
    """
    fig = new_figure(10, 4)
    ax = fig.add_subplot()
    arms = ((True, -0.2, OKABE_ITO["vermillion"]), (False, 0.2, OKABE_ITO["blue"]))
    for x, (rows, threshold) in enumerate(results.values()):
        for right, dx, color in arms:
            ms = np.array([1e3 * r["ttft"] for r in rows if r["right"] == right])
            if ms.size:
                draw_strip(ax, x + dx, ms, color, width=0.3)
        ax.hlines(threshold * 1e3, x - 0.4, x + 0.4, color="black", lw=1.2, ls="--", zorder=2)
    n = max((sum(r["right"] == right for r in rows) for rows, _ in results.values() for right in (True, False)),
            default=0)
    ax.scatter([], [], color=OKABE_ITO["vermillion"], label="probe with the right name")
    ax.scatter([], [], color=OKABE_ITO["blue"], label="probe with a wrong name")
    ax.plot([], [], color="black", ls="--", label="attacker's own threshold")
    ax.set_yscale("log")
    ax.set_xticks(range(len(results)), [label.replace(", ", ",\n") for label in results], fontsize=9)
    ax.set_ylabel("time to first token (ms, log)")
    ax.set_title(f"Every probe, up to {n} per guess and fleet (box: quartiles), against the attacker's "
                 "own threshold", fontsize=10, loc="left")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=3, frameon=False)
    _tidy(ax)
    return fig


def plot_churn(lifetimes: Sequence[int | None], hit_rates: Mapping[str, Sequence[float]],
               never_at: int = 60) -> Figure:
    """Prompt tokens served from cache (%) against instance lifetime, one line per router.

    ``lifetimes`` are requests served before a restart; ``None`` means never restarted and is
    drawn at ``never_at`` (the workload's length).  ``hit_rates`` maps a router label to one rate
    in [0, 1] per lifetime.
    """
    styles = ((OKABE_ITO["vermillion"], "o"), (OKABE_ITO["blue"], "s"), (OKABE_ITO["bluish_green"], "^"))
    xs = [k if k is not None else never_at for k in lifetimes]
    fig = new_figure(7.5, 3.8)
    ax = fig.add_subplot()
    for (label, rates), (color, marker) in zip(hit_rates.items(), styles):
        if len(rates) != len(xs):
            raise ValueError(f"{label!r}: {len(rates)} hit rates for {len(xs)} lifetimes")
        ax.plot(xs, [100 * h for h in rates], marker=marker, color=color, label=label)
    ax.set_xscale("log")
    ax.set_xticks(xs, [str(k) if k is not None else "never" for k in lifetimes])
    ax.minorticks_off()
    return _finish(ax, "instance lifetime (requests served before a restart)", "prompt tokens from cache (%)",
                   "Churn throws the cache away; prefix-aware routing recovers much of it sooner")


def plot_prime_and_probe(loads: Sequence[int], series: Mapping[str, Sequence[int]]) -> Figure:
    """The attacker's cached tokens at probe time against the victim's load, one step line per
    setting.  The first series is drawn thick (the defended one goes first, so the undefended
    staircase stays visible on top of it)."""
    styles = ((OKABE_ITO["bluish_green"], "s", 2.5, 7), (OKABE_ITO["vermillion"], "o", 1.5, 6))
    fig = new_figure(7.5, 3.8)
    ax = fig.add_subplot()
    for (label, values), (color, marker, lw, ms) in zip(series.items(), styles):
        if len(values) != len(loads):
            raise ValueError(f"{label!r}: {len(values)} values for {len(loads)} loads")
        ax.step(loads, values, where="mid", color=color, marker=marker, lw=lw, ms=ms, label=label)
    top = max(max(v) for v in series.values())
    ax.set_ylim(-0.05 * top - 1, 1.1 * top + 1)
    return _finish(ax, "victim requests between mallory's prime and probe", "mallory's probe: cached tokens",
                   "Prime-and-probe: the attacker's own hits measure the victim's load")
