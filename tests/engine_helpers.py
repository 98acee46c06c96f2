"""Shared helpers for engine tests: a transformers reference and a tie-aware comparison."""
from __future__ import annotations

import functools

import torch

from minikv.models.hub import resolve_model

TIE_GAP = 1e-4  # below this top-2 logit gap, fp32 rounding may legitimately flip a token


@functools.lru_cache(maxsize=4)
def hf_model(name: str):
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = resolve_model(name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    return model, AutoTokenizer.from_pretrained(path)


def hf_greedy(name: str, ids: list[int], max_new: int) -> tuple[list[int], list[torch.Tensor]]:
    """transformers' greedy generate: tokens and the logits of each generated step."""
    model, tok = hf_model(name)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=max_new, do_sample=False,
                             output_logits=True, return_dict_in_generate=True,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None else 0,
                             )
    return out.sequences[0, len(ids):].tolist(), [s[0] for s in out.logits]


def hf_logits(name: str, ids: list[int]) -> torch.Tensor:
    model, _ = hf_model(name)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def top2_gap(logits: torch.Tensor) -> float:
    top = torch.topk(logits.float(), 2).values
    return float(top[0] - top[1])


def compare_with_ties(got: list[int], ref: list[int], ref_logits: list[torch.Tensor], label: str,
                      ties: list[str]) -> None:
    """Tokens must match; after a near-tie in the reference (gap < TIE_GAP) they may diverge.
    Every tie that excuses a divergence is reported in ``ties``; a mismatch without one fails."""
    for i, (a, b) in enumerate(zip(got, ref)):
        if a == b:
            continue
        gaps = [top2_gap(ref_logits[j]) for j in range(i + 1)]
        tie_steps = [j for j, g in enumerate(gaps) if g < TIE_GAP]
        assert tie_steps, f"{label}: token {i} differs ({a} vs {b}) with no tie (min gap {min(gaps):.2e})"
        ties.append(f"{label}: diverged at token {i} after tie at step {tie_steps[0]} (gap {gaps[tie_steps[0]]:.1e})")
        return
    assert len(got) == len(ref), f"{label}: lengths differ ({len(got)} vs {len(ref)})"


def assert_traces_close(trace_a: list[dict], trace_b: list[dict], rel_tol: float) -> None:
    """Two runs of one schedule (``engine.logit_trace``) sampled the same rows at every step, and
    each row's logits agree within ``rel_tol`` of its largest absolute logit."""
    assert [sorted(s) for s in trace_a] == [sorted(s) for s in trace_b]
    for step_a, step_b in zip(trace_a, trace_b):
        for rid, row in step_a.items():
            diff = (row - step_b[rid]).abs().max().item()
            assert diff <= rel_tol * row.abs().max().item(), (rid, diff)


def quiet_fork(llm, **kw):
    """``llm.fork(enable_prefix_caching=True, **kw)``, its UnsafeSettingWarning silenced: the
    selective-sharing tests set unsafe policies (k=2, monitor, shared) on purpose."""
    import warnings

    from minikv.engine import UnsafeSettingWarning

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsafeSettingWarning)
        return llm.fork(enable_prefix_caching=True, **kw)


def random_contents(seed: int, n: int, blocks: int = 3, block_size: int = 16) -> list[list[int]]:
    """``n`` seeded random prompts of ``blocks`` full blocks, token ids in 3..249 (clear of the
    special ids, and of markers tests place above 250)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 250, (blocks * block_size,), generator=g).tolist() for _ in range(n)]
