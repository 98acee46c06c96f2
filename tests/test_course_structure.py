"""Conventions every lesson keeps (no kernel is started: these read the committed .ipynb files).

Every ``course/NN_*.ipynb`` -- a lesson added later too -- must

* open the same way: first cell ``# NN · Title``, ``**Learning objectives.**`` with a numbered list,
  ``**Time:** about N minutes`` and ``**Prerequisites:** ...``;
* close the same way: last cell ``## Summary`` (bullets), ``**Next:**`` (linking the next lesson's
  file when there is one) and ``## References`` linking ``REFERENCES.md#lesson-NN``;
* cite only what ``course/REFERENCES.md`` lists under ``### Lesson NN``: every ``#NNNN`` issue or
  pull request, CVE, GHSA advisory, PYSEC id and arXiv id anywhere in the lesson;
* state the time the README's course map states, keep every code cell at 25 lines or fewer,
  and link only glossary/reference anchors that exist;
* commit outputs without errors, stderr, memory addresses or raw timings (outside nbval-ignored
  cells), with widget state stripped, and follow each interactive ``PoolExplorer`` with a static twin.
"""
from __future__ import annotations

import configparser
import re
from pathlib import Path

import pytest

from tests.course_notebooks import ADDRESS, ALL_LESSONS, COURSE, RAW_TIME, load, outputs, tags, text_outputs

ROOT = COURSE.parent
MAX_CODE_LINES = 25

# A citation id: "#23300" after a repo name, a word or a space (not a quoted hex colour like "#888888"),
# CVE, GHSA and PYSEC ids, and arXiv ids written "arXiv:2411.18191" or as an arxiv.org URL.
_ISSUE = re.compile(r"""(?<![&"'#\w/])#(\d{3,6})\b|(?<=[\w.-])#(\d{3,6})\b""")
_NAMED = re.compile(r"\b(CVE-\d{4}-\d{4,7}|GHSA(?:-[0-9a-z]{4}){3}|PYSEC-\d{4}-\d+)\b", re.I)
_ARXIV = re.compile(r"(?:arXiv:\s?|arxiv\.org/(?:abs|pdf|html)/)(\d{4}\.\d{4,5})", re.I)
_TIME = re.compile(r"\*\*Time:\*\*\s*about\s+(\d+)\s+minutes")
_LINK = re.compile(r"\]\(((?:GLOSSARY|REFERENCES)\.md)#([^)\s]+)\)")


def citation_ids(text: str) -> set[str]:
    """The citation ids in ``text``, normalised: ``#23300``, ``CVE-2025-25183``, ``arXiv:2411.18191``."""
    ids = {"#" + (a or b) for a, b in _ISSUE.findall(text)}
    ids |= {m.upper() if not m.upper().startswith("GHSA") else "GHSA" + m[4:].lower() for m in _NAMED.findall(text)}
    ids |= {"arXiv:" + m for m in _ARXIV.findall(text)}
    return ids


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a markdown heading: lowercase, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(md_file: Path) -> set[str]:
    return {github_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", md_file.read_text(), re.M)}


def section(md: str, heading: str) -> str:
    """The text under ``heading`` (a whole line, e.g. '### Lesson 04') up to the next heading of the same
    or a higher level; '' when absent."""
    level = len(heading) - len(heading.lstrip("#"))
    m = re.search(rf"^{re.escape(heading)}\s*$", md, re.M)
    if not m:
        return ""
    end = re.search(rf"^#{{1,{level}}}\s", md[m.end():], re.M)
    return md[m.end(): m.end() + end.start()] if end else md[m.end():]


def _sanitizers() -> list[tuple[re.Pattern, str]]:
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(ROOT / "tests" / "nbval_sanitize.cfg")
    return [(re.compile(cfg[s]["regex"]), cfg[s]["replace"]) for s in cfg.sections()]


def sanitized(text: str) -> str:
    """``text`` as nbval compares it: with every regex of tests/nbval_sanitize.cfg applied."""
    for regex, replace in _sanitizers():
        text = regex.sub(replace, text)
    return text


def lesson_text(nb) -> str:
    """Everything a learner reads in a lesson: markdown, code and text outputs."""
    parts = []
    for c in nb.cells:
        parts.append(c.source)
        if c.cell_type == "code":
            parts += text_outputs(c)
    return "\n".join(parts)


def stated_minutes(nb) -> int | None:
    m = _TIME.search(nb.cells[0].source)
    return int(m.group(1)) if m else None


def readme_minutes() -> dict[str, int]:
    """Lesson file name -> the minutes in the README's course-map row for it."""
    rows = {}
    for line in (ROOT / "README.md").read_text().splitlines():
        link = re.search(r"\]\(course/(\d\d_[^)]+\.ipynb)\)", line)
        time = re.search(r"\|\s*(\d+)\s*min\s*\|\s*$", line)
        if link and time:
            rows[link.group(1)] = int(time.group(1))
    return rows


# --- the helpers above are what the course-wide tests stand on, so they are tested first ----------

def test_citation_ids_finds_every_form_and_skips_colours():
    text = ('SGLang #23300 and vllm#16016, sgl-project/sglang#9163, LMCache#3008 (PR #4158); '
            'color="#888888", fc=\'#999999\'; CVE-2025-25183 (GHSA-RM76-4mrf-v9r8), PYSEC-2025-53; '
            'arXiv:2411.18191, https://arxiv.org/abs/2502.07776; ## 12 Heading; issue #12.')
    assert citation_ids(text) == {"#23300", "#16016", "#9163", "#3008", "#4158", "CVE-2025-25183",
                                  "GHSA-rm76-4mrf-v9r8", "PYSEC-2025-53", "arXiv:2411.18191", "arXiv:2502.07776"}


def test_github_slug_and_section():
    assert github_slug("Lesson 04") == "lesson-04"
    assert github_slug("PRF and HMAC") == "prf-and-hmac"
    assert github_slug("Advisories and CVEs") == "advisories-and-cves"
    md = "## A\n### Lesson 01\nx #1\n### Lesson 02\ny\n## B\nz"
    assert section(md, "### Lesson 01").strip() == "x #1"
    assert section(md, "### Lesson 02").strip() == "y"
    assert section(md, "### Lesson 03") == ""


def test_measured_ratios_compare_equal_whatever_their_width():
    """A right-aligned ratio that crosses 10 (one pad space fewer) is the same band to nbval, and a
    ratio below 1 -- the effect gone -- is not."""
    line = "measured: minikv, this CPU (12 tokens){:>8}"
    assert sanitized(line.format(f"{9.8:5.1f}×")) == sanitized(line.format(f"{10.3:5.1f}×"))
    assert sanitized("is 2.6× faster") == sanitized("is 12.6× faster")
    assert sanitized(line.format(f"{0.9:5.1f}×")) != sanitized(line.format(f"{1.2:5.1f}×"))


def test_sanitized_applies_the_nbval_config():
    assert not RAW_TIME.search(sanitized("TTFT 12.5 ms, total 0.41 s"))
    assert RAW_TIME.search(sanitized("took 3 seconds"))      # the sanitizer does not cover this form
    assert ADDRESS.search("<object at 0x7f00deadbeef>") and not RAW_TIME.search(sanitized("5.0 us"))


# --- the course ----------------------------------------------------------------------------------

def test_lessons_are_numbered_without_gaps():
    assert len(ALL_LESSONS) >= 11
    assert [name[:2] for name in ALL_LESSONS] == [f"{i:02d}" for i in range(len(ALL_LESSONS))]


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_lesson_opening(name):
    first = load(name).cells[0]
    assert first.cell_type == "markdown", f"{name}: the first cell must be markdown"
    src = first.source
    assert re.match(rf"# {name[:2]} · \S", src), f"{name}: first line must be '# {name[:2]} · Title'"
    goals = src.find("**Learning objectives.**")
    assert goals >= 0 and re.search(r"^1\. \S", src[goals:], re.M), \
        f"{name}: '**Learning objectives.**' followed by a numbered list"
    assert stated_minutes(load(name)), f"{name}: '**Time:** about N minutes' in the first cell"
    assert re.search(r"\*\*Prerequisites:\*\*\s*\S", src), f"{name}: '**Prerequisites:** ...' in the first cell"


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_lesson_closing(name):
    last = load(name).cells[-1]
    assert last.cell_type == "markdown", f"{name}: the last cell must be markdown"
    src = last.source
    summary, nxt, refs = src.find("## Summary"), src.find("**Next:**"), src.find("## References")
    assert summary >= 0 and re.search(r"^[*-] \S", src[summary:], re.M), f"{name}: '## Summary' with bullets"
    assert summary < nxt < refs, f"{name}: the last cell must hold, in order, '## Summary', '**Next:**', '## References'"
    i = ALL_LESSONS.index(name)
    if i + 1 < len(ALL_LESSONS):
        assert f"({ALL_LESSONS[i + 1]})" in src[nxt:refs], f"{name}: '**Next:**' must link {ALL_LESSONS[i + 1]}"
    assert f"(REFERENCES.md#lesson-{name[:2]})" in src[refs:], \
        f"{name}: '## References' must link REFERENCES.md#lesson-{name[:2]}"


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_every_citation_is_in_references(name):
    listed = section((COURSE / "REFERENCES.md").read_text(), f"### Lesson {name[:2]}")
    assert listed, f"REFERENCES.md has no '### Lesson {name[:2]}' section"
    missing = sorted(citation_ids(lesson_text(load(name))) - citation_ids(listed))
    assert not missing, f"{name} cites {missing}, which REFERENCES.md does not list under 'Lesson {name[:2]}'"


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_no_code_cell_over_25_lines(name):
    long = [(i, len(c.source.splitlines())) for i, c in enumerate(load(name).cells)
            if c.cell_type == "code" and len(c.source.splitlines()) > MAX_CODE_LINES]
    assert not long, f"{name}: code cells (index, lines) over {MAX_CODE_LINES} lines: {long}"


def test_readme_course_map_times_equal_the_lessons():
    readme = readme_minutes()
    stated = {name: stated_minutes(load(name)) for name in ALL_LESSONS}
    assert set(readme) == set(ALL_LESSONS), f"README course map rows {sorted(readme)} != lessons {ALL_LESSONS}"
    wrong = {n: (readme[n], stated[n]) for n in ALL_LESSONS if readme[n] != stated[n]}
    assert not wrong, f"README minutes != lesson '**Time:**' (README, lesson): {wrong}"


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_glossary_and_reference_links_resolve(name):
    nb = load(name)
    md = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for target, anchor in _LINK.findall(md):
        assert anchor in anchors(COURSE / target), f"{name}: link {target}#{anchor} has no such heading"


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_committed_outputs_are_clean(name):
    nb = load(name)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(c.get("execution_count") for c in code), "notebook is not fully executed"
    for c in code:
        for kind, text in outputs(c):
            assert kind not in ("stderr", "error"), f"{kind} output in {name}: {c.source[:60]!r}"
        if "nbval-ignore-output" in tags(c):
            continue
        for text in text_outputs(c):
            clean = sanitized(text)   # what nbval compares: a timing the sanitizer rewrites is fine
            assert not ADDRESS.search(text), f"memory address in {name}: {text[:200]}"
            assert not RAW_TIME.search(clean), f"raw timing nbval would compare, in {name}: {text[:200]}"
    assert "widgets" not in nb.metadata, "widget state must be stripped (scripts/run_notebook.py)"


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_widgets_are_ignored_and_have_a_static_twin(name):
    nb = load(name)
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code" or "PoolExplorer(" not in c.source:
            continue
        assert "nbval-ignore-output" in tags(c), f"{name} cell {i}: widget output must be ignored by nbval"
        rest = [x for x in nb.cells[i + 1:] if x.cell_type == "code"]
        assert rest and "draw_frames_strip" in rest[0].source, f"{name} cell {i}: no static twin follows"


@pytest.mark.parametrize("page", ["CHEATSHEET.md", "GLOSSARY.md", "INSTRUCTORS.md", "../README.md",
                                  "../docs/INSTALL.md", "../docs/USAGE.md", "../docs/BENCHMARKS.md"])
def test_reference_pages_cite_only_what_references_lists(page):
    """The checklist, glossary, instructor notes, README and the pages it moved detail into (docs/) carry
    ids too; each must have an entry."""
    listed = citation_ids((COURSE / "REFERENCES.md").read_text())
    missing = sorted(citation_ids((COURSE / page).read_text()) - listed)
    assert not missing, f"{page} cites {missing}, which course/REFERENCES.md does not list"


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_lesson_links_the_glossary(name):
    """Each lesson links the first use of the terms it introduces to course/GLOSSARY.md."""
    md = "\n".join(c.source for c in load(name).cells if c.cell_type == "markdown")
    assert any(target == "GLOSSARY.md" for target, _ in _LINK.findall(md)), f"{name}: no link into GLOSSARY.md"


@pytest.mark.parametrize("name", ALL_LESSONS)
def test_lesson_has_try_it_prompts(name):
    """Each lesson invites the learner to change something (course/INSTRUCTORS.md answers every prompt)."""
    md = "\n".join(c.source for c in load(name).cells if c.cell_type == "markdown")
    assert "**Try it.**" in md, f"{name}: no '**Try it.**' prompt"
