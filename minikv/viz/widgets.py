"""Thin ipywidgets wrappers: scrub through engine snapshots with a slider.

Why an ``Image`` widget holding PNG bytes rather than an ``Output`` with a live figure?  An
``Output`` widget re-runs display machinery and depends on which matplotlib backend the kernel
picked; an ``Image`` widget is just bytes on a traitlet, so it updates reliably in JupyterLab, in
a headless browser test and in a plain Python test alike.  Each frame is rendered once through
Agg (``figure_to_png``) and cached, so scrubbing back and forth is instant and no figure is left
open.

The summary line is a ``Label`` whose ``value`` is *exactly* ``PoolSnapshot.summary()`` and whose
DOM element carries the CSS class ``minikv-summary``, so a browser test can read the current frame
with ``document.querySelector('.minikv-summary').textContent``.
"""
from __future__ import annotations

from collections.abc import Sequence

import ipywidgets as w

from minikv.engine.snapshot import PoolSnapshot
from minikv.viz.draw import draw_pool, figure_to_png
from minikv.viz.layout import DEFAULT_MAX_COLS, MODES, assign_tenant_colors

SUMMARY_CLASS = "minikv-summary"
IMAGE_CLASS = "minikv-pool-image"
SLIDER_CLASS = "minikv-frame-slider"
EXPLORER_CLASS = "minikv-pool-explorer"


def render_png(snapshot: PoolSnapshot, mode: str = "tenant",
               colors: dict[str, str] | None = None, max_cols: int = DEFAULT_MAX_COLS,
               dpi: int = 100) -> bytes:
    """PNG bytes of :func:`draw_pool` for one snapshot (the title is left to the summary label)."""
    fig = draw_pool(snapshot, mode=mode, colors=colors, max_cols=max_cols, title="")
    return figure_to_png(fig, dpi=dpi)


class PoolExplorer:
    """Slider over a list of snapshots; shows the pool picture and the frame's summary line.

    ``explorer.slider.value = k`` sets ``explorer.summary.value`` to ``snapshots[k].summary()``
    and ``explorer.image.value`` to the PNG of frame ``k``.  Tenant colours are assigned over all
    frames so they never change while scrubbing.
    """

    def __init__(self, snapshots: Sequence[PoolSnapshot], mode: str = "tenant",
                 max_cols: int = DEFAULT_MAX_COLS, play: bool = True, dpi: int = 100,
                 description: str = "step") -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.snapshots = list(snapshots)
        if not self.snapshots:
            raise ValueError("PoolExplorer needs at least one snapshot")
        self.mode, self.max_cols, self.dpi = mode, max_cols, dpi
        self.colors = assign_tenant_colors(self.snapshots)
        self._png_cache: dict[int, bytes] = {}
        last = len(self.snapshots) - 1
        self.slider = w.IntSlider(value=0, min=0, max=last, step=1, description=description,
                                  disabled=last == 0, continuous_update=True,
                                  readout=True, layout=w.Layout(width="420px"))
        self.slider.add_class(SLIDER_CLASS)
        self.summary = w.Label(value=self.snapshots[0].summary(),
                               layout=w.Layout(width="auto"))
        self.summary.add_class(SUMMARY_CLASS)
        self.image = w.Image(value=self._png(0), format="png")
        self.image.add_class(IMAGE_CLASS)
        self.output = self.image  # the spec's name for "the view of the frame"
        controls: list[w.Widget] = [self.slider]
        self.play: w.Play | None = None
        if play and last > 0:
            self.play = w.Play(value=0, min=0, max=last, step=1, interval=700,
                               description="play")
            w.jslink((self.play, "value"), (self.slider, "value"))
            controls.insert(0, self.play)
        self.widget = w.VBox([w.HBox(controls), self.summary, self.image])
        self.widget.add_class(EXPLORER_CLASS)
        self.slider.observe(self._on_change, names="value")

    # -- rendering --------------------------------------------------------------------------
    def _png(self, k: int) -> bytes:
        if k not in self._png_cache:
            self._png_cache[k] = render_png(self.snapshots[k], mode=self.mode,
                                            colors=self.colors, max_cols=self.max_cols,
                                            dpi=self.dpi)
        return self._png_cache[k]

    def _on_change(self, change: dict) -> None:
        self.show(change["new"])

    def show(self, k: int) -> None:
        """Display frame ``k`` (also what moving the slider does)."""
        if not 0 <= k < len(self.snapshots):
            raise IndexError(f"frame {k} out of range 0..{len(self.snapshots) - 1}")
        if self.slider.value != k:
            self.slider.value = k  # observer calls back into show(k)
            return
        self.summary.value = self.snapshots[k].summary()
        self.image.value = self._png(k)

    @property
    def frame(self) -> int:
        """Index of the frame on screen."""
        return self.slider.value

    @property
    def current(self) -> PoolSnapshot:
        return self.snapshots[self.slider.value]

    def _ipython_display_(self) -> None:
        from IPython.display import display
        display(self.widget)


def pool_explorer(snapshots: Sequence[PoolSnapshot], mode: str = "tenant",
                  **kwargs) -> PoolExplorer:
    """Functional spelling of ``PoolExplorer(snapshots, mode=...)``."""
    return PoolExplorer(snapshots, mode=mode, **kwargs)
