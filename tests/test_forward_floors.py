"""The FLOP and byte floors lesson 03 prints (``minikv.bench.ttft_scan.forward_floors``), checked against
counts done by hand on a config small enough to count, and against ``minikv.bench.prefill.prefill_flops``
(the FLOPs ``make gpu-check`` divides by) on the tiny-random model."""
from __future__ import annotations

import json

import pytest

from minikv.bench.ttft_scan import floor_s, forward_floors

# hidden 4, MLP 6, 2 layers, 2 query heads sharing 1 KV head of dimension 2, 10 tokens, tied embeddings
TINY = dict(hidden_size=4, intermediate_size=6, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=2, vocab_size=10, tie_word_embeddings=True)
# one layer: qkv 4 x (2 + 2) * 2 = 32, o 4 * 4 = 16, gate + up + down 3 * 4 * 6 = 72 -> 120 weights
# whole model: 2 * 120 = 240 in layers, (2 * 2 + 1) * 4 = 20 in norms, 10 * 4 = 40 embedding (= LM head)


def test_params_by_hand():
    assert forward_floors(TINY, 0, 1, 2)["params"] == 240 + 20 + 40
    assert forward_floors({**TINY, "tie_word_embeddings": False}, 0, 1, 2)["params"] == 240 + 20 + 40 + 40


def test_a_miss_by_hand():
    f = forward_floors(TINY, context=0, computed=3, bytes_per_param=2)
    # matmuls 2 * 240 * 3; LM head once, 2 * 4 * 10; attention 4 * 2 heads * 2 dims * 2 layers * (1 + 2 + 3) keys
    assert f["flops_by_part"] == {"matmul": 1440, "head": 80, "attention": 192}
    assert f["flops"] == 1712
    # every weight once, 2 bytes each; K and V of 3 positions: 2 * 1 head * 2 dims * 2 layers * 2 bytes * 3
    assert f["bytes_by_part"] == {"weights": 600, "kv": 48}


def test_a_hit_by_hand():
    f = forward_floors(TINY, context=5, computed=2, bytes_per_param=4)
    # new tokens see 6 and 7 keys: 13 keys in all
    assert f["flops_by_part"] == {"matmul": 960, "head": 80, "attention": 32 * 13}
    assert f["bytes_by_part"] == {"weights": 1200, "kv": 2 * 1 * 2 * 2 * 4 * 7}
    # the hit's work shrinks with what it skips, its weight read does not
    miss = forward_floors(TINY, context=0, computed=7, bytes_per_param=4)
    assert f["flops"] < miss["flops"] and f["bytes"] == miss["bytes"]


def test_head_dim_defaults_to_hidden_over_heads():
    no_d = {k: v for k, v in TINY.items() if k != "head_dim"}
    assert forward_floors(no_d, 3, 2, 2) == forward_floors(TINY, 3, 2, 2)


def test_floor_is_the_larger_of_arithmetic_and_traffic():
    f = forward_floors(TINY, 0, 3, 2)   # 1712 FLOPs, 648 bytes
    assert floor_s(f, 1712.0, 1e9) == pytest.approx(1.0)
    assert floor_s(f, 1e9, 324.0) == pytest.approx(2.0)


def test_a_miss_counts_what_prefill_flops_counts():
    from minikv import LLM
    from minikv.bench.prefill import prefill_flops
    from minikv.models.hub import resolve_model

    llm = LLM("tiny-random", device="cpu")
    cfg = json.loads((resolve_model("tiny-random") / "config.json").read_text())
    for n in (1, 17, 100):
        assert forward_floors(cfg, 0, n, 4)["flops"] == prefill_flops(llm.engine.model, [n])
