"""Real browser: lesson 02's block-pool explorer works in JupyterLab, driven by headless Chromium.

1. copy lesson 02 into a temporary directory (cells up to the ``PoolExplorer`` cell, plus one
   cell that prints every frame's expected summary line), start JupyterLab on 127.0.0.1 there;
2. open the copy in Debian's Chromium through playwright, Run > Run All Cells;
3. wait for the widget, move its frame slider with the keyboard, and check that the summary
   label now shows exactly the frame the slider's readout names (``PoolSnapshot.summary()``);
4. save a screenshot to ``out/browser/lesson02.png``.

A second test drives lesson 03's live widgets (its WhatIf and OracleGame cells, on tiny-random):
it picks ``cache_isolation="tenant"``, types a guess, and checks the text each widget prints.

Skips (with the reason) only when Chromium or playwright is missing; ``make test`` installs
Chromium first (``scripts/ensure_chromium.sh``).
"""
from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest

from tests.browser_helpers import CHROMIUM, REPO, copy_notebook, open_and_run_all

pytestmark = [pytest.mark.browser, pytest.mark.model, pytest.mark.slow]

LESSON = REPO / "course" / "02_paged_kv_cache.ipynb"
SCREENSHOT = REPO / "out" / "browser" / "lesson02.png"
SUMMARY_RE = re.compile(r"^step (\d+): used\[[^\]]*\] free=\d+ cached=\d+ running=\d+ waiting=\d+$")
MARKER = "MINIKV-FRAMES"
# Appended to the copy: the expected summary of every frame, computed by the same kernel.
PROBE_CELL = ("import json\n"
              f"print({MARKER!r}, json.dumps([s.summary() for s in explorer.snapshots]))")
RUN_TIMEOUT_MS = 150_000


def _requirements():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} is missing: install Debian's chromium (`make chromium` or "
                    "`apt-get install chromium`) to run the browser tests")
    try:
        from playwright.sync_api import sync_playwright  # noqa: F401
    except ImportError:
        pytest.skip("the playwright python package is not installed (pip install playwright)")
    try:
        import jupyterlab  # noqa: F401
    except ImportError:
        pytest.skip("jupyterlab is not installed in this environment (pip install -e .[course])")
    if not LESSON.exists():
        pytest.fail(f"{LESSON.relative_to(REPO)} does not exist")


def _dismiss_news_toast(page) -> None:
    """JupyterLab asks once whether to fetch Jupyter news; answer no (nothing is fetched)."""
    button = page.locator(".jp-toast-button", has_text=re.compile(r"^No$"))
    if button.count():
        button.first.click()


def _uses_explorer(source: str) -> bool:
    return "PoolExplorer(" in source


def test_lesson02_pool_explorer_in_jupyterlab(tmp_path, smollm2_path):
    _requirements()
    nb_src = LESSON.read_text()
    assert "PoolExplorer(" in nb_src, "lesson 02 no longer builds a PoolExplorer"
    # Cells after the explorer do not affect it; running them would only cost time.
    copy = copy_notebook(LESSON, tmp_path, extra_code=PROBE_CELL, stop_after=_uses_explorer)

    t0 = time.monotonic()
    with open_and_run_all(copy, SCREENSHOT.with_name("lesson02-failure.png")) as nb:
        page = nb.page
        frames_out = page.locator(".jp-OutputArea-output", has_text=MARKER)
        frames_out.wait_for(timeout=RUN_TIMEOUT_MS)
        print(f"[browser] lesson 02 ran in the browser after {time.monotonic() - t0:.0f} s")
        text = frames_out.inner_text()
        frames = json.loads(text[text.index(MARKER) + len(MARKER):].strip())
        assert len(frames) > 3, "lesson 02's explorer should have several frames"

        summary = page.locator(".minikv-summary")
        summary.wait_for(timeout=30_000)
        _dismiss_news_toast(page)
        image = page.locator(".minikv-pool-image").first
        image_before = image.get_attribute("src")
        before = summary.inner_text().strip()
        assert before == frames[0], (before, frames[0])
        assert SUMMARY_RE.match(before), before

        # move the slider: focus its handle and press the right arrow a few times
        slider = page.locator(".minikv-frame-slider")
        handle = slider.locator(".noUi-handle").first
        handle.scroll_into_view_if_needed()
        handle.click()
        presses = min(5, len(frames) - 1)
        for _ in range(presses):
            handle.press("ArrowRight")
        page.wait_for_function(
            "([sel, old]) => { const e = document.querySelector(sel);"
            " return e && e.textContent.trim() !== old; }",
            arg=[".minikv-summary", before], timeout=20_000)
        frame = int(slider.locator(".widget-readout").first.inner_text().strip())
        assert 0 < frame < len(frames)
        # each key press is a round trip to the kernel, which renders that frame; wait for the
        # view to catch up with the slider
        try:
            page.wait_for_function(
                "([sel, want]) => { const e = document.querySelector(sel);"
                " return e && e.textContent.trim() === want; }",
                arg=[".minikv-summary", frames[frame]], timeout=60_000)
        except Exception:  # noqa: BLE001 -- report what the view shows instead
            pass
        after = summary.inner_text().strip()

        assert after != before
        m = SUMMARY_RE.match(after)
        assert m, after
        assert after == frames[frame], f"slider at frame {frame} but the view shows {after!r}"
        # lesson 02 records one snapshot per engine step, starting from the empty pool
        assert int(m.group(1)) == frame

        # the picture follows the label in the same kernel round trip: wait for it too
        nb.lab.wait_kernel_idle(nb.kernel_id)
        page.wait_for_function(
            "([sel, old]) => { const e = document.querySelector(sel);"
            " return e && e.getAttribute('src') !== old; }",
            arg=[".minikv-pool-image", image_before], timeout=20_000)
        page.wait_for_timeout(500)

        SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
        page.locator(".minikv-pool-explorer").scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOT))
        shutil.copy(SCREENSHOT, tmp_path / SCREENSHOT.name)  # also kept with the test's tmp files
    elapsed = time.monotonic() - t0
    print(f"[browser] done in {elapsed:.0f} s; screenshot: {SCREENSHOT.relative_to(REPO)}")
    assert elapsed < 300


LESSON03 = REPO / "course" / "03_prefix_sharing.ipynb"
# Lesson 03 builds its tiny-random engine in section 5 among SmolLM2 cells; only this line is needed.
TINY_CELL = ("import warnings\nfrom minikv import LLM, UnsafeSettingWarning\n"
             "warnings.simplefilter('ignore', UnsafeSettingWarning)\n"
             "tiny = LLM('tiny-random', num_blocks=256, block_size=8, enable_prefix_caching=True,\n"
             "           max_cached_blocks_per_tenant='unlimited', attention_backend='reference')")


def _wait_text(page, sel: str, pattern: str, timeout: int = 60_000) -> str:
    """Wait until the element ``sel`` shows text matching the JS regex ``pattern``; return it."""
    page.wait_for_function(
        "([sel, pat]) => { const e = document.querySelector(sel);"
        " return e && new RegExp(pat).test(e.textContent); }", arg=[sel, pattern], timeout=timeout)
    return page.locator(sel).first.inner_text().strip()


def test_lesson03_whatif_and_oracle_game_in_jupyterlab(tmp_path):
    """Lesson 03's live widgets in the browser: pick cache_isolation="tenant" in the what-if
    widget and the cross-tenant hits drop to 0; type the victim's prompt into the oracle game and
    the shared engine reports cached tokens while the isolated one reports 0."""
    _requirements()
    import nbformat

    from minikv.viz.oracle_game import SECRET

    nb = nbformat.read(LESSON03, as_version=4)
    widget_cells = [c.source for c in nb.cells if c.cell_type == "code"
                    and ("WhatIf(" in c.source or "OracleGame(" in c.source)]
    assert len(widget_cells) == 2, "lesson 03 should build one WhatIf and one OracleGame"
    copy = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in [TINY_CELL, *widget_cells]])
    copy.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    path = tmp_path / "whatif.ipynb"
    nbformat.write(copy, path)

    t0 = time.monotonic()
    with open_and_run_all(path, SCREENSHOT.with_name("lesson03-failure.png")) as nb:
        page = nb.page
        summary = ".minikv-whatif-summary"
        before = _wait_text(page, summary, r"isolation=shared .*cross-tenant hits=[1-9]", RUN_TIMEOUT_MS)
        _dismiss_news_toast(page)
        assert re.search(r"same-tenant hits=[1-9]", before), before
        page.locator(".minikv-whatif-isolation select").select_option("tenant")
        after = _wait_text(page, summary, r"isolation=tenant ")
        assert "cross-tenant hits=0 " in after, after
        assert re.search(r"same-tenant hits=[1-9]", after), after   # isolation keeps own hits
        # the whole summary, its hit counts included, is inside the page: nothing cut off at the right
        fits = page.evaluate(
            "(sel) => { const e = document.querySelector(sel), r = e.getBoundingClientRect();"
            " return [r.right, window.innerWidth, e.scrollWidth, e.clientWidth]; }", summary)
        assert fits[0] <= fits[1] and fits[2] <= fits[3], f"what-if summary overflows: {fits}"
        page.locator(summary).scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOT.with_name("lesson03-whatif.png")))

        # before any guess the oracle game shows no picture (an empty image is a broken-image icon)
        page.locator(".minikv-oracle-summary").wait_for(timeout=RUN_TIMEOUT_MS)
        assert not page.locator(".minikv-oracle-image").is_visible()
        guess = page.locator(".minikv-oracle-guess input")
        guess.scroll_into_view_if_needed()
        guess.fill(SECRET)
        guess.press("Enter")
        said = _wait_text(page, ".minikv-oracle-summary", r"cached_tokens shared=")
        m = re.search(r"cached_tokens shared=(\d+) isolated=(\d+)", said)
        assert m and int(m.group(1)) > 0 and int(m.group(2)) == 0, said
        assert SECRET in said
        page.locator(".minikv-oracle-image").wait_for(state="visible", timeout=20_000)
        page.locator(".minikv-oracle-image").scroll_into_view_if_needed()
        page.screenshot(path=str(SCREENSHOT.with_name("lesson03-oracle.png")))
        print(f"[browser] what-if: {after}\n[browser] oracle: {said}")
    print(f"[browser] lesson 03 widgets done in {time.monotonic() - t0:.0f} s")
