"""The front page and the docs keep their links: every relative link resolves, every ``#anchor`` names
a heading, and the README stays a front page (at most ``README_MAX_LINES`` lines).

Checked: ``README.md``, ``docs/*.md`` and ``course/*.md`` (a page added later too).  A link is a
markdown link or image, ``[text](target)``, or an HTML ``src=``/``href=`` attribute, outside code
(fenced blocks and inline code are examples, not links).  Web addresses are not fetched (CI has no
network); everything else must exist on disk, relative to the page.  An anchor must equal the slug
GitHub gives one of the target page's headings -- lowercase, punctuation dropped, spaces to ``-``, a
repeated heading's slug suffixed ``-1``, ``-2`` -- or, in a notebook, one of its markdown cells'.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 250
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "course").glob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
_CODE = re.compile(r"`[^`\n]*`")
_MD_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_LINK = re.compile(r"""\b(?:src|href)\s*=\s*["']([^"']+)["']""")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def without_code(md: str, inline: bool = True) -> str:
    """``md`` with fenced blocks (and, if ``inline``, inline code) blanked out, their lines kept for
    line numbers.  Headings keep their inline code: GitHub's slug keeps the code's text."""
    md = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), md)
    return _CODE.sub("", md) if inline else md


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text: markdown links read as their text, then lowercase,
    everything but letters, digits, ``_``, ``-`` and spaces dropped, spaces -> ``-``."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def heading_anchors(md: str) -> set[str]:
    """Every anchor GitHub makes for the headings of ``md`` (repeats numbered ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(without_code(md, inline=False)):
        base = slug(heading)
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def anchors_of(path: Path) -> set[str]:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text(encoding="utf-8"))["cells"]
        return heading_anchors("\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"))
    return heading_anchors(path.read_text(encoding="utf-8"))


def links(md: str) -> list[tuple[int, str]]:
    """``(line, target)`` of every link and image in ``md``, outside code."""
    text = without_code(md)
    found = []
    for pattern in (_MD_LINK, _HTML_LINK):
        for m in pattern.finditer(text):
            found.append((text.count("\n", 0, m.start()) + 1, m.group(1)))
    return sorted(found)


def broken_links(page: Path, md: str | None = None) -> list[str]:
    """Each relative link of ``page`` (its text ``md``, read from disk by default) that does not
    resolve, as ``page:line: target (why)``."""
    md = page.read_text(encoding="utf-8") if md is None else md
    bad = []
    for line, target in links(md):
        if _EXTERNAL.match(target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT) if page.is_relative_to(ROOT) else page}:{line}: {target}"
        if path and not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix in (".md", ".ipynb"):
            known = heading_anchors(md) if dest == page else anchors_of(dest)
            if anchor not in known:
                bad.append(f"{where} (no heading with that anchor in {dest.name})")
    return bad


# --- the checker first, on text made to break it ----------------------------------------------------

def test_slugs_follow_github():
    assert slug("Threat model, in short") == "threat-model-in-short"
    assert slug("GPU: an H200 (`make gpu-check`)") == "gpu-an-h200-make-gpu-check"
    assert slug("Attention backends -- minikv/engine/x.py") == "attention-backends----minikvenginexpy"
    assert slug("See [the docs](docs/A.md)") == "see-the-docs"
    assert heading_anchors("# A\n## A\n```\n# not a heading\n```\n### A\n") == {"a", "a-1", "a-2"}


def test_a_planted_broken_link_or_anchor_is_reported():
    md = ("# Top\n\nSee [the top](#top), [the map](README.md#course-map), ![pic](course/figures/thumbs/00.png)\n"
          "and <https://example.com>, [web](https://example.com/x#y), `[code](nowhere.md)`.\n\n"
          "[gone](docs/NOWHERE.md) [bad anchor](README.md#no-such-heading) [self](#nowhere)\n"
          '<img src="course/figures/missing.png">\n```\n[in a block](also-nowhere.md)\n```\n')
    bad = broken_links(ROOT / "PLANTED.md", md)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "#nowhere (no heading with that anchor in PLANTED.md)",
        "README.md#no-such-heading (no heading with that anchor in README.md)", "docs/NOWHERE.md (no such file)",
        "course/figures/missing.png (no such file)"], bad


# --- the real pages ---------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page):
    bad = broken_links(page)
    assert not bad, "broken links:\n" + "\n".join(bad)


def test_the_readme_is_a_front_page():
    """Short, and in the order a newcomer needs it (issue 36): what this is (above the first section),
    how to start, the course, the engine, one table of results, the threat model, the layout."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    lines = readme.count("\n")
    assert lines <= README_MAX_LINES, (f"README.md has {lines} lines, over {README_MAX_LINES}: move detail into "
                                       "docs/ (BENCHMARKS.md, ARCHITECTURE.md, INSTALL.md, USAGE.md) and link it")
    order = ["Quickstart", "Course map", "Using the engine", "Headline results", "Threat model, in short",
             "Project layout"]
    sections = re.findall(r"^## (.+?)\s*$", without_code(readme), re.M)
    assert [s for s in sections if s in order] == order, f"the README's sections should run {order}: {sections}"
