"""Prompts drawn token by token: which tokens a request shares with another, and which come from
the cache.

Lesson 04 uses ``draw_token_strips`` to show why the hash chain turns one right guess into many
skipped tokens: each strip is one prompt, one small square per token coloured by what kind of token
it is (known template, secret, wrong guess, the sender's own message), cut by vertical lines into
KV blocks, with a bar underneath that says which tokens were taken from the cache and which were
computed.  Returns an unregistered Figure (see ``draw.py``).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from minikv.viz.draw import new_figure
from minikv.viz.plots import HIT_COLOR, MISS_COLOR


def draw_token_strips(strips: Sequence[tuple[str, Sequence[str], int | None]], colors: Mapping[str, str],
                      block_size: int = 16, title: str = "") -> Figure:
    """One strip per ``(label, kinds, cached)``: ``kinds`` names each token's kind (a key of
    ``colors``); ``cached`` is how many leading tokens came from the cache (None: draw no cache bar).
    Block boundaries are drawn every ``block_size`` tokens."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size!r}")
    unknown = {k for _, kinds, _ in strips for k in kinds} - set(colors)
    if unknown:
        raise ValueError(f"no colour for token kind(s) {sorted(unknown)}")
    longest = max((len(kinds) for _, kinds, _ in strips), default=0)
    fig = new_figure(11, 1.1 * len(strips) + 0.1)
    ax = fig.add_subplot()
    for row, (label, kinds, cached) in enumerate(strips):
        y = 2.2 * (len(strips) - 1 - row)
        for i, kind in enumerate(kinds):
            ax.add_patch(Rectangle((i, y), 1, 1, facecolor=colors[kind], edgecolor="none"))
        for b in range(0, len(kinds) + 1, block_size):
            ax.plot([b, b], [y - 0.1, y + 1.1], color="black", linewidth=0.8)
        ax.text(-3, y + 0.5, label, ha="right", va="center", fontsize=9)
        if cached is not None:
            ax.add_patch(Rectangle((0, y - 0.55), cached, 0.3, facecolor=HIT_COLOR))
            ax.add_patch(Rectangle((cached, y - 0.55), len(kinds) - cached, 0.3, facecolor=MISS_COLOR))
    ax.set_xlim(-45, longest + 2)
    ax.set_ylim(-0.8, 2.2 * len(strips) - 0.9)
    ax.axis("off")
    handles = [Patch(color=c, label=k) for k, c in colors.items()]
    handles += [Patch(color=HIT_COLOR, label="taken from the cache"), Patch(color=MISS_COLOR, label="computed")]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=4, frameon=False, fontsize=8)
    if title:
        ax.set_title(title)
    return fig
