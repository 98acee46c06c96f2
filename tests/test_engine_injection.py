"""The engine is handed its weights and its audit trail; ``minikv.llm`` is where they are composed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from minikv import LLM, SamplingParams
from minikv.engine import EngineConfig, LLMEngine
from minikv.engine.loader import load_model, resolve_dtype
from minikv.llm import build_engine, open_trail

ROOT = Path(__file__).resolve().parents[1]
P = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def weights(tiny_path):
    import torch
    return load_model(tiny_path, resolve_dtype("float32", torch.device("cpu")), torch.device("cpu"))


def _cfg(**kw) -> EngineConfig:
    return EngineConfig(**{"model": "tiny-random", "device": "cpu", "dtype": "float32", "num_blocks": 32, **kw})


def test_an_engine_without_weights_says_where_they_come_from():
    with pytest.raises(TypeError, match=r"weights=.*load_model.*minikv\.LLM"):
        LLMEngine(_cfg())


def test_an_audit_log_without_a_trail_opener_is_refused(weights, tmp_path):
    with pytest.raises(ValueError, match="open_trail"):
        LLMEngine(_cfg(audit_log=str(tmp_path / "t.jsonl")), weights=weights)
    assert not (tmp_path / "t.jsonl").exists()


def test_injected_weights_and_trail_behave_like_the_front_door(weights, tmp_path):
    eng = LLMEngine(_cfg(audit_log=str(tmp_path / "a.jsonl")), weights=weights, open_trail=open_trail)
    eng.add_request("0", [5, 6, 7, 8], P)
    while eng.has_unfinished_requests():
        eng.step()
    child = eng.fork(audit_log=str(tmp_path / "b.jsonl"))   # a fork opens its trail the same way
    assert child.audit is not None and child.model is eng.model
    eng.audit.close()
    child.audit.close()
    events = [json.loads(line)["event"] for line in (tmp_path / "a.jsonl").read_text().splitlines()]
    assert events == ["engine", "summary"]
    ids = [5, 6, 7, 8]
    front = LLM("tiny-random", device="cpu", dtype="float32", num_blocks=32).generate([ids], P)[0]
    assert front.outputs[0].token_ids == _generate(build_engine(_cfg()), ids) == \
        _generate(LLMEngine(_cfg(), weights=weights), ids)


def _generate(eng, ids):
    eng.add_request(eng.new_request_id(), ids, P)
    out = None
    while eng.has_unfinished_requests():
        for o in eng.step():
            out = o
    return out.outputs[0].token_ids


def test_importing_the_engine_loads_neither_the_hub_nor_the_audit_package():
    code = ("import sys, minikv.engine.engine; "
            "print(sorted(m for m in sys.modules if m.startswith(('minikv.models', 'minikv.audit', 'minikv.serve'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         timeout=120)
    assert out.stdout.strip() == "[]"


def test_engines_built_by_name_share_one_copy_of_the_weights_while_any_holds_it(tiny_path, tmp_path):
    """``build_engine`` loads a checkpoint once per (files, dtype, device) while an engine holds it:
    a lesson's seven SmolLM2 engines cost one copy.  Each still has its own pool; another dtype,
    or the checkpoint rewritten, is another load; and the cache alone keeps nothing alive."""
    import gc
    import shutil
    import weakref

    a, b = build_engine(_cfg()), build_engine(_cfg(num_blocks=8))
    assert a.model is b.model and a.tokenizer is b.tokenizer
    assert a.pool is not b.pool and a.pool.k_cache.data_ptr() != b.pool.k_cache.data_ptr()
    assert build_engine(_cfg(dtype="bfloat16")).model is not a.model
    assert _generate(a, [5, 6, 7]) == _generate(b, [5, 6, 7])

    copy = tmp_path / "tiny"
    shutil.copytree(tiny_path, copy)
    c = build_engine(_cfg(model=str(copy)))
    assert c.model is not a.model                     # another checkpoint path
    assert build_engine(_cfg(model=str(copy))).model is c.model
    (copy / "config.json").write_text((copy / "config.json").read_text() + "\n")
    assert build_engine(_cfg(model=str(copy))).model is not c.model   # rewritten in place

    # a checkpoint no other test's engine holds: when its last engine goes, so do its weights
    ref = weakref.ref(c.model)
    del c
    gc.collect()
    assert ref() is None, "the weights cache kept a model alive after its last engine was gone"
