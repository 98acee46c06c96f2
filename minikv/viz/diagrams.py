"""Explanatory diagrams for the lessons: pictures of ideas, not of measurements.

Each function draws one figure that a lesson shows once (the threat model of lesson 00, causal
attention and grouped-query attention in lesson 01, the block life cycle of lesson 08).  They live
here so that the lesson cell is one call: the reader looks at the picture, not at forty lines of
box coordinates.  Every function returns an unregistered Figure (``draw.py`` explains why no pyplot).
"""
from __future__ import annotations

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch, Rectangle

from minikv.viz.draw import new_figure
from minikv.viz.layout import OKABE_ITO, TENANT_PALETTE

GOOD, BAD = OKABE_ITO["bluish_green"], OKABE_ITO["vermillion"]


def _canvas(width: float, height: float, xlim: float, ylim: float) -> tuple[Figure, Axes]:
    fig = new_figure(width, height)
    ax = fig.add_subplot()
    ax.set_xlim(0, xlim)
    ax.set_ylim(0, ylim)
    ax.axis("off")
    return fig, ax


def _box(ax: Axes, x, y, w, h, text, fc="white", ec="black", lw=1.2, fs=10, ls="solid", align="center"):
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.02,rounding_size=0.15",
                                fc=fc, ec=ec, lw=lw, ls=ls))
    tx = x + w / 2 if align == "center" else x + 0.15
    ax.text(tx, y + h / 2, text, ha=align, va="center", fontsize=fs)


def _arrow(ax: Axes, x0, y0, x1, y1, color="black", ls="-"):
    ax.add_patch(FancyArrowPatch((x0, y0), (x1, y1), arrowstyle="-|>", mutation_scale=12,
                                 color=color, linestyle=ls, lw=1.4))


def _badge(ax: Axes, x, y, n):
    ax.text(x, y, str(n), ha="center", va="center", fontsize=9, weight="bold", color="white",
            bbox=dict(boxstyle="circle,pad=0.25", fc=BAD, ec="none"))


def draw_threat_model() -> Figure:
    """Lesson 00: three tenants, one engine (scheduler, prefix cache, KV pool), what a tenant
    observes and what only the operator sets, and where the three leak classes sit (red badges)."""
    fig, ax = _canvas(11, 5.4, 11, 5.6)
    alice, bob, mallory = TENANT_PALETTE[0], TENANT_PALETTE[1], BAD
    for y, name, role, c in ((4.1, "alice", "victim", alice), (2.8, "bob", "bystander", bob),
                             (1.5, "mallory", "attacker", mallory)):
        _box(ax, 0.2, y, 1.9, 0.8, f"tenant {name}\n({role})", fc=c, fs=9.5)
        _arrow(ax, 2.15, y + 0.4, 3.0, y + 0.4)
    ax.add_patch(FancyBboxPatch((3.0, 0.9), 5.0, 4.5, boxstyle="round,pad=0.02,rounding_size=0.2",
                                fc="#F4F4F4", ec="black", lw=1.5))
    ax.text(5.5, 5.1, "one shared inference engine (one GPU, one KV pool)", ha="center", fontsize=9.5,
            weight="bold")
    _box(ax, 3.3, 4.0, 2.0, 0.75, "scheduler\n(continuous batching)", fs=8.5)
    _box(ax, 5.6, 4.0, 2.1, 0.75, "prefix cache\nhash(prefix) -> block", fs=8.5)
    ax.text(5.5, 3.5, "KV block pool", ha="center", fontsize=9)
    owners = [alice, alice, alice, bob, bob, None, mallory, mallory,
              "cached", alice, None, None, bob, None, "cached", None]
    for i, o in enumerate(owners):
        x, y = 3.55 + (i % 8) * 0.5, 2.7 - (i // 8) * 0.55
        if o == "cached":
            ax.add_patch(Rectangle((x, y), 0.42, 0.45, fc="white", ec=alice, lw=2, hatch="///"))
        else:
            ax.add_patch(Rectangle((x, y), 0.42, 0.45, fc=o or "#DDDDDD", ec="black" if o else "#BBBBBB",
                                   lw=0.8))
    ax.text(5.5, 1.3, "blocks outlive requests: hatched blocks are alice's, finished but still cached",
            ha="center", fontsize=8, style="italic")
    _box(ax, 8.6, 3.8, 2.3, 1.1, "what any tenant observes\n- the generated text\n- time to first token\n"
         "- usage.cached_tokens", fs=8, ec=mallory, lw=1.5, align="left")
    _arrow(ax, 8.0, 4.35, 8.6, 4.35, color=mallory)
    _box(ax, 8.6, 1.2, 2.3, 1.9, "what only the operator sets\n- isolation domain\n- hash function and keys\n"
         "- scrubbing of freed blocks\n- quotas and an audit log", fs=8, ec=OKABE_ITO["blue"], lw=1.5,
         ls="dashed", align="left")
    _arrow(ax, 8.6, 2.15, 8.0, 2.15, color=OKABE_ITO["blue"], ls="--")
    for x, y, n in ((7.85, 4.85, 1), (3.35, 2.2, 2), (5.75, 3.92, 3)):
        _badge(ax, x, y, n)
    for y, text in ((0.55, "(1) prefix-cache oracle: a hit on someone else's prefix is faster, and is "
                           "reported in cached_tokens"),
                    (0.3, "(2) stale blocks: a recycled block still holds the previous owner's K/V"),
                    (0.05, "(3) weak cache keys: two different prefixes land on the same cache entry")):
        ax.text(0.2, y, text, fontsize=8.5)
    ax.set_title("The threat model of this course", fontsize=12, loc="left")
    return fig


def draw_causal_attention(steps: int = 8) -> Figure:
    """Lesson 01: the query-key pairs computed at step ``steps`` without a cache (the whole lower
    triangle, in red) and with one (only the last row is new; grey was computed at earlier steps)."""
    if steps < 2:
        raise ValueError(f"steps must be at least 2, got {steps!r}")
    import matplotlib.colors as mcolors
    T = steps
    cmap = mcolors.ListedColormap(["white", "#DDDDDD", BAD])
    fig = new_figure(10, 4.6)
    axes = fig.subplots(1, 2)
    for ax, cached in zip(axes, (False, True)):
        rows, cols = np.tril_indices(T)
        grid = np.zeros((T, T))
        grid[rows, cols] = np.where(cached & (rows < T - 1), 1, 2)
        ax.imshow(grid, cmap=cmap, vmin=0, vmax=2)
        ax.set_xticks(range(T), [f"k{j}" for j in range(T)])
        ax.set_yticks(range(T), [f"q{i}" for i in range(T)])
        ax.set_xticks([x - 0.5 for x in range(1, T)], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, T)], minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
        work = T if cached else T * (T + 1) // 2
        ax.set_title(("with a KV cache" if cached else "without a cache")
                     + f": {work} query-key pairs at step {T}", fontsize=10)
        ax.set_xlabel("keys/values, one per token so far")
    axes[1].text(T - 0.3, 2.0, f"K/V of tokens 0-{T - 2} come\nfrom the cache; only\n"
                 f"k{T - 1}, v{T - 1} and q{T - 1} are new", fontsize=9, ha="right", va="center")
    handles = [Rectangle((0, 0), 1, 1, color=BAD), Rectangle((0, 0), 1, 1, color="#DDDDDD")]
    fig.legend(handles, ["computed at this step", "computed at an earlier step, not redone"],
               loc="outside lower center", ncol=2, frameon=False)
    fig.suptitle("Causal attention: earlier keys and values never change, so they can be kept", fontsize=11)
    return fig


def draw_gqa(num_heads: int, num_kv_heads: int) -> Figure:
    """Lesson 01: grouped-query attention -- each cached KV head serves a group of query heads."""
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads!r}) must be a positive multiple of num_kv_heads ({num_kv_heads!r})")
    group = num_heads // num_kv_heads
    palette = [OKABE_ITO[c] for c in ("orange", "sky_blue", "bluish_green", "yellow", "reddish_purple", "blue")]
    fig, ax = _canvas(9, 2.6, num_heads + 3.5, 2.4)
    ax.set_xlim(-0.2, num_heads + 3.5)
    ax.set_ylim(-0.2, 2.4)
    for i in range(num_heads):
        color = palette[(i // group) % len(palette)]
        ax.add_patch(Rectangle((i, 1.6), 0.8, 0.6, color=color))
        ax.text(i + 0.4, 1.9, f"q{i}", ha="center", va="center", fontsize=9)
        kv_x = (i // group) * group + (group - 1) / 2
        ax.plot([i + 0.4, kv_x + 0.4], [1.6, 0.6], color=color, lw=1.2)
    for h in range(num_kv_heads):
        x = h * group + (group - 1) / 2
        ax.add_patch(Rectangle((x, 0.0), 0.8, 0.6, facecolor=palette[h % len(palette)], edgecolor="black", lw=1.5))
        ax.text(x + 0.4, 0.3, f"kv{h}", ha="center", va="center", fontsize=9, weight="bold")
    ax.text(num_heads + 0.3, 1.9, f"{num_heads} query heads\n(not cached)", va="center", fontsize=9)
    ax.text(num_heads + 0.3, 0.3, f"{num_kv_heads} KV heads\n(cached, per token, per layer)", va="center", fontsize=9)
    ax.set_title(f"Grouped-query attention: {group} query heads share each cached KV head", fontsize=10, loc="left")
    return fig


def _state(ax: Axes, x, y, title, text, color):
    ax.add_patch(FancyBboxPatch((x - 1.25, y - 0.55), 2.5, 1.1, boxstyle="round,pad=0.05,rounding_size=0.2",
                                fc=color, ec="black", lw=1.2))
    ax.text(x, y + 0.2, title, ha="center", va="center", fontsize=11, weight="bold")
    ax.text(x, y - 0.22, text, ha="center", va="center", fontsize=8)


def _edge(ax: Axes, a, b, label, good, rad, label_at):
    color = GOOD if good else BAD
    ax.add_patch(FancyArrowPatch(a, b, connectionstyle=f"arc3,rad={rad}", arrowstyle="-|>", mutation_scale=14,
                                 color=color, lw=1.6, shrinkA=4, shrinkB=4))
    ax.text(*label_at, label, ha="center", va="center", fontsize=8, color="black",
            bbox=dict(boxstyle="round,pad=0.25", fc="white", ec=color, lw=1))


def draw_block_lifecycle() -> Figure:
    """Lesson 08: the three states of a KV block (free, used, cached) and its transitions, green
    where scrubbing is correct and red where it would destroy data someone is entitled to read.

    Each label sits on its arrow's arc: an arc3 curve with ``rad`` bulges by ``rad * length / 2``
    at its midpoint, so the label is placed there (the evict arrow is long, its label low)."""
    fig, ax = _canvas(11, 4.6, 11, 5)
    free, used, cached = (1.6, 2.5), (5.5, 2.5), (9.4, 2.5)
    _state(ax, *free, "free", "ref 0, not in the hash table\ncontents: whatever was last there", "#DDDDDD")
    _state(ax, *used, "used", "held by running requests\ncontents: their live K/V", OKABE_ITO["sky_blue"])
    _state(ax, *cached, "cached", "ref 0, in the hash table\ncontents: a prefix others may hit", "#FFFFFF")
    _edge(ax, (2.85, 2.9), (4.25, 2.9), "allocate (no hit)\non_alloc: scrub here", True, -0.35, (3.55, 3.6))
    _edge(ax, (4.25, 2.1), (2.85, 2.1), "release, not cached\non_free: scrub here", True, -0.35, (3.55, 1.4))
    _edge(ax, (6.75, 2.9), (8.15, 2.9), "release into the cache\nNEVER scrub: the cache\nexists to keep it", False,
          -0.35, (7.45, 3.75))
    _edge(ax, (8.15, 2.1), (6.75, 2.1), "hit\nNEVER scrub: another\nrequest reads it now", False, -0.35, (7.45, 1.25))
    # evict: a long arc from cached (right) back to free (left), bulging downwards below the states
    _edge(ax, (9.0, 1.9), (2.0, 1.9), "evict (LRU, only when a block is needed)\non_free: scrub here", True,
          -0.45, (5.5, 0.25))
    ax.set_title("KV block life cycle: green = a correct place to scrub, red = never", fontsize=11, loc="left")
    return fig
