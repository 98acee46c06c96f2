"""The figures minikv ships from Gu et al.'s release (``minikv/audit/gu_figures.json``).

Lesson 09 prints them with or without the data, so a learner's clone and CI show the same table.
That is only honest if the file is what the data says: where the zip is present (CI has it), the
figures are recomputed from the raw times and must agree; everywhere, the file must hold the
paper's finding and the comparison must notice any edited figure.
"""
import copy
import json

import pytest

from minikv.audit import gu_figures
from minikv.audit.gu import find_gu_zip, gu_verdicts
from minikv.audit.gu_figures import GuFiguresMismatch, compare, derive_figures, load_figures, published_figures

from test_audit_gu import GLOBAL_SHARING, needs_zip


def test_shipped_figures_hold_the_papers_seven_of_seventeen():
    figs = load_figures()
    assert figs["providers"] == 17 and "Gu" in figs["source"] and figs["commit"].startswith("c96da85")
    detected = {r["provider"] for r in figs["rows"] if r["level"] == "global" and r["detected"]}
    assert detected == GLOBAL_SHARING
    assert all(200 < r["n_hit"] <= 250 and 200 < r["n_miss"] <= 250 for r in figs["rows"])   # 250 asked, a few failed
    # a detected row is one whose strongest configuration beat alpha = 1e-8, and only those
    assert all(r["detected"] == (r["ks_p"] < 1e-8) for r in figs["rows"])


@pytest.mark.parametrize("field, value", [("ks_p", 2e-3), ("auc", 0.5), ("detected", False), ("n_hit", 249),
                                          ("model", "another-model")])
def test_compare_names_every_edited_figure(field, value):
    shipped = load_figures()
    edited = copy.deepcopy(shipped)
    edited["rows"][0][field] = value
    diffs = compare(shipped, edited)
    assert diffs and (field in diffs[0] or "only in" in diffs[0]), diffs
    assert compare(shipped, copy.deepcopy(shipped)) == []


def test_without_the_data_the_shipped_figures_are_returned_unchecked(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIKV_SHARED", str(tmp_path / "nowhere"))
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path / "home"))
    assert find_gu_zip() is None
    figs, recomputed = published_figures()
    assert figs == load_figures() and recomputed is False


@needs_zip
def test_shipped_figures_are_what_the_released_data_gives():
    figs, recomputed = published_figures(find_gu_zip())
    assert recomputed is True
    assert compare(figs, derive_figures(gu_verdicts(find_gu_zip()))) == []


@needs_zip
def test_an_edited_shipped_file_is_refused_against_the_data(tmp_path):
    figs = load_figures()
    row = next(r for r in figs["rows"] if r["level"] == "global" and r["provider"] == "lepton")
    row["detected"], row["ks_p"] = False, 0.5          # claim lepton does not share
    edited = tmp_path / "gu_figures.json"
    edited.write_text(json.dumps(figs))
    with pytest.raises(GuFiguresMismatch, match="lepton"):
        published_figures(find_gu_zip(), path=edited)


@needs_zip
def test_another_zip_is_refused_by_its_hash(tmp_path):
    other = tmp_path / "gu-audit-data.zip"
    other.write_bytes(find_gu_zip().read_bytes() + b"\0")
    with pytest.raises(GuFiguresMismatch, match="not the release"):
        published_figures(other)


def test_module_entry_point_without_data_says_how_to_get_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MINIKV_SHARED", str(tmp_path / "nowhere"))
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path / "home"))
    assert gu_figures.main([]) == 2
    assert "make gu-data" in capsys.readouterr().err
