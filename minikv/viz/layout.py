"""What to draw for one pool snapshot: pure data, no matplotlib.

Why a separate layer?  Drawing code is hard to test (you end up comparing pixels), while the
*decisions* -- which colour means which tenant, which block gets a warning mark, what number is
printed on it -- are exactly what a lesson relies on and what a bug would silently break.  So every
decision lives here, as plain dataclasses that a test can inspect, and ``draw.py`` only copies
them onto an ``Axes``.

Two modes, one per lesson:

``"tenant"`` (lesson 02, "who owns the pool?")
    face colour = tenant that wrote the block; free blocks light grey; cached blocks
    (evictable, still hittable) white with a hatch and an outline in the writer's colour; the
    label is the reference count.  Partly written blocks are filled bottom-up (``Cell.fill``), so
    you can watch decode fill the last block of a sequence.

``"sharing"`` (lesson 03, "who shares what?")
    same colours (the writer is who a leak exposes), plus marks: ``shared`` blocks (ref_count > 1) get a thick black border, ``cross_tenant`` blocks -- held at
    once by requests of *different* tenants, the leak that cache isolation must prevent -- get a
    dashed border and a ``!`` badge, and blocks of an operator-declared public prefix get a dotted
    border, a dot hatch and a ``P`` badge (cross-tenant sharing there is by design, so no ``!``).

Colours come from the Okabe-Ito palette (Okabe & Ito, 2008), designed to stay distinguishable
under the common forms of colour blindness.  Marks never rely on colour alone: warnings also
differ by line style and badge text, so the picture survives a greyscale printout.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from minikv.engine.lifecycle import crosses_tenants
from minikv.engine.snapshot import BlockView, PoolSnapshot, tenant_label

#: The eight Okabe-Ito colours, by their conventional names.
OKABE_ITO: dict[str, str] = {
    "black": "#000000",
    "orange": "#E69F00",
    "sky_blue": "#56B4E9",
    "bluish_green": "#009E73",
    "yellow": "#F0E442",
    "blue": "#0072B2",
    "vermillion": "#D55E00",
    "reddish_purple": "#CC79A7",
}

#: Order in which tenants get colours.  Black is kept for borders and text; yellow comes last
#: because it has the weakest contrast against the white/grey background.
TENANT_PALETTE: tuple[str, ...] = tuple(OKABE_ITO[n] for n in (
    "orange", "sky_blue", "bluish_green", "reddish_purple", "blue", "vermillion", "yellow"))

FREE_COLOR = "#DDDDDD"  # light grey: nothing here, nothing to leak
FREE_EDGE = "#BBBBBB"
CACHED_FACE = "#FFFFFF"  # cached (held by none, hittable): outline + hatch in the writer's colour
CACHED_HATCH = "///"
PUBLIC_HATCH = ".."
EDGE = "#000000"
MODES = ("tenant", "sharing")
DEFAULT_MAX_COLS = 16


@dataclass(frozen=True)
class Cell:
    """One block, ready to draw at grid position (row, col); row 0 is the top row."""

    block_id: int
    row: int
    col: int
    state: str  # "free" | "cached" | "used" (BlockView.state)
    tenant: str | None  # writer's tenant label ("anon" for None), None when free
    facecolor: str
    edgecolor: str
    linewidth: float
    linestyle: str  # "solid" | "dashed" | "dotted"
    hatch: str | None
    label: str  # reference count ("" for a free block)
    label_color: str  # black or white, whichever reads better on facecolor
    badge: str = ""  # "!" cross-tenant, "P" public prefix
    fill: float = 1.0  # fraction of the block's slots written (drawn bottom-up)
    shared: bool = False
    cross_tenant: bool = False
    public: bool = False

    @property
    def warning(self) -> bool:
        """Cross-tenant sharing outside a public prefix: the isolation failure to point at."""
        return self.cross_tenant and not self.public  # = crosses_tenants(holder tenants, public)


@dataclass(frozen=True)
class LegendEntry:
    """A swatch (styled like a cell) and the text explaining it."""

    label: str
    facecolor: str
    edgecolor: str = EDGE
    linewidth: float = 0.8
    linestyle: str = "solid"
    hatch: str | None = None


@dataclass(frozen=True)
class PoolLayout:
    """Everything ``draw.py`` needs for one frame."""

    mode: str
    nrows: int
    ncols: int
    cells: tuple[Cell, ...]
    legend: tuple[LegendEntry, ...]
    summary: str  # PoolSnapshot.summary(): the frame's one-line text
    block_size: int


def _tenants_of(snapshot: PoolSnapshot) -> set[str]:
    names = {tenant_label(b.tenant) for b in snapshot.blocks if b.request_id is not None
             or b.state != "free"}
    for b in snapshot.blocks:
        names.update(tenant_label(t) for t in b.holder_tenants)
    names.update(tenant_label(t) for t in snapshot.request_tenants.values())
    return names


def assign_tenant_colors(snapshots: PoolSnapshot | Iterable[PoolSnapshot]) -> dict[str, str]:
    """Map every tenant label seen in *any* frame to a palette colour.

    Assigning over all frames (sorted by name, ``anon`` last) keeps a tenant's colour fixed while
    the slider moves, even when the tenant only shows up halfway through: a colour that changed
    between frames would read as "a different tenant now owns this block".  With more than seven
    tenants the palette repeats; the legend still names each one.
    """
    if isinstance(snapshots, PoolSnapshot):
        snapshots = [snapshots]
    names: set[str] = set()
    for snap in snapshots:
        names |= _tenants_of(snap)
    ordered = sorted(names - {"anon"}) + (["anon"] if "anon" in names else [])
    return {name: TENANT_PALETTE[i % len(TENANT_PALETTE)] for i, name in enumerate(ordered)}


def grid_shape(num_blocks: int, max_cols: int = DEFAULT_MAX_COLS) -> tuple[int, int]:
    """Rows and columns for a pool: at most ``max_cols`` wide, block ids read left to right."""
    if num_blocks <= 0:
        return 0, 0
    ncols = max(1, min(num_blocks, max_cols))
    return math.ceil(num_blocks / ncols), ncols


def _rgb(hex_color: str) -> tuple[float, float, float]:
    h = hex_color.lstrip("#")
    return tuple(int(h[i:i + 2], 16) / 255 for i in (0, 2, 4))  # type: ignore[return-value]


def blend(hex_color: str, toward: str = "#FFFFFF", amount: float = 0.5) -> str:
    """Mix ``amount`` of ``toward`` into ``hex_color`` (used to fade and to tint)."""
    a, b = _rgb(hex_color), _rgb(toward)
    mixed = (round(255 * (x + (y - x) * amount)) for x, y in zip(a, b))
    return "#" + "".join(f"{v:02X}" for v in mixed)


def text_color_for(face: str) -> str:
    """Black or white text, by the WCAG relative luminance of the background."""
    def lin(c: float) -> float:
        return c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4
    r, g, b = (lin(c) for c in _rgb(face))
    luminance = 0.2126 * r + 0.7152 * g + 0.0722 * b
    # contrast vs white (1.05 / (L + 0.05)) against contrast vs black ((L + 0.05) / 0.05)
    return "#000000" if (luminance + 0.05) ** 2 > 1.05 * 0.05 else "#FFFFFF"


def _cell(block: BlockView, row: int, col: int, block_size: int, mode: str,
          colors: dict[str, str]) -> Cell:
    state = block.state
    fill = min(1.0, block.num_tokens / block_size) if block_size > 0 else 1.0
    common = dict(block_id=block.block_id, row=row, col=col, state=state,
                  shared=block.shared, cross_tenant=block.cross_tenant, public=block.public)
    if state == "free":
        return Cell(**common, tenant=None, facecolor=FREE_COLOR, edgecolor=FREE_EDGE,
                    linewidth=0.8, linestyle="solid", hatch=None, label="",
                    label_color="#000000", fill=fill)
    tenant = tenant_label(block.tenant)
    color = colors.get(tenant, FREE_EDGE)
    label = str(block.ref_count)
    if state == "cached":
        hatch = PUBLIC_HATCH if (mode == "sharing" and block.public) else CACHED_HATCH
        return Cell(**common, tenant=tenant, facecolor=CACHED_FACE, edgecolor=color,
                    linewidth=2.0, linestyle="solid", hatch=hatch, label=label,
                    label_color="#000000", badge="P" if mode == "sharing" and block.public
                    else "", fill=fill)
    if mode == "tenant":
        return Cell(**common, tenant=tenant, facecolor=color, edgecolor=EDGE, linewidth=0.8,
                    linestyle="solid", hatch=None, label=label,
                    label_color=text_color_for(color), fill=fill)
    # sharing mode, block in use: keep the writer's colour (who wrote it still matters: a
    # cross-tenant block leaks the *writer's* data) and let borders and badges mark sharing.
    face = color
    edge, width, style, hatch, badge = EDGE, 0.8, "solid", None, ""
    if block.public:
        width, style, hatch, badge = 2.5, "dotted", PUBLIC_HATCH, "P"
    elif crosses_tenants(block.holder_tenants, block.public):
        width, style, badge = 3.5, "dashed", "!"
    elif block.shared:
        width = 3.0
    return Cell(**common, tenant=tenant, facecolor=face, edgecolor=edge, linewidth=width,
                linestyle=style, hatch=hatch, label=label, label_color=text_color_for(face),
                badge=badge, fill=fill)


def legend_entries(mode: str, colors: dict[str, str]) -> tuple[LegendEntry, ...]:
    """The legend for ``mode``: every tenant in ``colors`` plus the meaning of each mark.

    It lists all marks even when a frame has none of them, so the legend does not jump around
    while the slider moves and a reader learns what to look for before it appears.
    """
    entries = [LegendEntry(f"tenant {name}", color) for name, color in colors.items()]
    entries += [LegendEntry("free", FREE_COLOR, FREE_EDGE),
                LegendEntry("cached (free, hittable)", CACHED_FACE, "#666666", 2.0,
                            hatch=CACHED_HATCH)]
    if mode == "sharing":
        entries += [
            LegendEntry("shared (ref > 1)", "#888888", EDGE, 3.0),
            LegendEntry("! cross-tenant share", "#888888", EDGE, 3.5, "dashed"),
            LegendEntry("P public prefix", "#888888", EDGE, 2.5, "dotted", PUBLIC_HATCH),
        ]
    return tuple(entries)


def layout_pool(snapshot: PoolSnapshot, mode: str = "tenant",
                colors: dict[str, str] | None = None,
                max_cols: int = DEFAULT_MAX_COLS) -> PoolLayout:
    """Turn one snapshot into drawable cells and a legend.

    Pass the ``colors`` of :func:`assign_tenant_colors` over *all* frames when drawing a
    sequence; by default only this snapshot's tenants are coloured.
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if colors is None:
        colors = assign_tenant_colors(snapshot)
    nrows, ncols = grid_shape(snapshot.num_blocks, max_cols)
    cells = tuple(_cell(b, i // ncols, i % ncols, snapshot.block_size, mode, colors)
                  for i, b in enumerate(snapshot.blocks))
    return PoolLayout(mode=mode, nrows=nrows, ncols=ncols, cells=cells,
                      legend=legend_entries(mode, colors), summary=snapshot.summary(),
                      block_size=snapshot.block_size)
