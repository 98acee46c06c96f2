"""A learner's clone has no ``../shared``, no vLLM and no GPU: the lessons' checked outputs must not care.

CI runs with Gu et al.'s data beside the clone and a real vLLM, so strict nbval there cannot see a
cell whose committed output needs either.  The convention that keeps both worlds green:

* a cell that reads an optional input (Gu et al.'s data) carries the tag ``optional-data``, is
  self-contained (its own imports), and prints the same thing with or without that input;
* a cell that asks which upstream or device it runs on has its output ignored by nbval
  (``nbval-ignore-output``) or is ``optional-data``.

This module checks the first rule by *running* every ``optional-data`` cell in a fresh kernel with
``$MINIKV_SHARED`` pointing at an empty folder and an empty ``$MINIKV_HOME`` -- what a learner has --
and comparing with the committed output; nbval itself, under CI, runs them with the data present.
"""
from __future__ import annotations

import configparser
import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from course_notebooks import ALL_LESSONS, COURSE, load, tags, text_outputs

TAG = "optional-data"
#: source that reads an input a learner's clone may lack (the data itself, or where it is looked up)
READS_OPTIONAL = re.compile(r"find_gu_zip|gu_verdicts|load_gu_runs|published_figures|MINIKV_SHARED")
#: source whose output depends on what this machine runs: an upstream server or a device
ASKS_MACHINE = re.compile(r"find_upstream|cuda\.is_available|\.device_count\(")
SANITIZE = Path(__file__).with_name("nbval_sanitize.cfg")


def tagged_cells():
    for name in ALL_LESSONS:
        for i, cell in enumerate(load(name).cells):
            if cell.cell_type == "code" and TAG in tags(cell):
                yield name, i, cell


def sanitize(text: str) -> str:
    """The rewrites nbval applies before comparing (tests/nbval_sanitize.cfg), in file order."""
    cfg = configparser.ConfigParser(interpolation=None)   # as nbval reads it: "%" is literal
    cfg.read(SANITIZE)
    for section in cfg.sections():
        text = re.sub(cfg[section]["regex"], cfg[section]["replace"], text)
    return text


def test_cells_that_read_optional_inputs_are_tagged():
    untagged = [f"{name} cell {i}" for name in ALL_LESSONS for i, c in enumerate(load(name).cells)
                if c.cell_type == "code" and READS_OPTIONAL.search(c.source) and TAG not in tags(c)]
    assert not untagged, f"cells read data a learner's clone lacks but are not tagged {TAG!r}: {untagged}"


def test_cells_that_ask_which_machine_they_run_on_are_not_checked_verbatim():
    checked = [f"{name} cell {i}" for name in ALL_LESSONS for i, c in enumerate(load(name).cells)
               if c.cell_type == "code" and ASKS_MACHINE.search(c.source)
               and not {"nbval-ignore-output", TAG} & set(tags(c))]
    assert not checked, f"output depends on the machine's upstream or device but nbval checks it: {checked}"


def test_there_is_something_to_check():
    # lesson 09's table of Gu et al.'s figures is the cell this convention was made for
    assert any(name.startswith("09_") for name, _, _ in tagged_cells())


@pytest.mark.parametrize("name", sorted({name for name, _, _ in tagged_cells()}))
def test_optional_data_cells_print_their_committed_output_without_the_data(name, tmp_path, monkeypatch):
    cells = [(i, c) for n, i, c in tagged_cells() if n == name]
    for i, c in cells:
        assert "nbval-ignore-output" not in tags(c), f"{name} cell {i}: an {TAG} cell's output must be checked"
        assert text_outputs(c), f"{name} cell {i}: no committed output to compare"
    (tmp_path / "empty-shared").mkdir()
    monkeypatch.setenv("MINIKV_SHARED", str(tmp_path / "empty-shared"))
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path / "empty-home"))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(c.source) for _, c in cells])
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(COURSE)}}).execute()
    for (i, committed), fresh in zip(cells, nb.cells):
        errors = [o for o in fresh.outputs if o.output_type == "error"]
        assert not errors, f"{name} cell {i} fails without the data: {errors[0].ename}: {errors[0].evalue}"
        want, got = (sanitize("".join(text_outputs(c))) for c in (committed, fresh))
        assert got == want, f"{name} cell {i} prints something else without the data:\n{got}\n--- committed:\n{want}"
