"""Shared fixtures: the two models every part of minikv is tested against.

Both resolve through the *default* ``MINIKV_HOME`` so that the SmolLM2 checkpoint
fetched by ``make test`` (or by an earlier run) is reused, not rebuilt per test.
Tests that need a private cache set ``MINIKV_HOME`` themselves with ``monkeypatch``.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from minikv.models.hub import resolve_model


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "single_shot_timing: rests on one timed request per candidate, so the machine's load can "
        "decide it; not in make test (a benchmark-like check: make test-timing runs it)")


@pytest.fixture(scope="session")
def tiny_path():
    """2-layer random Llama (GQA 4:2, byte-level ChatML tokenizer); built in ~1 s."""
    return resolve_model("tiny-random", progress=False)


@pytest.fixture(scope="session")
def smollm2_path():
    """The course model. Outside CI a machine that cannot fetch it skips these tests;
    in CI ``make test`` fetched it before pytest started, so failing here is a bug."""
    try:
        return resolve_model("smollm2-135m-instruct", progress=False)
    except Exception as err:  # noqa: BLE001 -- any failure means "not available here"
        if os.environ.get("CI"):
            raise
        pytest.skip(f"SmolLM2 is not available ({err}); fetch it with "
                    "`python -m minikv.models.hub fetch smollm2-135m-instruct`")


@pytest.fixture(scope="session")
def redis_base():
    """``redis://127.0.0.1:PORT`` of a real Redis (tests/redis_helpers.py): skips, naming the install
    command, without redis-server -- a failure under ``$MINIKV_REQUIRE_REDIS`` (CI)."""
    from redis_helpers import redis_base as base
    yield from base()


@pytest.fixture(scope="module", autouse=True)
def _release_memory_after_each_module(request):
    """After a test file, drop what its helpers cached (transformers models, base engines: the
    ``functools`` caches of ``tests/`` modules) and hand the freed heap back to the kernel.

    Without it one pytest process kept every file's models and engines to the end: its resident set
    climbed to 4-7 GB over the suite, and ``make test`` is held to 6 GB for a learner's laptop
    (issue 36).  A file that needs a model again reloads it (about a second from the cache)."""
    yield
    import gc
    import sys

    before = _rss_mb()

    here = os.path.dirname(os.path.abspath(__file__))
    for mod in list(sys.modules.values()):
        path = getattr(mod, "__file__", None) or ""
        if not path.startswith(here):
            continue
        for value in list(vars(mod).values()):
            if callable(getattr(value, "cache_clear", None)) and hasattr(value, "__wrapped__"):
                value.cache_clear()
    gc.collect()
    from minikv.backends.host_memory import give_back_freed_memory
    give_back_freed_memory()
    log = os.environ.get("MINIKV_RSS_LOG")
    if log:  # scripts/measure.py --rss-log reads it when make test misses its memory budget
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
        with open(log, "a") as fh:
            fh.write(f"{request.module.__name__}\t{before:.0f}\t{_rss_mb():.0f}\t{peak:.0f}\n")


def _rss_mb() -> float:
    """This process's resident set now, in MB (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except OSError:
        return 0.0


@pytest.fixture()
def fresh_weights():
    """Engines built by name in this test load their own weights (``minikv.llm.clear_weights_cache``):
    for tests that read what an engine attached to its model (packed copies), which a model shared
    with an earlier engine would already carry."""
    from minikv.llm import clear_weights_cache
    clear_weights_cache()
    yield clear_weights_cache


@pytest.fixture(scope="session")
def graded_solutions(tmp_path_factory):
    """One run of ``python -m minikv.grading.runner solutions --json``: the reference solutions graded
    as ``make grade`` grades exercises/, in a process of its own.  ``(completed process, results,
    messages)``.  Its two readers, test_solution_passes and test_grading_the_solutions_passes, share
    tests/test_grading.py: ``make test`` hands out whole files to its pytest-xdist workers, and a session
    fixture is per worker, so in one file the solutions' graders (L2's five timing secrets take minutes)
    run once per run, not once per worker that reads them."""
    import json
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("graded") / "solutions.json"
    done = subprocess.run([sys.executable, "-m", "minikv.grading.runner", "solutions", "--json", str(out)],
                          cwd=Path(__file__).resolve().parents[1], capture_output=True, text=True, timeout=1200)
    payload = json.loads(out.read_text()) if out.exists() else {"results": {}, "messages": {}}
    return done, payload["results"], payload["messages"]
