"""Prompts drawn token by token: which tokens a request shares with another, and which come from
the cache.

Lesson 04 uses ``draw_token_strips`` to show why the hash chain turns one right guess into many
skipped tokens: each strip is one prompt, one small square per token coloured by what kind of token
it is (known template, secret, wrong guess, the sender's own message), cut by vertical lines into
KV blocks, with a bar underneath that says which tokens were taken from the cache and which were
computed.  Lesson 05 uses ``draw_slot_grid`` to show the pool slot by slot: whose token each slot's
layer-0 K inverts to, and which stale slots a buggy attention read.  Both return an unregistered
Figure (see ``draw.py``).
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


def draw_slot_grid(kinds: Sequence[str], labels: Sequence[str], block_size: int,
                   colors: Mapping[str, tuple[str, str]], outlined: set[tuple[int, int]] = frozenset(),
                   outline: tuple[str, str] | None = None, title: str = "") -> Figure:
    """The KV pool slot by slot: one row per block, one cell per slot, coloured by its kind and
    labelled with its (inverted) token.  ``kinds`` and ``labels`` run over all slots in pool order
    (block 0 slot 0, block 0 slot 1, ...); ``colors`` maps a kind to ``(colour, legend text)``;
    ``outlined`` are ``(block, slot)`` pairs drawn with a thick border, ``outline`` = ``(colour,
    legend text)`` for that border (lesson 05: the stale slots an attacker's attention read)."""
    if block_size < 1 or len(kinds) % block_size:
        raise ValueError(f"{len(kinds)} slots do not make whole blocks of {block_size!r}")
    if len(labels) != len(kinds):
        raise ValueError(f"{len(labels)} labels for {len(kinds)} slots")
    unknown = set(kinds) - set(colors)
    if unknown:
        raise ValueError(f"no colour for slot kind(s) {sorted(unknown)}")
    num_blocks = len(kinds) // block_size
    edge = outline[0] if outline else "black"
    fig = new_figure(12, 0.55 * num_blocks + 0.9)
    ax = fig.add_subplot()
    for i, (kind, text) in enumerate(zip(kinds, labels)):
        b, s = divmod(i, block_size)
        read = (b, s) in outlined
        ax.add_patch(Rectangle((s, -b), 0.94, 0.9, fc=colors[kind][0], ec=edge if read else "white",
                               lw=2.2 if read else 0.5))
        if text:
            ax.text(s + 0.47, -b + 0.45, text, ha="center", va="center", fontsize=6.5)
    ax.set_xlim(-0.1, block_size)
    ax.set_ylim(-num_blocks + 0.9, 1.0)
    ax.set_yticks([-b + 0.45 for b in range(num_blocks)], [f"block {b}" for b in range(num_blocks)])
    ax.set_xticks([s + 0.47 for s in range(block_size)], range(block_size))
    ax.set_xlabel("slot")
    ax.tick_params(length=0)
    ax.set_title(title, fontsize=10)
    for side in ax.spines.values():
        side.set_visible(False)
    handles = [Patch(fc=color, label=text) for color, text in colors.values()]
    if outline:
        handles.append(Patch(fc="white", ec=outline[0], lw=2, label=outline[1]))
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=4, fontsize=8, frameon=False)
    return fig
