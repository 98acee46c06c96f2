"""What a reader sees renders, and speaks to the reader, not to the people who built the project.

Checked: ``README.md``, ``docs/*.md``, ``course/*.md`` and every lesson -- its markdown cells, its code
cells and their text outputs, all of which a learner reads.

* **Tables render.**  Each pipe table is parsed the way GitHub parses it: CommonMark with the GFM
  ``table`` extension (markdown-it-py).  Under GFM a table whose delimiter row has a different number
  of cells than its header row is no table at all: the renderer emits a paragraph of pipes.  A
  delimiter row (``|---|:--:|``) left inside a paragraph is such a table.
* **No private references.**  A learner cannot open this project's tracker, and words about how the
  project was made tell a learner nothing.  ``issue 38``, ``#38`` or ``PR #12`` with no repository named
  in the same sentence, ``stop 3``, and the phrases of ``BUILD_WORDS`` fail.  Another project's issue or
  pull request is welcome when its repository is named before the number: ``vLLM #44701``,
  ``vllm-project/vllm#53347``, ``an open SGLang issue, #37160``.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from markdown_it import MarkdownIt

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "course").glob("*.md")])
LESSONS = sorted((ROOT / "course").glob("[0-9][0-9]_*.ipynb"))

_GFM = MarkdownIt("commonmark").enable("table")
_DELIMITER_ROW = re.compile(r"^[\s|:-]*$")

#: projects whose issues and pull requests the course cites; one of them must be named before a number
PROJECTS = ("vllm", "sglang", "lmcache", "megatron-lm", "mlc-llm", "openvino", "litellm", "tinfoil", "llama.cpp",
            "transformers", "pytorch", "flashinfer", "tensorrt-llm", "triton", "jupyterlab", "nbval", "ipywidgets",
            "llm-d", "gateway-api-inference-extension", "kubernetes", "aisvs")
_NUMBERED = re.compile(r"""(?<![&"'#\w])(?:\b(?:issues?|PRs?|pull requests?)\s+#?\d+\b|#\d+\b)""", re.I)
#: where a sentence (or a table cell, or a list item) begins: a repository named before it does not count
_SENTENCE_START = re.compile(r"\n\s*\n|\||\.\s|\n\s*[*-]\s")
_HEADING = re.compile(r"^#{1,6} .*$", re.M)
#: words about how the project was built, each precise enough never to be a lesson's subject
BUILD_WORDS = re.compile(
    r"\bstop \d+\b|\b(?:a|the|by a) coding agents?\b|\bby an? (?:AI |LLM )?agent\b|\ban agent\b|\btimed walkthrough\b"
    r"|\bwalkthrough by\b|\bhelper H\d+\w*|\bthis project's (?:tracker|issues?|sessions?)\b"
    r"|\b(?:this|that|an earlier|a later|the previous|the next|earlier|later|the two|a GPU) sessions?\b"
    r"|\bsession's\b|\bthe lead(?: engineer)?'s note\b", re.I)


# --- the checkers ------------------------------------------------------------------------------------

def unrendered_tables(md: str) -> list[int]:
    """1-based line numbers of the delimiter rows in ``md`` that GFM leaves inside a paragraph: the
    tables that do not render."""
    tokens = _GFM.parse(md)
    bad = []
    for opening, inline in zip(tokens, tokens[1:]):
        if opening.type != "paragraph_open" or inline.type != "inline":
            continue
        for k, line in enumerate(inline.content.splitlines()):
            if "|" in line and "-" in line and _DELIMITER_ROW.match(line):
                bad.append(inline.map[0] + k + 1)
    return bad


def _names_a_project(text: str) -> bool:
    low = text.lower()
    return any(re.search(rf"(?<![\w-]){re.escape(p)}(?![\w-])", low) for p in PROJECTS)


def _repository_named_before(text: str, start: int) -> bool:
    """Whether the sentence before ``start`` names a repository; in a table row, whether the row or the
    heading above the table does (a table of one project's issues names it once, in its heading)."""
    window = text[max(0, start - 160):start]
    cuts = [m.end() for m in _SENTENCE_START.finditer(window)]
    window = window[cuts[-1]:] if cuts else window
    if re.search(r"[\w.-]+/[\w.-]+\s*$", window) or _names_a_project(window):
        return True
    line_start = text.rfind("\n", 0, start) + 1
    line = text[line_start:text.find("\n", start) if "\n" in text[start:] else len(text)]
    if not line.lstrip().startswith("|"):
        return False
    headings = _HEADING.findall(text, 0, line_start)
    return _names_a_project(line) or bool(headings and _names_a_project(headings[-1]))


def private_references(text: str) -> list[str]:
    """Every reference in ``text`` to this project's own tracker, or to how it was built."""
    found = [m.group(0) for m in _NUMBERED.finditer(text) if not _repository_named_before(text, m.start())]
    return found + [m.group(0) for m in BUILD_WORDS.finditer(text)]


def lesson_texts(path: Path):
    """``(where, text)`` for every markdown cell, code cell and text output of the lesson at ``path``."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        yield f"{path.name} cell {i} ({cell.cell_type})", cell.source
        for out in cell.get("outputs", []):
            text = out.get("text") or out.get("data", {}).get("text/plain", "")
            if text:
                yield f"{path.name} cell {i} (output)", text


def _name(p: Path) -> str:
    return str(p.relative_to(ROOT))


# --- the checkers first, on text made to break them --------------------------------------------------

OLD_README_MAP = ("| | Lesson | What you learn | Published anchor | Time |\n"
                  "|---|---|---|---|---|---|---|\n"
                  "| x | [00 Welcome](course/00_welcome.ipynb) | threat model | Gu et al. | 20 min |\n")


def test_a_table_whose_delimiter_row_does_not_match_its_header_is_reported():
    assert unrendered_tables(OLD_README_MAP) == [2]          # the course map as it stood: 5 cells over 7
    fixed = OLD_README_MAP.replace("|---|---|---|---|---|---|---|", "|---|---|---|---|---|")
    assert unrendered_tables(fixed) == []
    assert unrendered_tables("text\n\n| a | b |\n|:-:|\n| 1 | 2 |\n") == [4]
    assert unrendered_tables("> | a | b |\n> |---|---|\n> | 1 | 2 |\n") == []    # a table in a quote renders
    assert unrendered_tables("```\n| a |\n|---|---|\n```\n\nTitle\n---\n") == []  # code; a setext heading


def test_private_references_are_reported_and_named_repositories_are_not():
    planted = ("The targets are issue 11's. See #38 and PR #12; stop 3 found it. A coding agent timed the "
               "walkthrough by an agent in this session; this project's issue 14 fixed it.")
    assert private_references(planted) == ["issue 11", "#38", "PR #12", "issue 14", "stop 3", "A coding agent",
                                           "walkthrough by", "an agent", "this session", "this project's issue"]
    cited = ("vLLM #44701, SGLang #30827 and LMCache\n  #4825; vllm-project/vllm#53347; an open SGLang issue, "
             "#37160; Megatron-LM PR #4158; a LiteLLM PR (#27925); SGLang issue #24527; "
             'color="#999999"; its own session; a FAQ session; a human agent.')
    assert private_references(cited) == []
    assert private_references("vLLM fixed it. Then #5 came.") == ["#5"]   # the name is in another sentence
    table = "## SGLang pull requests\n\n| # | What |\n|---|---|\n| #23300 | salt fix |\n\n## Ours\n\n| #7 | x |\n"
    assert private_references(table) == ["#7"]           # a table's repository may be named in its heading


# --- the real pages ----------------------------------------------------------------------------------

@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_table_of_a_page_renders(page):
    bad = unrendered_tables(page.read_text(encoding="utf-8"))
    assert not bad, f"{_name(page)}: the pipe block at line(s) {bad} renders as text, not a table (the " \
                    "delimiter row must have as many cells as the header row)"


@pytest.mark.parametrize("lesson", LESSONS, ids=_name)
def test_every_table_of_a_lesson_renders(lesson):
    nb = nbformat.read(lesson, as_version=4)
    bad = [(i, unrendered_tables(c.source)) for i, c in enumerate(nb.cells) if c.cell_type == "markdown"]
    bad = [(i, lines) for i, lines in bad if lines]
    assert not bad, f"{lesson.name}: tables that do not render, (cell, lines): {bad}"


@pytest.mark.parametrize("path", PAGES + LESSONS, ids=_name)
def test_no_reference_to_this_projects_tracker_or_how_it_was_built(path):
    texts = lesson_texts(path) if path.suffix == ".ipynb" else [(_name(path), path.read_text(encoding="utf-8"))]
    bad = [f"{where}: {hit!r}" for where, text in texts for hit in private_references(text)]
    assert not bad, "a learner cannot follow these (name the other project's repository, or say it " \
                    "in words):\n" + "\n".join(bad)


def test_lesson_00_maps_every_lesson():
    """Lesson 00's course map links every lesson in course/, 00 to the last, in order."""
    nb = nbformat.read(ROOT / "course" / "00_welcome.ipynb", as_version=4)
    maps = [c.source for c in nb.cells if c.cell_type == "markdown" and "A map of the course" in c.source]
    assert len(maps) == 1, "lesson 00 has one cell headed 'A map of the course'"
    linked = re.findall(r"\]\((\d\d_[\w-]+\.ipynb)\)", maps[0])
    assert linked == [p.name for p in LESSONS], f"the map links {linked}"
    assert not unrendered_tables(maps[0])


def test_lesson_12_shows_how_to_practise_on_a_graded_fleet():
    """The capstone's graded fleet holds every kind, the demo fleets do not: lesson 12 says so and gives
    the command that starts a graded-style fleet to practise on."""
    nb = nbformat.read(ROOT / "course" / "12_capstone_mystery_fleet.ipynb", as_version=4)
    md = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    assert "python -m minikv.grading.mystery_fleet --graded" in md
    assert re.search(r"graded fleet[^.]*\bevery\b\**\s+kind", md), "lesson 12 says a graded fleet holds every kind"
    source = (ROOT / "minikv" / "grading" / "mystery_fleet.py").read_text(encoding="utf-8")
    assert '"--graded"' in source and '"--seed"' in source       # the options the command uses exist
