"""The concurrent multi-tenant isolation audit (minikv.audit.isolation), both modes and the CLI."""
from __future__ import annotations

import json
import os

import pytest

from minikv import LLM
from minikv.audit.isolation import (FAIL, INCONCLUSIVE, LABELS, PASS, IsolationReport, audit_engine,
                                    audit_server, build_workload)
from minikv.cli import main
from minikv.serve import BackgroundServer, create_app

pytestmark = pytest.mark.filterwarnings("ignore::minikv.engine.config.UnsafeSettingWarning")


def engine_kwargs(tiny_path, **kw):
    return dict(model=str(tiny_path), num_blocks=1024, block_size=16, **kw)


def one_sided_verdict(report: IsolationReport) -> str:
    """What a naive auditor concludes from the cross-tenant direction alone."""
    return PASS if report.cross_tenant_cached_tokens == 0 else FAIL


# ------------------------------------------------------------------ workload
def test_workload_shape():
    waves = build_workload(["a", "b", "c"], rounds=2, salt="00ff")
    labels = [r.label for w in waves for r in w]
    assert set(labels) == set(LABELS)
    # every tenant copies every other tenant's document exactly once over two rounds
    copies = [(r.tenant, r.prompt.split()[0]) for w in waves for r in w if r.label == "private-copy"]
    assert len(copies) == len(set(copies)) == 6
    # documents of different tenants differ from their first characters on
    docs = {r.tenant: r.prompt for r in waves[0] if r.label == "private-prime"}
    assert len({d[:8] for d in docs.values()}) == 3
    # deterministic for a fixed salt and seed; a new salt changes every prompt
    assert build_workload(["a", "b", "c"], salt="00ff") == build_workload(["a", "b", "c"], salt="00ff")
    other = build_workload(["a", "b", "c"], salt="beef")
    assert not {r.prompt for w in waves for r in w} & {r.prompt for w in other for r in w}
    with pytest.raises(ValueError):
        build_workload(["only"])
    with pytest.raises(ValueError):
        build_workload(["a", "b"], rounds=0)


# ------------------------------------------------------------------ engine mode
def test_shared_cache_is_a_violation(tiny_path):
    r = audit_engine(engine_kwargs(tiny_path, enable_prefix_caching=True, cache_isolation="shared"))
    assert r.verdict == FAIL and r.violation
    assert r.cross_tenant_cached_tokens > 0 and r.foreign_block_holds > 0
    assert r.by_label["private-copy"]["cached_tokens"] > 0  # the copied secret was served from cache
    assert {v["label"] for v in r.violations} >= {"private-copy", "system-first"}
    assert "VIOLATION" in r.summary()


def test_tenant_isolation_passes_and_sees_hits(tiny_path):
    r = audit_engine(engine_kwargs(tiny_path, enable_prefix_caching=True, cache_isolation="tenant"),
                     tenants=("alice", "bob", "carol", "dave"), rounds=3)
    assert r.verdict == PASS, r.summary()
    assert r.cross_tenant_cached_tokens == 0 and r.foreign_block_holds == 0
    assert r.same_tenant_cached_tokens > 0
    assert r.by_label["private-repeat"]["cached_tokens"] > 0
    assert r.by_label["private-copy"]["cached_tokens"] == 0
    assert r.by_label["system-first"]["cached_tokens"] == 0
    d = json.loads(r.to_json())
    assert d["verdict"] == PASS and d["violation"] is False


@pytest.mark.parametrize("isolation", ["shared", "tenant"])
@pytest.mark.parametrize("first, second", [("alice", "bob"), ("bob", "alice"), ("alice", "alice")])
def test_an_adopted_block_counts_like_a_hit(tiny_path, monkeypatch, isolation, first, second):
    """One wave of two requests with one prompt, admitted in the same step: the second computes the
    prompt's blocks too, then adopts the first's copy at commit (no hit at admission).  Another
    tenant's adopted block is a violation, in both directions; the same tenant's is a same-tenant reuse."""
    from minikv.audit import isolation_engine
    from minikv.audit.isolation import AuditRequest
    prompt = "adopt " + " ".join(f"w{i}" for i in range(60))
    wave = [AuditRequest(0, "private-prime", first, prompt), AuditRequest(0, "private-copy", second, prompt)]
    monkeypatch.setattr(isolation_engine, "build_workload", lambda *a, **k: [wave])
    llm = LLM(**engine_kwargs(tiny_path, enable_prefix_caching=True, cache_isolation=isolation))
    adopted = []
    llm.engine.block_manager.listeners.append(lambda t, ids, seq: adopted.extend(ids) if t == "adopt" else None)
    r = audit_engine(llm, arrivals_per_step=2)
    assert r.by_label["private-copy"]["cached_tokens"] == 0  # nothing was cached at admission
    if first == second or isolation == "shared":
        assert adopted, "the scenario must adopt"
        reused = 16 * len(adopted)
        if first != second:
            assert r.verdict == FAIL and r.cross_tenant_cached_tokens == reused
            assert r.violations == [{"label": "private-copy", "tenant": second, "cached_tokens": reused,
                                     "owners": [first]}]
        else:
            assert r.cross_tenant_cached_tokens == 0 and r.same_tenant_cached_tokens == reused
    else:  # tenant isolation: another tenant's twin is in another domain, never adopted
        assert not adopted and r.cross_tenant_cached_tokens == 0 and not r.violation


def test_one_sided_audit_is_insufficient_without_caching(tiny_path):
    """Caching off: nothing can leak, but nothing can be *seen* either.  A one-sided auditor
    (cross-tenant == 0 -> pass) passes; ours must say inconclusive (vLLM docs PR #53347)."""
    r = audit_engine(engine_kwargs(tiny_path, enable_prefix_caching=False))
    assert r.cross_tenant_cached_tokens == 0 and r.same_tenant_cached_tokens == 0
    assert one_sided_verdict(r) == PASS  # the insufficient check is fooled ...
    assert r.verdict == INCONCLUSIVE      # ... the two-sided one is not
    assert not r.passed and "cannot tell" in r.explanation()


def test_request_isolation_is_inconclusive(tiny_path):
    r = audit_engine(engine_kwargs(tiny_path, enable_prefix_caching=True, cache_isolation="request"))
    assert r.verdict == INCONCLUSIVE and r.cross_tenant_cached_tokens == 0


def test_declared_shared_prefix_is_not_a_violation(tiny_path):
    salt = "5a17"
    waves = build_workload(["alice", "bob", "carol"], salt=salt)
    system = [r.prompt for w in waves for r in w if r.label.startswith("system")]
    common = os.path.commonprefix(system)
    llm = LLM(**engine_kwargs(tiny_path, enable_prefix_caching=True, shared_prefixes=(common,)))
    r = audit_engine(llm, tenants=("alice", "bob", "carol"), salt=salt)
    assert r.verdict == PASS, r.summary()
    assert r.public_cached_tokens > 0  # other tenants did share the public system prompt
    assert r.by_label["system-first"]["cached_tokens"] > 0


def test_engine_must_be_idle(tiny_path):
    from minikv import SamplingParams
    llm = LLM(**engine_kwargs(tiny_path))
    llm.engine.add_request("busy", "hello", SamplingParams(max_tokens=2))
    with pytest.raises(ValueError):
        audit_engine(llm)


# ------------------------------------------------------------------ server mode
KEYS = {"sk-a1": "alice", "sk-a2": "alice", "sk-b": "bob", "sk-c": "carol"}


def _server(tiny_path, report=True, **kw):
    llm = LLM(**engine_kwargs(tiny_path, enable_prefix_caching=True, **kw))
    return BackgroundServer(create_app(llm, KEYS, model_name="tiny", report_cached_tokens=report))


@pytest.mark.parametrize("isolation,verdict", [("tenant", PASS), ("shared", FAIL)])
def test_audit_server(tiny_path, isolation, verdict):
    with _server(tiny_path, cache_isolation=isolation) as srv:
        r = audit_server(srv.base_url, KEYS, concurrency=6)
    assert r.mode == "server" and r.failures == 0
    assert r.verdict == verdict, r.summary()
    assert r.same_tenant_cached_tokens > 0
    assert "sk-" not in r.to_json()  # keys never end up in the report


def test_audit_server_without_cached_token_reports_is_inconclusive(tiny_path):
    with _server(tiny_path, report=False, cache_isolation="shared") as srv:
        r = audit_server(srv.base_url, KEYS, model="tiny", rounds=1)
    assert r.verdict == INCONCLUSIVE and any("cached_tokens" in n for n in r.notes)


# ------------------------------------------------------------------ CLI
@pytest.mark.parametrize("flags,code", [
    (["--enable-prefix-caching", "--cache-isolation", "shared"], 2),
    (["--enable-prefix-caching"], 0),
    ([], 3),
])
def test_cli_engine_mode(tiny_path, capsys, flags, code):
    rc = main(["audit", "isolation", "--model", str(tiny_path), "--num-blocks", "1024", "--rounds", "1", *flags])
    assert rc == code
    assert "verdict:" in capsys.readouterr().out


def test_cli_server_mode(tiny_path, tmp_path, capsys):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps(KEYS))
    with _server(tiny_path, cache_isolation="shared") as srv:
        rc = main(["audit", "isolation", "--base-url", srv.base_url, "--api-keys", str(keys), "--json"])
    assert rc == 2
    assert json.loads(capsys.readouterr().out)["verdict"] == FAIL
    assert main(["audit", "isolation", "--base-url", "http://127.0.0.1:9/v1"]) == 1  # no --api-keys
    assert main(["audit", "isolation"]) == 1
