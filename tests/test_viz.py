"""Tests for minikv.viz, on hand-made snapshots (no engine needed).

Run with ``MPLBACKEND=Agg .venv/bin/python -m pytest tests/test_viz.py``.
"""
from __future__ import annotations

import itertools

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.figure import Figure  # noqa: E402

from minikv.audit.stats import roc_auc  # noqa: E402
from minikv.engine.snapshot import BlockView, PoolSnapshot  # noqa: E402
from minikv.viz import (OKABE_ITO, TENANT_PALETTE, assign_tenant_colors, draw_frames_strip,  # noqa: E402
                        draw_pool, layout_pool, plot_bars, plot_granularity_sweep,
                        plot_hit_rate_vs_tenants, plot_roc, plot_ttft_distributions, roc_curve)
from minikv.viz.layout import (CACHED_HATCH, FREE_COLOR, blend, grid_shape,  # noqa: E402
                               text_color_for)
from minikv.viz.widgets import SUMMARY_CLASS, PoolExplorer  # noqa: E402

BS = 4
NUM_BLOCKS = 12


# ---- hand-made snapshots ----------------------------------------------------------------------
def free(i: int) -> BlockView:
    return BlockView(i, 0, 0, False, None, None, None)


def used(i: int, writer: tuple[str, str | None], holders: list[tuple[str, str | None]],
         tokens: int = BS, public: bool = False) -> BlockView:
    rid, tenant = writer
    return BlockView(i, len(holders), tokens, tokens == BS, "ab12cd34" if tokens == BS else None,
                     tenant, rid, tuple(h[0] for h in holders), tuple(h[1] for h in holders),
                     public)


def cached(i: int, writer: tuple[str, str | None]) -> BlockView:
    return BlockView(i, 0, BS, True, "ffee0011", writer[1], writer[0])


def snap(step: int, blocks: dict[int, BlockView], running=(), waiting=()):
    full = tuple(blocks.get(i, free(i)) for i in range(NUM_BLOCKS))
    tenants = {r: TENANTS[r] for r in (*running, *waiting)}
    return PoolSnapshot(step, BS, full, tuple(running), tuple(waiting), tenants)


A1, A2, B1, C1, Z1, N1 = (("a1", "alice"), ("a2", "alice"), ("b1", "bob"), ("c1", "carol"),
                          ("z1", "aaron"), ("n1", None))
TENANTS = {"a1": "alice", "a2": "alice", "b1": "bob", "c1": "carol", "z1": "aaron", "n1": None}


@pytest.fixture
def frames() -> list[PoolSnapshot]:
    f1 = snap(1, {0: used(0, A1, [A1]), 1: used(1, A1, [A1], tokens=2)},
              running=["a1"], waiting=["b1"])
    f2 = snap(2, {
        0: used(0, A1, [A1, B1], public=True),   # operator-declared public prefix
        1: used(1, A1, [A1], tokens=3),
        2: used(2, B1, [B1]), 3: used(3, B1, [B1], tokens=1),
        4: cached(4, C1),                         # carol finished earlier: cached, hittable
        5: used(5, A1, [A1, A2]),                 # shared within one tenant
        6: used(6, A1, [A1, B1]),                 # cross-tenant share: an isolation failure
    }, running=["a1", "a2", "b1"])
    f3 = snap(3, {
        0: used(0, A1, [A1, B1, N1], public=True), 4: cached(4, C1),
        7: used(7, N1, [N1]), 8: used(8, Z1, [Z1], tokens=2), 9: cached(9, A1),
    }, running=["a1", "b1", "n1", "z1"])
    return [f1, f2, f3]


def cells_by_id(layout):
    return {c.block_id: c for c in layout.cells}


# ---- palette and colours ----------------------------------------------------------------------
def test_palette_is_okabe_ito():
    assert set(OKABE_ITO.values()) == {"#000000", "#E69F00", "#56B4E9", "#009E73", "#F0E442",
                                       "#0072B2", "#D55E00", "#CC79A7"}
    assert set(TENANT_PALETTE) <= set(OKABE_ITO.values())
    assert len(set(TENANT_PALETTE)) == len(TENANT_PALETTE) == 7
    assert OKABE_ITO["black"] not in TENANT_PALETTE  # black is kept for borders and text


def test_colors_sorted_anon_last_and_distinct(frames):
    colors = assign_tenant_colors(frames)
    assert list(colors) == ["aaron", "alice", "bob", "carol", "anon"]
    assert len(set(colors.values())) == len(colors)
    assert all(c in TENANT_PALETTE for c in colors.values())


def test_colors_stable_across_frames(frames):
    colors = assign_tenant_colors(frames)
    seen: dict[str, set[str]] = {}
    for f in frames:
        for c in layout_pool(f, colors=colors).cells:
            if c.state == "used":
                seen.setdefault(c.tenant, set()).add(c.facecolor)
                assert c.facecolor == colors[c.tenant]
    assert all(len(v) == 1 for v in seen.values())
    assert seen["alice"] != seen["bob"]
    # Per-frame assignment would shift alice when "aaron" appears: that is what colors= prevents.
    first = cells_by_id(layout_pool(frames[0], colors=colors))[0].facecolor
    last = cells_by_id(layout_pool(frames[2], colors=colors))[0].facecolor
    assert first == last
    assert assign_tenant_colors(frames[0])["alice"] != assign_tenant_colors(frames[2])["alice"]


def test_text_contrast_and_blend():
    assert text_color_for(OKABE_ITO["blue"]) == "#FFFFFF"
    assert text_color_for(OKABE_ITO["yellow"]) == "#000000"
    assert blend("#000000", "#FFFFFF", 0.5) == "#808080"


# ---- layout ----------------------------------------------------------------------------------
def test_grid_positions_and_states(frames):
    lay = layout_pool(frames[1], max_cols=5)
    assert (lay.nrows, lay.ncols) == (3, 5)
    assert len({(c.row, c.col) for c in lay.cells}) == NUM_BLOCKS
    c = cells_by_id(lay)
    assert (c[7].row, c[7].col) == (1, 2)
    assert c[11].state == "free" and c[11].facecolor == FREE_COLOR and c[11].tenant is None
    assert grid_shape(0) == (0, 0) and grid_shape(3) == (1, 3) and grid_shape(33) == (3, 16)


def test_ref_count_labels(frames):
    c = cells_by_id(layout_pool(frames[2]))
    assert c[0].label == "3"
    assert c[7].label == "1"
    assert c[4].label == "0"  # cached: nobody holds it, but it is still there to be hit
    assert c[10].label == ""  # free: nothing to count
    for f in frames:
        for cell, block in zip(layout_pool(f).cells, f.blocks):
            assert cell.label == ("" if block.state == "free" else str(block.ref_count))


def test_cached_blocks_hatched_in_writer_colour(frames):
    colors = assign_tenant_colors(frames)
    c = cells_by_id(layout_pool(frames[2], colors=colors))
    assert c[4].state == "cached" and c[4].hatch == CACHED_HATCH
    assert c[4].edgecolor == colors["carol"] and c[9].edgecolor == colors["alice"]
    assert c[4].facecolor != colors["carol"]


def test_partial_blocks_fill(frames):
    c = cells_by_id(layout_pool(frames[1]))
    assert c[1].fill == pytest.approx(0.75) and c[3].fill == pytest.approx(0.25)
    assert c[2].fill == 1.0


def test_sharing_mode_flags(frames):
    colors = assign_tenant_colors(frames)
    c = cells_by_id(layout_pool(frames[1], mode="sharing", colors=colors))
    # cross-tenant, not public: the warning
    assert c[6].cross_tenant and c[6].warning and c[6].badge == "!"
    assert c[6].linestyle == "dashed" and c[6].linewidth >= 3
    # public prefix held by two tenants: marked distinctly, no warning
    assert c[0].public and c[0].cross_tenant and not c[0].warning
    assert c[0].badge == "P" and c[0].linestyle == "dotted" and c[0].hatch
    # shared within one tenant: thick border, no badge
    assert c[5].shared and not c[5].cross_tenant and c[5].badge == ""
    assert c[5].linewidth >= 3 and c[5].facecolor == colors["alice"]
    # private block: writer's colour, thin border
    assert not c[2].shared and c[2].facecolor == colors["bob"] and c[2].linewidth < 1
    assert [b for b in c.values() if b.warning] == [c[6]]


def test_tenant_mode_has_no_sharing_marks(frames):
    lay = layout_pool(frames[1], mode="tenant")
    assert all(c.badge == "" for c in lay.cells)
    assert cells_by_id(lay)[6].cross_tenant  # the flag is there, just not drawn in this mode


def test_legend(frames):
    colors = assign_tenant_colors(frames)
    tenant_legend = [e.label for e in layout_pool(frames[0], colors=colors).legend]
    assert tenant_legend[:5] == ["tenant aaron", "tenant alice", "tenant bob", "tenant carol",
                                 "tenant anon"]
    assert "free" in tenant_legend and not any("cross-tenant" in e for e in tenant_legend)
    sharing = " | ".join(e.label for e in layout_pool(frames[0], "sharing", colors).legend)
    assert "cross-tenant" in sharing and "public" in sharing and "shared" in sharing
    with pytest.raises(ValueError):
        layout_pool(frames[0], mode="rainbow")


def test_empty_pool():
    empty = PoolSnapshot(0, BS, ())
    lay = layout_pool(empty)
    assert lay.cells == () and (lay.nrows, lay.ncols) == (0, 0)
    assert lay.summary == empty.summary()
    assert isinstance(draw_pool(empty), Figure)


# ---- drawing ---------------------------------------------------------------------------------
def test_draw_pool_title_patches_and_given_axes(frames):
    fig = draw_pool(frames[1], mode="sharing")
    ax = fig.axes[0]
    assert ax.get_title(loc="left") == frames[1].summary()
    assert len(ax.patches) >= NUM_BLOCKS
    texts = [t.get_text() for t in ax.texts]
    assert "!" in texts and "P" in texts
    fig2 = Figure()
    ax2 = fig2.add_subplot()
    assert draw_pool(frames[0], ax=ax2) is fig2
    assert fig._repr_png_()[:8] == b"\x89PNG\r\n\x1a\n"


def test_frames_strip(frames):
    fig = draw_frames_strip(frames, steps=[1, 3])
    drawn = [a for a in fig.axes if a.patches]
    assert [a.get_title(loc="left") for a in drawn] == ["step 1", "step 3"]
    assert fig.legends
    assert len([a for a in draw_frames_strip(frames).axes if a.patches]) == 3
    assert len([a for a in draw_frames_strip(frames[:1]).axes if a.patches]) == 1
    with pytest.raises(ValueError, match="available steps"):
        draw_frames_strip(frames, steps=[0])
    with pytest.raises(ValueError):
        draw_frames_strip([])


def test_no_figures_leak(frames):
    before = plt.get_fignums()
    draw_pool(frames[1])
    draw_frames_strip(frames)
    ex = PoolExplorer(frames)
    ex.slider.value = 2
    plot_roc([1, 2], [3, 4])
    plot_ttft_distributions([1, 2], [3, 4])
    plot_bars(["a"], [1.0])
    assert plt.get_fignums() == before


# ---- widget ----------------------------------------------------------------------------------
def test_explorer_slider_updates_summary_and_image(frames):
    ex = PoolExplorer(frames, mode="tenant")
    assert (ex.slider.min, ex.slider.max, ex.slider.value) == (0, 2, 0)
    assert ex.summary.value == frames[0].summary()
    assert SUMMARY_CLASS in ex.summary._dom_classes
    png0 = ex.image.value
    assert png0[:8] == b"\x89PNG\r\n\x1a\n"
    for k in (2, 1):
        ex.slider.value = k
        assert ex.summary.value == frames[k].summary()
        assert ex.frame == k and ex.current is frames[k]
    assert ex.image.value != png0
    ex.slider.value = 0
    assert ex.image.value == png0 and ex.summary.value == frames[0].summary()
    ex.show(2)
    assert ex.slider.value == 2 and ex.summary.value == frames[2].summary()
    assert ex.output is ex.image
    assert ex.summary in ex.widget.children and ex.image in ex.widget.children
    with pytest.raises(IndexError):
        ex.show(3)


def test_explorer_sharing_mode_differs(frames):
    a = PoolExplorer(frames, mode="tenant")
    b = PoolExplorer(frames, mode="sharing")
    a.slider.value = b.slider.value = 1
    assert a.image.value != b.image.value


def test_explorer_edge_cases():
    single = PoolExplorer([snap(7, {0: used(0, A1, [A1])})])
    assert single.slider.max == 0 and single.slider.disabled and single.play is None
    assert single.summary.value.startswith("step 7:")
    empty = PoolExplorer([PoolSnapshot(0, BS, ())])
    assert empty.summary.value == "step 0: used[none] free=0 cached=0 running=0 waiting=0"
    assert empty.image.value[:4] == b"\x89PNG"
    with pytest.raises(ValueError):
        PoolExplorer([])
    with pytest.raises(ValueError):
        PoolExplorer([PoolSnapshot(0, BS, ())], mode="x")


# ---- plots ------------------------------------------------------------------------------------
def _all_text(fig: Figure) -> str:
    out = []
    for ax in fig.axes:
        out += [t.get_text() for t in ax.texts]
        leg = ax.get_legend()
        if leg:
            out += [t.get_text() for t in leg.get_texts()]
    return "\n".join(out)


def test_roc_curve_area_is_the_reference_auc():
    """The curve plot_roc draws has the area minikv.audit.stats.roc_auc (the one AUC) reports,
    ties included (rounded samples tie often)."""
    rng = np.random.default_rng(0)
    hit, miss = rng.normal(0, 1, 40).round(1), rng.normal(0.7, 1, 50).round(1)
    fpr, tpr = roc_curve(hit, miss)
    pairwise = np.mean([(h < m) + 0.5 * (h == m) for h, m in itertools.product(hit, miss)])
    assert np.sum(np.diff(fpr) * (tpr[1:] + tpr[:-1]) / 2) == pytest.approx(pairwise)
    assert roc_auc(hit, miss) == pytest.approx(pairwise)
    assert (fpr[0], tpr[0], fpr[-1], tpr[-1]) == (0, 0, 1, 1)
    assert np.all(np.diff(fpr) >= 0) and np.all(np.diff(tpr) >= 0)


def test_plot_roc_perfect_and_published():
    fig = plot_roc([0.01, 0.02, 0.03], [0.2, 0.3, 0.25],
                   published={"Gu et al.": 0.99, "paper point": (0.05, 0.9)})
    text = _all_text(fig)
    assert "AUC = 1.00" in text and "Gu et al. (published AUC = 0.99)" in text
    assert "FPR 0.05, TPR 0.90" in text
    assert len(fig.axes[0].lines) == 4  # curve, chance, two references
    assert "AUC = 0.50" in _all_text(plot_roc([1, 2], [1, 2]))


def test_plot_ttft_distributions():
    fig = plot_ttft_distributions([10, 11, 12], [50, 55, 60], bins=8, title="T")
    ax = fig.axes[0]
    assert len(ax.lines) == 2 and len(ax.patches) == 16
    assert ax.get_title() == "T" and "ms" in ax.get_xlabel()
    with pytest.raises(ValueError):
        plot_ttft_distributions([], [1])


def test_plot_hit_rate_vs_tenants():
    fig = plot_hit_rate_vs_tenants([1, 2, 4, 8], {"shared": [0.9, 0.9, 0.85, 0.8],
                                                  "per-tenant": [0.9, 0.5, 0.25, 0.1]})
    ax = fig.axes[0]
    assert len(ax.lines) == 2
    assert list(ax.lines[1].get_ydata()) == [0.9, 0.5, 0.25, 0.1]
    assert ax.get_xlabel() and ax.get_ylabel()
    with pytest.raises(ValueError):
        plot_hit_rate_vs_tenants([1, 2], {"x": [0.1]})


def test_plot_bars_and_sweep():
    fig = plot_bars(["sha256", "hmac", "blake2b"], [1.0, 1.2, 0.9], ylabel="µs / block")
    ax = fig.axes[0]
    assert len(ax.patches) == 3 and "1.20" in _all_text(fig)
    assert len(plot_bars(["a", "b"], [1, 2], horizontal=True).axes[0].patches) == 2
    with pytest.raises(ValueError):
        plot_bars(["a"], [1, 2])
    sweep = plot_granularity_sweep([4, 8, 16, 32], [12.0, 30.0, 70.0, 150.0], logy=True)
    line = sweep.axes[0].lines
    assert len(line) == 1 and len(line[0].get_xdata()) == 4
    assert sweep.axes[0].get_xscale() == "log"


# ---- lesson figures (minikv/viz/fleet.py) -------------------------------------------------------
def test_fleet_figures_draw_what_they_are_given():
    from minikv.viz.fleet import draw_fleet, plot_churn, plot_prime_and_probe, plot_probe_ttfts
    fig = draw_fleet(4)
    assert sum(t.get_text().startswith("edge-") for t in fig.axes[0].texts) == 4
    rows = [dict(right=True, ttft=0.1), dict(right=False, ttft=0.3)]
    fig = plot_probe_ttfts({"a": (rows, 0.2), "b": (rows, 0.25)})
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["a", "b"]
    assert len(ax.collections) >= 4 + 2   # one scatter per probe, one threshold line per fleet
    fig = plot_churn([1, 10, None], {"prefix": [0.0, 0.5, 0.7], "rr": [0.0, 0.3, 0.5]})
    lines = fig.axes[0].get_lines()
    assert [list(l.get_xdata()) for l in lines] == [[1, 10, 60]] * 2
    assert list(lines[0].get_ydata()) == [0.0, 50.0, 70.0]
    fig = plot_prime_and_probe([0, 1, 2], {"quota": [128, 128, 128], "none": [128, 64, 0]})
    assert [l.get_label() for l in fig.axes[0].get_lines()] == ["quota", "none"]


def test_fleet_figures_refuse_mismatched_data():
    from minikv.viz.fleet import draw_fleet, plot_churn, plot_prime_and_probe
    with pytest.raises(ValueError, match="'prefix': 2 hit rates for 3 lifetimes"):
        plot_churn([1, 2, None], {"prefix": [0.1, 0.2]})
    with pytest.raises(ValueError, match="'none': 1 values for 2 loads"):
        plot_prime_and_probe([0, 1], {"none": [3]})
    with pytest.raises(ValueError, match="num_instances must be 1..5"):
        draw_fleet(0)


# ---- explanatory diagrams (minikv/viz/diagrams.py) -----------------------------------------------
def test_diagrams_draw_their_parts():
    from minikv.viz.diagrams import draw_block_lifecycle, draw_causal_attention, draw_gqa, draw_threat_model
    assert "threat model" in draw_threat_model().axes[0].get_title(loc="left")
    fig = draw_causal_attention(5)
    titles = [ax.get_title() for ax in fig.axes]
    assert titles == ["without a cache: 15 query-key pairs at step 5", "with a KV cache: 5 query-key pairs at step 5"]
    texts = [t.get_text() for t in draw_gqa(8, 2).axes[0].texts]
    assert sum(t.startswith("kv") for t in texts) == 2 and sum(t.startswith("q") for t in texts) == 8
    labels = [t.get_text() for t in draw_block_lifecycle().axes[0].texts]
    assert any(t.startswith("evict") for t in labels) and {"free", "used", "cached"} <= set(labels)


def test_diagrams_refuse_impossible_shapes():
    from minikv.viz.diagrams import draw_causal_attention, draw_gqa
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        draw_gqa(9, 2)
    with pytest.raises(ValueError, match="steps must be at least 2"):
        draw_causal_attention(1)


# ---- cost charts (minikv/viz/costs.py) -------------------------------------------------------------
def test_cost_charts_plot_the_given_numbers():
    from minikv.viz.costs import plot_decode_cost, plot_published_vs_measured
    fig = plot_decode_cost([10, 11, 12], [0.001, 0.001, 0.002], [0.004, 0.005, 0.006])
    work, time = fig.axes
    assert list(work.lines[1].get_ydata()) == [10, 11, 12]
    assert list(time.lines[1].get_ydata()) == pytest.approx([4.0, 5.0, 6.0])
    fig = plot_published_vs_measured([("paper (Table 1)", 0.9, False), ("measured here", 0.6, True)],
                                     xlabel="AUC", title="t", reference=0.5)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["paper (Table 1)", "measured here"]
    assert [p.get_width() for p in ax.patches] == [0.9, 0.6]
    assert ax.patches[0].get_facecolor() != ax.patches[1].get_facecolor()


def test_cost_charts_refuse_bad_input():
    from minikv.viz.costs import plot_decode_cost, plot_published_vs_measured
    with pytest.raises(ValueError, match="one of each per step"):
        plot_decode_cost([1, 2], [0.1], [0.1, 0.2])
    with pytest.raises(ValueError, match="rows is empty"):
        plot_published_vs_measured([], xlabel="x", title="t")


# ---- token strips (minikv/viz/tokens.py) -------------------------------------------------------------
def test_token_strips_mark_blocks_and_cached_prefix():
    from minikv.viz.tokens import draw_token_strips
    colors = {"known": "#cccccc", "secret": "#ff0000"}
    fig = draw_token_strips([("victim", ["known"] * 6 + ["secret"] * 2, None),
                             ("probe", ["known"] * 8, 4)], colors, block_size=4, title="T")
    ax = fig.axes[0]
    cache_bars = [p for p in ax.patches if p.get_height() == 0.3]
    assert sorted(p.get_width() for p in cache_bars) == [4, 4]           # 4 cached, 4 computed
    assert len(ax.lines) == 3 + 3                                         # boundaries at 0, 4, 8 per strip
    with pytest.raises(ValueError, match=r"no colour for token kind\(s\) \['other'\]"):
        draw_token_strips([("x", ["other"], None)], colors)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        draw_token_strips([("x", ["known"], None)], colors, block_size=0)


def test_slot_grid_draws_every_slot_and_outlines_the_read_ones():
    from minikv.viz.tokens import draw_slot_grid
    kinds = ["a", "a", "b", "empty"]
    colors = {"a": ("#00f", "a's token"), "b": ("#f00", "b's token"), "empty": ("#ddd", "none")}
    fig = draw_slot_grid(kinds, ["x", "y", "z", ""], 2, colors, outlined={(1, 0)}, outline=("#f00", "read"))
    ax = fig.axes[0]
    assert len(ax.patches) == 4 and [t.get_text() for t in ax.texts] == ["x", "y", "z"]
    assert [p.get_linewidth() for p in ax.patches] == [0.5, 0.5, 2.2, 0.5]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a's token", "b's token", "none", "read"]
    with pytest.raises(ValueError, match="3 slots do not make whole blocks of 2"):
        draw_slot_grid(kinds[:3], ["", "", ""], 2, colors)
    with pytest.raises(ValueError, match=r"no colour for slot kind\(s\) \['c'\]"):
        draw_slot_grid(["c", "a"], ["", ""], 2, colors)


def test_timing_strip_shows_every_repeat_and_each_arms_median():
    from minikv.viz.plots import plot_timing_strip
    fig = plot_timing_strip({"miss": [900.0, 1000.0, 1100.0, 5000.0], "hit": [80.0, 90.0, 100.0]})
    ax = fig.axes[0]
    dots = [c for c in ax.collections if c.get_offsets().shape[0] > 0]
    assert sorted(len(c.get_offsets()) for c in dots) == [3, 4]   # one dot per repeat, outliers included
    labels = [t.get_text() for t in ax.texts]
    assert "median 1,050" in labels and "median 90" in labels
    assert [t.get_text() for t in ax.get_xticklabels()] == ["miss\n(n=4)", "hit\n(n=3)"]
    with pytest.raises(ValueError, match="hit"):
        plot_timing_strip({"miss": [1.0], "hit": []})
