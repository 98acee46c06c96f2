"""Lesson 10, "Can we have both?": the cost/leak picture of every cache policy, one point each.

:func:`pareto_points` turns the report of :mod:`minikv.bench.sharing` (cost rows and leak rows
keyed by policy label) into one point per policy; :func:`plot_pareto` draws them.  A policy is
better the further right (more prefill saved) and the lower (fewer secret tokens recovered) it
sits.  A ``k_tenants`` policy gets two: one attacker account, and k-1 accounts (the Sybil limit).
"""
from __future__ import annotations

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import PercentFormatter

from minikv.viz.plots import MARKERS, SERIES_COLORS, _axes, _tidy


def pareto_points(report: dict) -> list[tuple[str, float, int, int, int]]:
    """Per policy: ``(label, Zipf hit rate, tokens leaked to one account, tokens leaked to the most
    accounts tried, that number of accounts)``.  Tokens leaked: for each secret, what the
    count-oracle run recovered, summed over the secrets."""
    out = []
    for label, cost in report["zipf"].items():
        by_accounts: dict[int, int] = {}
        for r in report["leaks"][label].values():
            if "recovered" in r:
                by_accounts[r["accounts"]] = by_accounts.get(r["accounts"], 0) + r["recovered"]
        most = max(by_accounts)
        out.append((label, cost["hit_rate"], by_accounts[1], by_accounts[most], most))
    return out


def plot_pareto(points, max_leak: int, ax: Axes | None = None) -> Figure:
    """Hit rate (x) against secret tokens leaked (y), one labelled point per policy: filled for an
    attacker with one account; hollow, joined by a dashed line, where more accounts leak more."""
    ax = _axes(ax, (7.0, 4.2))
    for i, (label, hit, one, most, accounts) in enumerate(points):
        color, marker = SERIES_COLORS[i % len(SERIES_COLORS)], MARKERS[i % len(MARKERS)]
        ax.scatter([hit], [one], s=70, color=color, marker=marker, label=label, zorder=3)
        if most > one:
            ax.plot([hit, hit], [one, most], color=color, linestyle="--", linewidth=1, zorder=2)
            ax.scatter([hit], [most], s=70, facecolors="none", edgecolors=color, marker=marker, zorder=3)
            ax.annotate(f"{accounts} accounts", (hit, most), textcoords="offset points", xytext=(-4, 6 + 9 * (i % 2)),
                        ha="right", fontsize=7, color=color)
    ax.xaxis.set_major_formatter(PercentFormatter(1.0))
    ax.set_xlabel("prefix-cache hit rate, Zipf workload (higher saves more prefill)")
    ax.set_ylabel(f"secret tokens recovered (of {max_leak})")
    ax.set_ylim(-1, max_leak + 4)
    ax.set_title("Can we have both? cost vs leak (filled: 1 attacker account; hollow: k-1)")
    ax.legend(fontsize=7, loc="center left", frameon=False)
    _tidy(ax)
    return ax.figure
