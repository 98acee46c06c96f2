"""Gu et al. (ICML 2025) released data: our statistics must reproduce the paper's verdicts."""
import json
import zipfile

import pytest
from scipy.stats import ks_2samp

from minikv.audit.gu import (detected_providers, find_gu_zip, gu_table, gu_verdicts, load_gu_runs)
from minikv.audit.stats import audit_samples

ZIP = find_gu_zip()
pytestmark = pytest.mark.skipif(
    ZIP is None, reason="gu-audit-data.zip not found (set MINIKV_SHARED or place it in shared/data/)")

# The paper: global (cross-organization) cache sharing in 7 of the 17 audited providers.
GLOBAL_SHARING = {"azure", "deepinfra", "fireworks", "lepton", "openai", "perplexity", "replicate"}
# Prompt caching at all (same key): those 7 plus Anthropic, which shares only within an organization.
ANY_CACHING = GLOBAL_SHARING | {"anthropic"}


@pytest.fixture(scope="module")
def runs():
    return load_gu_runs(ZIP)


@pytest.fixture(scope="module")
def verdicts(runs):
    return gu_verdicts(runs=runs)


def test_data_shape(runs):
    assert len({r.provider for r in runs}) == 17
    assert {r.level for r in runs} == {"per_user", "per_org", "global"}
    assert all(len(r.hit) > 200 and len(r.miss) > 200 for r in runs)


def test_global_sharing_is_exactly_the_papers_seven(verdicts):
    assert detected_providers(verdicts, "global") == GLOBAL_SHARING


def test_per_user_and_per_org(verdicts):
    assert detected_providers(verdicts, "per_user") == ANY_CACHING
    # Anthropic: shared inside an organization, never across organizations.
    assert "anthropic" in detected_providers(verdicts, "per_org")
    assert "anthropic" not in detected_providers(verdicts, "global")


def test_bonferroni_does_not_change_the_global_set(runs):
    assert detected_providers(gu_verdicts(runs=runs, bonferroni=True), "global") == GLOBAL_SHARING


def test_per_row_stats_are_audit_samples_on_raw_client_times(verdicts):
    for v in verdicts:
        for run, res in v.runs:
            assert res == audit_samples(run.hit, run.miss, alpha=1e-8)
            assert res.p_value == pytest.approx(ks_2samp(run.hit, run.miss, alternative="greater").pvalue)
        assert v.detected == any(res.p_value < 1e-8 for _, res in v.runs)


def test_table_mentions_the_seven(verdicts):
    text = gu_table(verdicts, detail=True)
    assert "detected in 7 of 17 providers" in text
    for p in GLOBAL_SHARING:
        assert p in text


def _rewrite(src, dst, edit):
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename.endswith(".json"):
                d = json.loads(data)
                edit(d)
                data = json.dumps(d).encode()
            zout.writestr(item, data)


def test_corrupted_stored_stats_do_not_change_verdicts(tmp_path, verdicts):
    """Invert every stored statistic (and poison server_time): verdicts must not move."""
    def poison(d):
        for block in d["stats"].values():
            ks = block.get("ks_2samp", {})
            ks["pvalue"] = 1.0 - ks.get("pvalue", 0.0) if ks.get("pvalue", 1.0) < 0.5 else 0.0
            ks["statistic"] = 1.0 - ks.get("statistic", 0.0)
            for m in ("median", "mean"):
                if m in block:
                    block[m]["cache_hit"], block[m]["cache_miss"] = block[m]["cache_miss"], block[m]["cache_hit"]
        for arm in ("cache_hit", "cache_miss"):
            for s in d[arm]:
                s["server_time"] = -1.0
    bad = tmp_path / "poisoned.zip"
    _rewrite(ZIP, bad, poison)
    poisoned = gu_verdicts(bad)
    key = lambda v: (v.provider, v.model, v.level)  # noqa: E731
    assert {key(v): v.detected for v in poisoned} == {key(v): v.detected for v in verdicts}
    assert detected_providers(poisoned, "global") == GLOBAL_SHARING


def test_deleted_stats_block_is_not_needed(tmp_path, verdicts):
    bare = tmp_path / "bare.zip"
    _rewrite(ZIP, bare, lambda d: d.pop("stats"))
    assert detected_providers(gu_verdicts(bare), "global") == GLOBAL_SHARING


def test_find_zip_honours_env(monkeypatch, tmp_path):
    monkeypatch.setenv("MINIKV_SHARED", str(ZIP.parent.parent))
    assert find_gu_zip() == ZIP
    monkeypatch.setenv("MINIKV_SHARED", str(tmp_path))
    assert find_gu_zip(start=tmp_path) is None
