"""Reading committed lessons without a kernel: shared by the course structure tests.

nbval re-runs every notebook and compares outputs; these helpers let tests check the conventions
that keep that comparison meaningful (no stderr, addresses or raw timings in outputs) and the
lessons usable (objectives, summary, references), straight from the ``.ipynb`` files.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat

COURSE = Path(__file__).resolve().parent.parent / "course"
ALL_LESSONS = sorted(p.name for p in COURSE.glob("[0-9][0-9]_*.ipynb"))
ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")
RAW_TIME = re.compile(r"\b\d+(\.\d+)?\s?(ms|µs|us|seconds|sec)\b|\b\d+\.\d+\s?s\b")


def load(name: str):
    return nbformat.read(COURSE / name, as_version=4)


def outputs(cell):
    """``(kind, text)`` per output: ``stdout``/``stderr`` streams, ``display`` (text/plain), or
    the output type (``error``) with empty text."""
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            yield o.get("name"), o.text
        elif o.output_type in ("execute_result", "display_data"):
            yield "display", o.data.get("text/plain", "")
        else:
            yield o.output_type, ""


def text_outputs(cell) -> list[str]:
    return [text for kind, text in outputs(cell) if kind != "error"]


def markdown(nb) -> str:
    return "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")


def tags(cell) -> list[str]:
    return list(cell.metadata.get("tags", []))
