"""presence_penalty, frequency_penalty and logit_bias (OpenAI's definitions, as vLLM applies
them): the batched sampler against a plain per-sequence reference written from the definition,
the parameter checks, and an engine run where each one changes what is generated."""
from __future__ import annotations

import pytest
import torch

from minikv import LLM
from minikv.engine import SamplingParams
from minikv.engine.sampling import apply_penalties, sample, sample_row


def reference(row: list[float], output_ids: list[int], p: SamplingParams) -> list[float]:
    """The definition, one token at a time: bias added; presence subtracted once from every
    token generated so far, frequency once per time it was generated (the prompt never counts)."""
    out = list(row)
    for tok in range(len(out)):
        n = output_ids.count(tok)
        out[tok] -= p.frequency_penalty * n + p.presence_penalty * (n > 0)
        out[tok] += (p.logit_bias or {}).get(tok, 0.0)
    return out


CASES = [
    (SamplingParams(temperature=0.0), [1, 1, 2]),
    (SamplingParams(temperature=0.8, presence_penalty=1.5), [3, 3, 3, 0]),
    (SamplingParams(temperature=0.0, frequency_penalty=0.7), [5, 5, 5, 2, 2]),
    (SamplingParams(temperature=1.1, presence_penalty=-0.5, frequency_penalty=2.0), [4, 6, 4]),
    (SamplingParams(temperature=0.0, logit_bias={0: 100, 9: -100.0}), [0]),
    (SamplingParams(temperature=0.9, top_k=3, presence_penalty=2, frequency_penalty=-2, logit_bias={7: 3.5}),
     [7, 7, 1]),
    (SamplingParams(temperature=0.5, frequency_penalty=1.0), []),  # nothing generated: nothing to count
]


def test_batched_penalties_equal_the_per_sequence_reference():
    logits = torch.randn(len(CASES), 10, generator=torch.Generator().manual_seed(0)) * 3
    params, outputs = [p for p, _ in CASES], [o for _, o in CASES]
    got = apply_penalties(logits, params, outputs)
    want = torch.tensor([reference(logits[i].tolist(), outputs[i], params[i]) for i in range(len(CASES))])
    assert torch.allclose(got, want, atol=1e-5)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[-1], logits[-1])  # unpenalized rows untouched
    assert not torch.equal(got, logits)  # and the input itself is left alone
    before = logits.clone()
    apply_penalties(logits, params, outputs)
    assert torch.equal(logits, before)


def test_batched_draw_equals_the_one_row_sampler_with_penalties():
    logits = torch.randn(len(CASES), 10, generator=torch.Generator().manual_seed(1)) * 3
    params, outputs = [p for p, _ in CASES], [o for _, o in CASES]
    seeds = range(50, 50 + len(CASES))
    ga = [torch.Generator().manual_seed(s) for s in seeds]
    gb = [torch.Generator().manual_seed(s) for s in seeds]
    for _ in range(10):
        assert sample(logits, params, ga, outputs) == [sample_row(logits[i], p, gb[i], outputs[i])
                                                       for i, p in enumerate(params)]


def test_a_penalty_changes_the_greedy_choice_as_defined():
    row = torch.tensor([[0.0, 2.0, 1.5, 0.1]])
    greedy = lambda **kw: sample(row, [SamplingParams(temperature=0.0, **kw)], [None], [[1, 1]])[0]
    assert greedy() == 1
    assert greedy(presence_penalty=0.4) == 1         # 2.0 - 0.4 > 1.5
    assert greedy(presence_penalty=0.6) == 2         # 2.0 - 0.6 < 1.5
    assert greedy(presence_penalty=0.4, frequency_penalty=0.1) == 2  # 2.0 - (2*0.1 + 0.4) < 1.5
    assert greedy(frequency_penalty=0.2) == 1        # 2.0 - 2*0.2 = 1.6 > 1.5
    assert greedy(frequency_penalty=0.3) == 2        # 2.0 - 2*0.3 = 1.4 < 1.5
    assert greedy(presence_penalty=-1.0) == 1        # negative: repeats encouraged
    assert greedy(logit_bias={3: 5}) == 3
    assert greedy(logit_bias={1: -100}) == 2


@pytest.mark.parametrize("kwargs, match", [
    ({"presence_penalty": 2.5}, r"presence_penalty must be in \[-2, 2\], got 2.5"),
    ({"frequency_penalty": -3}, r"frequency_penalty must be in \[-2, 2\]"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty must be finite"),
    ({"presence_penalty": "1"}, "presence_penalty must be a real number"),
    ({"logit_bias": {5: 101}}, r"logit_bias\[5\] must be in \[-100, 100\], got 101"),
    ({"logit_bias": {5: float("inf")}}, r"logit_bias\[5\] must be finite"),
    ({"logit_bias": {-1: 1}}, "logit_bias key -1 must be >= 0"),
    ({"logit_bias": {"5": 1}}, "logit_bias key '5' must be an int"),
    ({"logit_bias": [(5, 1)]}, "logit_bias must be a dict"),
])
def test_bad_penalties_are_refused_naming_the_field(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        SamplingParams(**kwargs)


def _traced(llm, prompt, params):
    llm.engine.logit_trace = []
    try:
        out = llm.generate([prompt], params)[0].outputs[0].token_ids
        return out, [next(iter(step.values())).float() for step in llm.engine.logit_trace]
    finally:
        llm.engine.logit_trace = None


def test_the_engine_penalizes_what_the_request_generated_and_not_its_prompt():
    """Every step's token is the reference's argmax over that step's raw logits, counting the
    tokens generated before it -- with a prompt made of the favoured token, which must not count."""
    llm = LLM("tiny-random", device="cpu")
    _, rows = _traced(llm, [7, 8, 9], SamplingParams(max_tokens=1, temperature=0.0))
    top = int(rows[0].argmax())
    fav = (top + 1) % rows[0].numel()
    margin = float(rows[0][top] - rows[0][fav]) + 1.0   # the bias puts ``fav`` 1.0 above the top
    p = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, presence_penalty=2.0,
                       frequency_penalty=2.0, logit_bias={fav: margin})
    prompt = [fav] * 8                                     # counted, fav could never win step 0
    tokens, rows = _traced(llm, prompt, p)
    assert tokens[0] == fav
    changed = 0
    for i, row in enumerate(rows):
        want = torch.tensor(reference(row.tolist(), tokens[:i], p)).argmax()
        assert tokens[i] == int(want)
        changed += int(want) != int(torch.tensor(reference(row.tolist(), [], p)).argmax())
    assert changed > 0  # the history did change a choice: the check above was not vacuous


def test_logit_bias_forces_a_token_and_its_ids_are_checked_against_the_vocabulary():
    llm = LLM("tiny-random", device="cpu")
    forced = llm.generate(["bias"], SamplingParams(max_tokens=4, temperature=0.7, ignore_eos=True, seed=3,
                                                   logit_bias={42: 100}))[0].outputs[0].token_ids
    assert forced == [42] * 4
    with pytest.raises(ValueError, match="logit_bias token id 10000000 is outside the vocabulary"):
        llm.generate(["bias"], SamplingParams(logit_bias={10_000_000: 1}))
