"""Gu et al. (ICML 2025) released data: our statistics must reproduce the paper's verdicts, and every
learner can fetch the data (pinned, hash-checked) -- tested against a loopback HTTP server, never GitHub.

The verdict tests need the real zip (``$MINIKV_SHARED``, a fetched copy, or ``shared/data/`` beside the
checkout) and skip without it; the download and lookup tests run everywhere.
"""
import contextlib
import hashlib
import http.server
import json
import threading
import zipfile

import pytest
from scipy.stats import ks_2samp

from minikv.audit import gu_data
from minikv.audit.cli import main as audit_main
from minikv.audit.gu import (detected_providers, find_gu_zip, gu_table, gu_verdicts, load_gu_runs)
from minikv.audit.gu_data import GU_SHA256, GuDataError, cached_gu_zip, fetch_gu_data
from minikv.audit.stats import audit_samples

ZIP = find_gu_zip()
needs_zip = pytest.mark.skipif(
    ZIP is None, reason="gu-audit-data.zip not found (run `make gu-data`, set MINIKV_SHARED or use shared/data/)")

# The paper: global (cross-organization) cache sharing in 7 of the 17 audited providers.
GLOBAL_SHARING = {"azure", "deepinfra", "fireworks", "lepton", "openai", "perplexity", "replicate"}
# Prompt caching at all (same key): those 7 plus Anthropic, which shares only within an organization.
ANY_CACHING = GLOBAL_SHARING | {"anthropic"}


@pytest.fixture(scope="module")
def runs():
    if ZIP is None:
        pytest.skip("gu-audit-data.zip not found (run `make gu-data`)")
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


@needs_zip
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


@needs_zip
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


@needs_zip
def test_deleted_stats_block_is_not_needed(tmp_path, verdicts):
    bare = tmp_path / "bare.zip"
    _rewrite(ZIP, bare, lambda d: d.pop("stats"))
    assert detected_providers(gu_verdicts(bare), "global") == GLOBAL_SHARING




# --- lookup order: $MINIKV_SHARED, then the fetched copy in $MINIKV_HOME, then shared/ beside the checkout ---

def test_lookup_order(monkeypatch, tmp_path):
    env_dir, home, checkout = tmp_path / "env", tmp_path / "home", tmp_path / "repo" / "pkg"
    monkeypatch.setenv("MINIKV_HOME", str(home))
    monkeypatch.delenv("MINIKV_SHARED", raising=False)
    beside = tmp_path / "shared" / "data" / "gu-audit-data.zip"   # shared/ next to the checkout, as in CI
    for f in (env_dir / "data" / "gu-audit-data.zip", cached_gu_zip(), beside):
        f.parent.mkdir(parents=True)
        f.write_bytes(b"x")
    checkout.mkdir(parents=True)
    monkeypatch.setenv("MINIKV_SHARED", str(env_dir))
    assert find_gu_zip(start=checkout) == env_dir / "data" / "gu-audit-data.zip"
    monkeypatch.delenv("MINIKV_SHARED")
    assert find_gu_zip(start=checkout) == cached_gu_zip() == home / "data" / "gu-audit-data.zip"
    cached_gu_zip().unlink()
    assert find_gu_zip(start=checkout) == beside
    monkeypatch.setenv("MINIKV_SHARED", str(tmp_path / "empty"))   # a set $MINIKV_SHARED replaces the walk up
    assert find_gu_zip(start=checkout) is None
    monkeypatch.delenv("MINIKV_SHARED")
    beside.unlink()
    assert find_gu_zip(start=checkout) is None


# --- the download, against a loopback server --------------------------------------------------------

@contextlib.contextmanager
def serving(files: dict[str, bytes]):
    """Serve ``files`` (path -> bytes) on 127.0.0.1; yields (base_url, list of paths requested)."""
    hits = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 -- the http.server API
            hits.append(self.path)
            body = files.get(self.path)
            if body is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", hits
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


PAYLOAD = b"PK-not-really-a-zip-" * 5000          # the download path does not care what the bytes are
PAYLOAD_SHA = hashlib.sha256(PAYLOAD).hexdigest()


def leftovers(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_fetch_downloads_verifies_and_then_reuses(tmp_path):
    dest = tmp_path / "data" / "gu-audit-data.zip"
    with serving({"/audit-data.zip": PAYLOAD}) as (base, hits):
        got = fetch_gu_data(base + "/audit-data.zip", dest, expected=PAYLOAD_SHA, progress=False)
        assert got == dest and dest.read_bytes() == PAYLOAD
        assert fetch_gu_data(base + "/audit-data.zip", dest, expected=PAYLOAD_SHA, progress=False) == dest
    assert hits == ["/audit-data.zip"]            # the second call found a verified copy: no request
    assert leftovers(dest.parent) == ["gu-audit-data.zip"]


def test_corrupted_download_is_refused_and_nothing_is_left(tmp_path):
    dest = tmp_path / "data" / "gu-audit-data.zip"
    corrupt = bytearray(PAYLOAD)
    corrupt[1234] ^= 0x01
    with serving({"/audit-data.zip": bytes(corrupt)}) as (base, _):
        with pytest.raises(GuDataError) as err:
            fetch_gu_data(base + "/audit-data.zip", dest, expected=PAYLOAD_SHA, progress=False)
    msg = str(err.value)
    assert "sha256 mismatch" in msg and PAYLOAD_SHA in msg and hashlib.sha256(corrupt).hexdigest() in msg
    assert not dest.exists() and leftovers(dest.parent) == []


def test_a_corrupted_cached_copy_is_replaced(tmp_path):
    dest = tmp_path / "gu-audit-data.zip"
    dest.write_bytes(b"truncated")
    with serving({"/audit-data.zip": PAYLOAD}) as (base, hits):
        fetch_gu_data(base + "/audit-data.zip", dest, expected=PAYLOAD_SHA, progress=False)
    assert dest.read_bytes() == PAYLOAD and hits == ["/audit-data.zip"]


def test_a_corrupted_cached_copy_is_removed_even_when_the_download_fails(tmp_path):
    dest = tmp_path / "gu-audit-data.zip"
    dest.write_bytes(b"truncated")
    with serving({}) as (base, _):
        with pytest.raises(GuDataError, match="could not download .*404"):
            fetch_gu_data(base + "/audit-data.zip", dest, expected=PAYLOAD_SHA, progress=False)
    assert leftovers(tmp_path) == []


def test_http_error_names_the_url_and_the_offline_way(tmp_path):
    with serving({}) as (base, _):
        with pytest.raises(GuDataError) as err:
            fetch_gu_data(base + "/missing.zip", tmp_path / "z.zip", progress=False)
    assert base + "/missing.zip" in str(err.value) and "MINIKV_SHARED" in str(err.value)
    assert leftovers(tmp_path) == []


@needs_zip
def test_the_pinned_hash_is_the_shared_copy():
    assert hashlib.sha256(ZIP.read_bytes()).hexdigest() == GU_SHA256


@needs_zip
def test_cli_fetch_serves_the_shared_copy_then_reproduces_the_paper(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MINIKV_SHARED", raising=False)
    with serving({"/audit-data.zip": ZIP.read_bytes()}) as (base, hits):
        rc = audit_main(["audit", "gu", "--fetch", "--url", base + "/audit-data.zip", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0 and hits == ["/audit-data.zip"]
    assert cached_gu_zip().read_bytes() == ZIP.read_bytes()
    for author in ("Chenchen Gu", "Xiang Lisa Li", "Rohith Kuditipudi", "Percy Liang", "Tatsunori Hashimoto"):
        assert author in out
    assert "detected in 7 of 17 providers" in out


@needs_zip
def test_cli_fetch_of_a_corrupted_copy_fails_clearly(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("MINIKV_SHARED", raising=False)
    corrupt = bytearray(ZIP.read_bytes())
    corrupt[len(corrupt) // 2] ^= 0xFF
    with serving({"/audit-data.zip": bytes(corrupt)}) as (base, _):
        rc = audit_main(["audit", "gu", "--fetch", "--url", base + "/audit-data.zip", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and "sha256 mismatch" in err and GU_SHA256 in err
    assert leftovers(cached_gu_zip().parent) == []


def test_module_entry_point_reports_failure(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    with serving({"/audit-data.zip": PAYLOAD}) as (base, _):   # right file name, wrong bytes for the pin
        assert gu_data.main([base + "/audit-data.zip"]) == 1
    assert "sha256 mismatch" in capsys.readouterr().err and not cached_gu_zip().exists()
