"""minikv's C++ paged decode-attention kernel (``minikv/backends/kernels/paged_attention.cpp``).

The kernel follows raw pointers through block tables, so these tests hold it to three things:

* **the arithmetic**: softmax(q K^T * scale) V over exactly each sequence's context, against a
  float64 reference that gathers the context position by position (fp32: 1e-5 absolute; bf16:
  the output's own rounding, 2^-7 of the largest value), for several head dims, block sizes,
  GQA ratios, contexts ending mid-block, and a query that is a strided view;
* **what it reads**: every block no table names, and every slot past a sequence's context, is
  NaN; one read of any of them would poison the output.  That is the isolation property: a
  decode never touches another request's KV;
* **bad input**: a clear ``RuntimeError`` naming the bad value, before any pointer is followed.

It also checks the backend registry's rules (``auto`` never compiles, ``paged`` is CPU-only) and
the issue's op target on SmolLM2 itself.
"""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys

import pytest
import torch

from minikv.backends.registry import KERNEL_HEAD_DIMS, resolve_backend
from tests.paged_kernel import HAS_COMPILER, KERNEL_BUILT

pytestmark = pytest.mark.skipif(not KERNEL_BUILT, reason="no C++ compiler: the paged kernel is not built")


def paged_decode(*args):
    return torch.ops.minikv.paged_decode(*args)


def _case(seed, *, dtype, head_dim, kv_heads, rep, block_size, contexts, num_blocks=64):
    """A pool whose unused blocks and past-the-context slots are NaN, shuffled block tables,
    and queries as a strided view (every other head of a wider tensor)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.full((num_blocks, block_size, 2, kv_heads, head_dim), float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=g).tolist()
    width = max(-(-c // block_size) for c in contexts)
    tables = torch.zeros(len(contexts), width, dtype=torch.long)  # padding entries: block 0, never read
    for s, c in enumerate(contexts):
        for b in range(-(-c // block_size)):
            blk = order.pop()
            tables[s, b] = blk
            used = min(block_size, c - b * block_size)
            blocks[blk, :used] = torch.randn(used, 2, kv_heads, head_dim, generator=g).to(dtype)
    wide = torch.randn(len(contexts), 2 * kv_heads * rep, head_dim, generator=g).to(dtype)
    q = wide[:, ::2]  # stride(1) = 2 * head_dim: a view, as the qkv split hands the kernel
    return q, blocks, tables, torch.tensor(contexts)


def _reference(q, blocks, tables, ctx, scale):
    """float64, one position at a time: the textbook definition, nothing shared with the kernel."""
    S, Hq, D = q.shape
    bs, Hkv = blocks.shape[1], blocks.shape[3]
    out = torch.empty(S, Hq, D, dtype=torch.float64)
    for s in range(S):
        n = int(ctx[s])
        rows = [blocks[tables[s, p // bs], p % bs] for p in range(n)]  # [2, Hkv, D] each
        k = torch.stack([r[0] for r in rows]).double()  # [n, Hkv, D]
        v = torch.stack([r[1] for r in rows]).double()
        for h in range(Hq):
            kv_h = h // (Hq // Hkv)
            w = torch.softmax((k[:, kv_h] @ q[s, h].double()) * scale, dim=0)
            out[s, h] = w @ v[:, kv_h]
    return out.view(S, Hq * D)


CASES = [  # head_dim, kv_heads, rep, block_size, contexts
    (64, 3, 3, 16, [1, 16, 17, 40, 333]),  # SmolLM2's heads; a single key; a block exactly full
    (16, 2, 2, 16, [5, 31, 64]),  # tiny-random's heads
    (128, 1, 4, 5, [7, 23, 50]),  # a block size that divides nothing; a long head
    (32, 4, 1, 8, [9, 100]),  # no GQA
]


@pytest.mark.parametrize("head_dim,kv_heads,rep,block_size,contexts", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_the_textbook_and_reads_only_each_context(dtype, head_dim, kv_heads, rep, block_size, contexts):
    q, blocks, tables, ctx = _case(len(contexts), dtype=dtype, head_dim=head_dim, kv_heads=kv_heads, rep=rep,
                                   block_size=block_size, contexts=contexts)
    scale = head_dim ** -0.5
    out = paged_decode(q, blocks, tables, ctx, scale)
    want = _reference(q, blocks, tables, ctx, scale)
    assert out.shape == (len(contexts), kv_heads * rep * head_dim) and out.dtype == dtype
    assert torch.isfinite(out).all(), "read a NaN: a slot past a context or a block no table names"
    err = (out.double() - want).abs().max().item()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7 * want.abs().max().item()
    assert err <= tol, (dtype, err, tol)


def test_one_sequence_is_unaffected_by_its_batch():
    """Each row is computed from its own table alone: the same sequence alone or batched with
    others gives the same bits (no cross-sequence state in the kernel)."""
    q, blocks, tables, ctx = _case(7, dtype=torch.float32, head_dim=64, kv_heads=3, rep=3, block_size=16,
                                   contexts=[300, 12, 77])
    together = paged_decode(q, blocks, tables, ctx, 0.125)
    for s in range(3):
        alone = paged_decode(q[s:s + 1], blocks, tables[s:s + 1].contiguous(), ctx[s:s + 1], 0.125)
        assert torch.equal(alone[0], together[s])


def _bad(**change):
    q, blocks, tables, ctx = _case(1, dtype=torch.float32, head_dim=64, kv_heads=3, rep=3, block_size=16,
                                   contexts=[20, 40])
    args = dict(q=q, blocks=blocks, tables=tables, ctx=ctx)
    args.update(change)
    return args


@pytest.mark.parametrize("change,message", [
    (lambda a: dict(tables=a["tables"].clone().index_fill_(1, torch.tensor([0]), 999)), "names block 999 of a pool of 64"),
    (lambda a: dict(tables=a["tables"].clone().index_fill_(1, torch.tensor([0]), -1)), "names block -1"),
    (lambda a: dict(ctx=torch.tensor([20, 0])), "sequence 1 has context 0"),
    (lambda a: dict(ctx=torch.tensor([20, 49])), "sequence 1 has context 49; its table holds 1..48"),
    (lambda a: dict(q=a["q"].to(torch.bfloat16)), "q is BFloat16 but the pool is Float"),
    (lambda a: dict(q=a["q"].half(), blocks=a["blocks"].half()), "is not float32 or bfloat16"),
    (lambda a: dict(q=a["q"][:, :8]), "8 query heads of dim 64 do not fit 3 KV heads"),
    (lambda a: dict(tables=a["tables"].int()), "tables must be a contiguous int64"),
    (lambda a: dict(ctx=a["ctx"][:1]), "ctx must be int64 [S] with S = 2"),
    (lambda a: dict(q=torch.randn(2, 9, 24), blocks=torch.randn(64, 16, 2, 3, 24)), "head_dim 24 is not one of"),
])
def test_bad_input_is_refused_with_the_bad_value_named(change, message):
    args = _bad()
    args.update(change(args))
    before = args["blocks"].clone()
    with pytest.raises(RuntimeError, match=re.escape(message)):
        paged_decode(args["q"], args["blocks"], args["tables"], args["ctx"], 0.125)
    assert torch.equal(args["blocks"].nan_to_num(7.0), before.nan_to_num(7.0))  # the pool is untouched


def test_registry_rules_for_the_kernel():
    assert resolve_backend("auto", "cpu", 64, "float32") == "cpu_kernels"
    assert resolve_backend("auto", "cpu", 64, "bfloat16") == "cpu_kernels"
    assert resolve_backend("auto", "cuda", 64, "float32") == "fused"  # the kernel is CPU code
    assert resolve_backend("auto", "cpu", 24, "float32") == "fused"  # a head dim it has no instance for
    assert resolve_backend("auto", "cpu", 64, "float16") == "fused"
    assert set(KERNEL_HEAD_DIMS) == {16, 32, 64, 128, 256}
    with pytest.raises(ValueError, match="attention_backend='cpu_kernels' is minikv's CPU kernels; on 'cuda'"):
        resolve_backend("cpu_kernels", "cuda", 64, "float32")
    with pytest.raises(ValueError, match="head_dim 24 is not one of"):
        resolve_backend("cpu_kernels", "cpu", 24, "float32")


def test_the_old_name_paged_is_refused_naming_the_new_one(capsys):
    """``"paged"`` was this backend's name; it now says what it is (``"cpu_kernels"``), and the old
    name fails at once, in one line naming the new one, from the config, the registry and the flag."""
    from minikv import LLM

    for refuse in (lambda: resolve_backend("paged", "cpu", 64, "float32"),
                   lambda: LLM("tiny-random", device="cpu", attention_backend="paged")):
        with pytest.raises(ValueError) as err:
            refuse()
        assert str(err.value) == "attention_backend='paged' is now called 'cpu_kernels'"
    import argparse

    from minikv.engine.cli_flags import add_engine_arguments

    ap = argparse.ArgumentParser()
    add_engine_arguments(ap)
    assert ap.parse_args(["--model", "m", "--attention-backend", "cpu_kernels"]).attention_backend == "cpu_kernels"
    with pytest.raises(SystemExit):
        ap.parse_args(["--model", "m", "--attention-backend", "paged"])
    assert "--attention-backend: 'paged' is now called 'cpu_kernels'" in capsys.readouterr().err


def test_auto_never_compiles(tmp_path):
    """In a fresh process whose kernel cache is empty, ``auto`` means ``fused`` and nothing is
    built: only set-up (``make model``) or an explicit ``python -m minikv.backends.cpu_kernels``
    compiles."""
    env = dict(os.environ, MINIKV_HOME=str(tmp_path))
    code = ("from minikv.backends.registry import resolve_backend\n"
            "print(resolve_backend('auto', 'cpu', 64, 'float32'))\n"
            "try:\n    resolve_backend('cpu_kernels', 'cpu', 64, 'float32')\n"
            "except RuntimeError as e:\n    print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "fused" and lines[1].startswith("refused:") and "python -m minikv.backends.cpu_kernels" in lines[1]
    assert not (tmp_path / "kernels").exists()


@pytest.mark.skipif(not HAS_COMPILER, reason="no C++ compiler")
def test_a_changed_source_is_a_different_build(tmp_path, monkeypatch):
    """The cached library's name hashes the source (and torch, compiler, CPU): an edited kernel
    is never served by a stale build."""
    from minikv.backends import kernel_build as kb

    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    first = kb.library_path()
    assert {p.name for p in kb.SOURCES} >= {"paged_attention.cpp", "pointwise.cpp"}
    for i, source in enumerate(kb.SOURCES):  # any one edited source is a new library
        edited = tmp_path / source.name
        edited.write_text(source.read_text() + "\n// edited\n")
        monkeypatch.setattr(kb, "SOURCES", [*kb.SOURCES[:i], edited, *kb.SOURCES[i + 1:]])
        assert kb.library_path() != first and first.parent == kb.library_path().parent
        monkeypatch.undo()
        monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    assert [p.name for p in kb.HEADERS] == ["attention_tiles.h", "cpu_vec.h"]
    edited = tmp_path / "cpu_vec.h"
    edited.write_text(kb.HEADERS[1].read_text() + "\n// edited\n")
    monkeypatch.setattr(kb, "HEADERS", [kb.HEADERS[0], edited])  # a header every source includes
    assert kb.library_path() != first
    monkeypatch.undo()
    monkeypatch.setenv("MINIKV_HOME", str(tmp_path))
    assert kb.library_path() == first


def test_prune_deletes_only_builds_unused_for_the_stale_period(tmp_path):
    """Builds pile up (one per source, torch or compiler change); the next build deletes those
    nothing has built or loaded for ``STALE_AFTER_DAYS``, and nothing else: not the build it
    keeps, not a recently loaded one (another venv's), not a build being written now, not a
    file that is not a build."""
    from minikv.backends import kernel_build as kb

    now, day = 1_000_000_000.0, 86400
    old, recent = now - (kb.STALE_AFTER_DAYS + 1) * day, now - (kb.STALE_AFTER_DAYS - 1) * day
    files = {"minikv_cpu-keep.so": old, "minikv_cpu-stale.so": old, "minikv_cpu-recent.so": recent,
             "minikv_cpu-dead.123.tmp": old, "minikv_cpu-live.456.tmp": now, "notes.txt": old}
    for name, mtime in files.items():
        (tmp_path / name).write_bytes(b"x")
        os.utime(tmp_path / name, (mtime, mtime))
    gone = kb.prune(tmp_path, keep=tmp_path / "minikv_cpu-keep.so", now=now)
    assert sorted(p.name for p in gone) == ["minikv_cpu-dead.123.tmp", "minikv_cpu-stale.so"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["minikv_cpu-keep.so", "minikv_cpu-live.456.tmp",
                                                          "minikv_cpu-recent.so", "notes.txt"]


# A stand-in compiler: logs its arguments and writes its -o file.  Compiling paged_attention.cpp
# and paged_prefill.cpp, each waits (30 s at most) until the other has started: a build that
# compiled one source after another would time out there and fail.  $FAIL names a source it
# refuses, with an error on stderr.
FAKE_CXX = """#!/bin/sh
out=""; prev=""
for a in "$@"; do [ "$prev" = "-o" ] && out="$a"; prev="$a"; done
echo "$*" >> "$FAKE_LOG"
meet() { touch "$FAKE_DIR/$1"; i=0; while [ ! -e "$FAKE_DIR/$2" ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
         [ -e "$FAKE_DIR/$2" ] || { echo "$1 waited alone" >&2; exit 3; }; }
case "$*" in
  *"-c "*paged_attention.cpp*) meet a b ;;
  *"-c "*paged_prefill.cpp*) meet b a ;;
esac
case "$*" in *"-c "*"$FAIL"*) [ -n "$FAIL" ] && { echo "$FAIL:7:1: error: expected ';'" >&2; exit 1; } ;; esac
touch "$out"
"""


def _fake_compiler(tmp_path, monkeypatch, fail: str = ""):
    cxx = tmp_path / "fake-g++"
    cxx.write_text(FAKE_CXX)
    cxx.chmod(0o755)
    (tmp_path / "meet").mkdir()
    for name, value in {"CXX": str(cxx), "FAKE_LOG": str(tmp_path / "log"), "FAKE_DIR": str(tmp_path / "meet"),
                        "FAIL": fail, "MINIKV_HOME": str(tmp_path / "home")}.items():
        monkeypatch.setenv(name, value)


def test_a_build_compiles_every_source_at_once_links_them_and_prunes_stale_builds(tmp_path, monkeypatch):
    """``build`` compiles each source on its own (``-c``), two at a time at least (the stand-in
    compiler's meeting point), links every object into the library, and prunes the stale builds
    beside it once its own is in place."""
    from minikv.backends import kernel_build as kb

    _fake_compiler(tmp_path, monkeypatch)
    monkeypatch.setattr(kb, "jobs", lambda: 2)  # the meeting needs two at once, even on one core
    folder = tmp_path / "home" / "kernels"
    folder.mkdir(parents=True)
    stale = folder / "minikv_cpu-0000000000000000.so"
    stale.write_bytes(b"x")
    os.utime(stale, (1.0, 1.0))
    path = kb.build()
    assert path.exists() and path.parent == folder and not stale.exists()
    assert sorted(p.name for p in folder.iterdir()) == [path.name]  # no .tmp left beside it
    calls = (tmp_path / "log").read_text().splitlines()
    compiled = sorted(c.split(" -c ")[1].split()[0].rsplit("/", 1)[1] for c in calls if " -c " in c)
    assert compiled == sorted(p.name for p in kb.SOURCES)
    links = [c for c in calls if " -c " not in c]
    assert len(links) == 1 and "-shared" in links[0].split()
    assert sorted(re.findall(r"/(\w+)\.o\b", links[0])) == sorted(p.stem for p in kb.SOURCES)
    assert all("-shared" not in c.split() for c in calls if " -c " in c)


def test_a_failed_build_names_the_source_and_leaves_nothing_to_load(tmp_path, monkeypatch):
    """A source that does not compile: ``RuntimeError`` naming it, with the compiler's message;
    no library and no half-written file where ``available()`` would look."""
    from minikv.backends import kernel_build as kb

    _fake_compiler(tmp_path, monkeypatch, fail="pointwise.cpp")
    monkeypatch.setattr(kb, "jobs", lambda: 2)
    with pytest.raises(RuntimeError, match=r"compiling pointwise\.cpp failed \(1\):\n.*expected ';'"):
        kb.build()
    assert list((tmp_path / "home" / "kernels").iterdir()) == []
    assert not kb.library_path().exists()


def test_jobs_is_one_per_usable_core_and_at_most_one_per_source(monkeypatch):
    from minikv.backends import kernel_build as kb

    for cores, want in ((1, 1), (2, 2), (64, len(kb.SOURCES))):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)))
        assert kb.jobs() == want


def test_python_and_the_library_agree_on_the_head_dims():
    """The registry decides ``auto`` before the library is loaded, so it keeps its own list;
    the library's dispatch and checks read one C++ list, which it reports."""
    from minikv.backends import cpu_kernels

    assert cpu_kernels.head_dims() == KERNEL_HEAD_DIMS


def test_smollm2_decode_step_dispatches_at_most_500_ops(smollm2_path):
    """Issue 11's target, counted the way ``python -m minikv.bench`` counts it: one decode step
    of SmolLM2 at batch 16 (``torch.profiler``, top-level ops).  Measured: 405 in bf16, against
    492 for the fused backend and 2,059 for the reference."""
    from minikv import LLM
    from minikv.bench.speed import count_decode_ops

    llm = LLM(str(smollm2_path), dtype="bfloat16", enforce_eager=True)
    assert llm.engine.attention_backend == "cpu_kernels"  # what auto picks with the kernel built
    counts = count_decode_ops(llm.engine)
    assert counts["minikv::paged_decode"] == llm.engine.model.shape.num_layers
    assert counts["minikv::rms_norm"] == 2 * llm.engine.model.shape.num_layers + 1  # and the final norm
    assert "aten::scaled_dot_product_attention" not in counts and "aten::index_select" not in counts
    assert sum(counts.values()) <= 500, sum(counts.values())


def test_engine_tokens_match_reference_on_a_random_batch():
    """End to end: 12 requests of mixed lengths through the paged engine and the reference one,
    greedy, with staggered arrivals so decodes of very different lengths share steps."""
    from minikv import LLM
    from minikv.engine import SamplingParams

    ref = LLM("tiny-random", attention_backend="reference", num_blocks=256)
    paged = ref.fork(attention_backend="cpu_kernels")
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(1, 200))] for _ in range(12)]
    p = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    got = [[o.outputs[0].token_ids for o in llm.generate(prompts, p)] for llm in (ref, paged)]
    assert got[0] == got[1] and all(len(t) == 12 for t in got[0])
