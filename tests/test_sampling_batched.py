"""Batched sampling (``sampling.sample``): one pass over the batch, the same tokens as the
readable one-row sampler for the same seeds, and a seeded request's tokens do not depend on
who else is in its batch."""
from __future__ import annotations

import pytest
import torch

from minikv import LLM
from minikv.engine import SamplingParams
from minikv.engine.sampling import sample, sample_row

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8),
    SamplingParams(temperature=1.3, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.9),
    SamplingParams(temperature=1.0, top_k=50, top_p=0.5),
    SamplingParams(temperature=2.0, top_k=1),
    SamplingParams(temperature=1e-6),  # below GREEDY_EPS: greedy
]


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _gens(seeds, device="cpu"):
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("vocab", [7, 300])
def test_batched_draw_equals_the_one_row_sampler_token_for_token(vocab, device):
    logits = (torch.randn(len(PARAMS), vocab, generator=torch.Generator().manual_seed(vocab)) * 3).to(device)
    seeds = list(range(100, 100 + len(PARAMS)))
    ga, gb = _gens(seeds, device), _gens(seeds, device)
    for _ in range(20):  # 20 draws in a row: the generators advance the same way too
        assert sample(logits, PARAMS, ga) == [sample_row(logits[i], p, gb[i]) for i, p in enumerate(PARAMS)]
    assert len(set(sample(logits[1:2].expand(8, -1), [PARAMS[1]] * 8, _gens(range(8))))) > 1  # it is random


def test_top_k_one_and_greedy_rows_are_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=3.0, top_k=1)] * 2
    assert sample(logits, params, _gens(range(4))) == logits.argmax(-1).tolist()


def test_a_row_that_cannot_be_sampled_fails_alone():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(0))
    logits[1, 4] = float("nan")
    out = sample(logits, [SamplingParams(temperature=0.9)] * 3, _gens(range(3)))
    assert isinstance(out[1], ValueError) and "not finite" in str(out[1])
    assert all(isinstance(t, int) for t in (out[0], out[2]))
    assert sample(logits[:0], [], []) == []


def test_a_seeded_request_gets_the_same_tokens_alone_and_in_any_batch():
    llm = LLM("tiny-random", device="cpu")
    mine = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    prompt = "the same seed, the same tokens"
    alone = llm.generate([prompt], mine)[0].outputs[0].token_ids
    others = [SamplingParams(max_tokens=n, temperature=1.0, top_k=k, ignore_eos=True)
              for n, k in ((3, 0), (20, 7), (9, 0), (15, 2))]
    crowd = llm.generate(["x", prompt + "!", "a much longer stranger " * 3, "y y", prompt],
                         others + [mine])
    assert crowd[-1].outputs[0].token_ids == alone
    again = llm.generate(["zz", prompt], [others[1], mine])
    assert again[1].outputs[0].token_ids == alone
