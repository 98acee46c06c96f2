"""Hints and grader messages ask, they don't tell -- and where they point, the lesson has it.

``tests/test_grading_tools.py::test_levels_1_and_2_ask_and_never_state_the_rule`` keeps each
exercise's forbidden phrases (``hints.FORBIDDEN_PHRASES``: the rule, in the words that used to give
it away) out of hint levels 1 and 2.  A learner meets the same answers in two more places, checked here:

* **Grader messages.**  Read from the source of every module in ``minikv/grading/`` (no grader is
  run): each *hint* a grader gives on failure -- the ``hint`` of ``expect`` and ``CheckFailed``, the
  default of ``@grader``, an ``*_hint=`` keyword, a ``hint = ...`` assignment, the second string of a
  ``(bug class, why)`` pair -- holds none of the forbidden phrases of the exercises that module grades.
  Every string of those modules, diagnoses included, names no scrub placement the reference chose
  (``ANSWER_PATTERNS``): a diagnosis names the bug class, never the rows that fix it.
* **Graded lessons.**  The markdown of every lesson that holds an exercise holds none of its exercises'
  forbidden phrases, nor an ``ANSWER_PATTERNS`` match.

Where a hint (or a grader's hint) points into a lesson, it says where in words a test can check: a cell
by its tag (``lesson 08's cell tagged `smoke-test```), which that lesson's cell must carry, or a section
by its number (``lesson 07's section 5``), which must be one of that lesson's ``## N.`` headings.
"""
from __future__ import annotations

import ast
import inspect
import re
from pathlib import Path

import nbformat
import pytest

from minikv.grading import hints
from minikv.grading.runner import EXERCISES

ROOT = Path(__file__).resolve().parents[1]
GRADING = ROOT / "minikv" / "grading"
COURSE = ROOT / "course"

#: the reference's scrub placement in words: a grader string that says where to zero, by lifecycle row
_ROW = r"'(?:allocate|free|evict|hit|adopt|store|cache|promote|isolate)'"
ANSWER_PATTERNS = [
    re.compile(rf"\bzero(?:es|ing)?\b[^.?!]*\({_ROW}(?:,\s*{_ROW})*\)", re.I),   # zero on ... ('free', 'evict')
    re.compile(rf"\(transition {_ROW}\)"),                                         # bug class (transition 'free')
    re.compile(rf"\bthrough (?:the same )?{_ROW}"),                                # leaves through 'free'
]
_CELL_TAG = re.compile(r"[Ll]esson (\d\d)'s cells? tagged `([\w-]+)`")
_CELL_UNTAGGED = re.compile(r"[Ll]esson (\d\d)'s cells?\b(?! tagged)|[Ll]esson \d\d (?:has a cell|does\))")
_SECTION = re.compile(r"[Ll]esson (\d\d)(?:'s|,) section (\d+)")


# --- what the checks read ----------------------------------------------------------------------------

def _text(node: ast.AST) -> str:
    """The literal text of a string expression (f-string holes read as ``{}``; both arms of a
    conditional, joined)."""
    parts = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.JoinedStr):
            parts.append("".join(v.value if isinstance(v, ast.Constant) else "{}" for v in sub.values))
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and not any(
                isinstance(p, ast.JoinedStr) and sub in p.values for p in ast.walk(node)):
            parts.append(sub.value)
    return " ".join(parts)


def _name(func: ast.AST) -> str:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def grader_hints(source: str) -> list[str]:
    """Every hint a grader module's source gives a learner on failure (see the module docstring)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            position = {"expect": 2, "CheckFailed": 1, "grader": 0}.get(_name(node.func))
            if position is not None and len(node.args) > position:
                found.append(_text(node.args[position]))
            found += [_text(k.value) for k in node.keywords if k.arg and (k.arg == "hint" or k.arg.endswith("_hint"))]
        elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "hint" for t in node.targets):
            found.append(_text(node.value))
        elif isinstance(node, ast.Dict):
            found += [_text(v.elts[1]) for v in node.values if isinstance(v, ast.Tuple) and len(v.elts) == 2
                      and all(isinstance(e, (ast.Constant, ast.JoinedStr)) for e in v.elts)]
    return [h for h in found if h]


def message_strings(source: str) -> list[str]:
    """Every string of a module's source but its docstrings: diagnoses, hints, labels."""
    tree = ast.parse(source)
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [_text(n) for n in ast.walk(tree) if isinstance(n, (ast.Constant, ast.JoinedStr)) and id(n) not in docs
            and (isinstance(n, ast.JoinedStr) or isinstance(n.value, str))]


def leaks(text: str, exercise_ids) -> list[str]:
    """The forbidden phrases of ``exercise_ids`` and the ``ANSWER_PATTERNS`` matches found in ``text``."""
    low = text.lower()
    found = [p for ex in exercise_ids for p in hints.FORBIDDEN_PHRASES.get(ex, []) if p.lower() in low]
    return found + [m.group(0) for pattern in ANSWER_PATTERNS for m in pattern.finditer(text)]


def graded_by_module() -> dict[Path, list[str]]:
    """Each module of ``minikv/grading/`` -> the exercises whose grader is defined in it."""
    out = {p: [] for p in sorted(GRADING.glob("*.py"))}
    for ex in EXERCISES:
        out[Path(inspect.getsourcefile(inspect.unwrap(ex.check))).resolve()].append(ex.id)
    return out


def lesson_path(number: str) -> Path:
    return next(COURSE.glob(f"{number}_*.ipynb"))


def bad_pointers(text: str) -> list[str]:
    """Each pointer into a lesson in ``text`` that the lesson cannot answer."""
    bad = [m.group(0) for m in _CELL_UNTAGGED.finditer(text)]
    for number, tag in _CELL_TAG.findall(text):
        cells = nbformat.read(lesson_path(number), as_version=4).cells
        if not any(tag in c.metadata.get("tags", []) for c in cells):
            bad.append(f"lesson {number} has no cell tagged {tag!r}")
    for number, section in _SECTION.findall(text):
        md = "\n".join(c.source for c in nbformat.read(lesson_path(number), as_version=4).cells
                       if c.cell_type == "markdown")
        if not re.search(rf"^## {section}\. ", md, re.M):
            bad.append(f"lesson {number} has no section {section}")
    return bad


# --- the checks first, on text made to break them ----------------------------------------------------

PLANTED = '''
@grader("which rows put old bytes within a new reader's reach?")
def check(scrub_action):
    expect(ok, "your decision wipes every cache release (bug class: destroys reuse)",
           "zero on the way into the free list ('free', 'evict') or out of it ('allocate').")
'''


def test_a_grader_message_naming_the_references_transitions_is_a_leak():
    said = grader_hints(PLANTED)
    assert said == ["which rows put old bytes within a new reader's reach?",
                    "zero on the way into the free list ('free', 'evict') or out of it ('allocate')."]
    assert leaks(said[1], ["3b"])             # 3b's phrases and the pattern both catch it
    assert leaks(said[1], [])                 # the pattern alone, for a module that grades nothing
    assert leaks("not scrubbed on LRU eviction (transition 'evict')", [])
    assert not leaks(said[0], ["3b"]) and not leaks("scrub_action('defragment', None) raised", [])


def test_pointers_into_lessons_must_resolve():
    assert bad_pointers("Lesson 08's cells on preemption and abort trace the rows") == ["Lesson 08's cells"]
    assert bad_pointers("lesson 08's cell tagged `no-such-tag`") == ["lesson 08 has no cell tagged 'no-such-tag'"]
    assert bad_pointers("Lesson 07's section 42") == ["lesson 07 has no section 42"]
    assert bad_pointers("lesson 08's cell tagged `smoke-test`; lesson 07, section 5") == []


# --- the real hints, graders and lessons --------------------------------------------------------------

@pytest.mark.parametrize("module", sorted(graded_by_module()), ids=lambda p: p.name)
def test_grader_messages_ask_and_never_state_the_rule(module):
    source = module.read_text(encoding="utf-8")
    exercises = graded_by_module()[module]
    bad = [f"hint {h[:90]!r}: {leaks(h, exercises)}" for h in grader_hints(source) if leaks(h, exercises)]
    if module.name != "hints.py":   # its FORBIDDEN_PHRASES quote the leaks on purpose; its hints: below
        bad += [f"message {s[:90]!r}: {leaks(s, [])}" for s in message_strings(source) if leaks(s, [])]
    bad += [f"{h[:90]!r}: {bad_pointers(h)}" for h in grader_hints(source) if bad_pointers(h)]
    assert not bad, f"{module.name} tells the answer, or points where no lesson answers:\n" + "\n".join(bad)


@pytest.mark.parametrize("lesson", sorted({e.lesson for e in EXERCISES}))
def test_a_graded_lessons_prose_never_states_the_rule(lesson):
    exercises = [e.id for e in EXERCISES if e.lesson == lesson]
    nb = nbformat.read(lesson_path(lesson), as_version=4)
    bad = [f"cell {i}: {leaks(c.source, exercises)}" for i, c in enumerate(nb.cells)
           if c.cell_type == "markdown" and leaks(c.source, exercises)]
    assert not bad, f"lesson {lesson}'s prose states what exercises {exercises} must find:\n" + "\n".join(bad)


@pytest.mark.parametrize("ex_id", sorted(hints.HINTS))
def test_every_hint_points_into_a_lesson_by_tag_or_section_and_names_no_placement(ex_id):
    bad = [p for level in hints.HINTS[ex_id] for p in bad_pointers(level) + leaks(level, [])]
    assert not bad, f"hint {ex_id}: {bad}"
