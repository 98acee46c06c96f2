"""Lesson 10, "Can we have both?": the cost/leak picture of every cache policy, one point each.

:func:`pareto_points` turns the report of :mod:`minikv.bench_sharing` (a dict: cost rows and leak
rows keyed by policy label) into one ``(label, hit rate, tokens leaked)`` triple per policy;
:func:`plot_pareto` draws them.  A policy is better the further right (more prefill saved) and
the lower (fewer secret tokens recovered by the strongest attacker the bench ran against it) it
sits; "strongest" means the most accounts tried, so the ``k_tenants`` points show the Sybil limit.
"""
from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from minikv.viz.plots import MARKERS, SERIES_COLORS, _axes, _tidy


def pareto_points(report: dict) -> list[tuple[str, float, int]]:
    """``(policy, Zipf hit rate, secret tokens leaked)`` per policy: for each secret, the most
    tokens any count-oracle run against that policy recovered (any number of accounts), summed."""
    out = []
    for label, cost in report["zipf"].items():
        leaked: dict[str, int] = {}
        for name, r in report["leaks"][label].items():
            if "recovered" in r:  # count-oracle rows: "<secret>" or "<secret>, <m> accounts"
                secret = name.split(",")[0]
                leaked[secret] = max(leaked.get(secret, 0), r["recovered"])
        out.append((label, cost["hit_rate"], sum(leaked.values())))
    return out


def plot_pareto(points: list[tuple[str, float, int]], max_leak: int, ax: Axes | None = None) -> Figure:
    """Hit rate (x) against secret tokens leaked (y), one labelled point per policy."""
    ax = _axes(ax, (7.0, 4.2))
    for i, (label, hit, leaked) in enumerate(points):
        ax.scatter([hit], [leaked], s=70, color=SERIES_COLORS[i % len(SERIES_COLORS)],
                   marker=MARKERS[i % len(MARKERS)], label=label, zorder=3)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("prefix-cache hit rate, Zipf workload (higher saves more prefill)")
    ax.set_ylabel(f"secret tokens recovered (of {max_leak})")
    ax.set_ylim(-1, max_leak + 2)
    ax.set_title("Can we have both? cost vs leak, one point per policy")
    ax.legend(fontsize=7, loc="center left", frameon=False)
    _tidy(ax)
    return ax.figure
