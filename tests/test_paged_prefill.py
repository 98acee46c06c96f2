"""The paged prefill kernel (prefix hits read K/V in place from the pool) and the ops it saves.

* The kernel equals SDPA over the gathered context with a causal mask (fp32 1e-5, bf16 2e-2),
  for hits, decodes and a fresh-length sequence in one call, on a shuffled pool.
* A prefix hit dispatches fewer ops than a miss and at most 300 (issue 38's CPU proxy), on the
  ``fused`` backend (plain PyTorch: runs everywhere) and the ``paged`` one (its C++ kernels),
  on tiny-random and on SmolLM2's shapes.  The fused backend on SmolLM2 is the one known
  shortfall: a hit there is 16 ops per layer (``minikv/backends/fused_hit.py``), 528 in all
  against a miss's 1,001, and 30 layers of eager ATen ops cannot reach 300 without fused
  kernels; that case is an expected failure, and turns into a test failure once it passes.
  On CUDA the fused backend replays a hit (and a miss) from a CUDA graph
  (``minikv/backends/prefill_graphs.py``): run here with the eager stand-in, each request
  dispatches a few dozen ops, the replay counted as one, and the hit's replay holds fewer ops
  than the miss's (SmolLM2: 21 dispatched each; 512 ops inside the hit's replay, 984 in the miss's).
* Hit, decode and mixed steps on ``paged`` give the reference backend's greedy tokens.
"""
import pytest
import torch
import torch.nn.functional as F

from minikv import LLM, SamplingParams
from minikv.bench.speed import completed, count_ops, op_totals, random_prompts
from minikv.backends import cpu_kernels
from minikv.backends.cuda_graphs import DecodeGraphRunner
from minikv.backends.prefill_graphs import PrefillGraphRunner

needs_kernels = pytest.mark.skipif(not cpu_kernels.available(),
                                   reason="the cpu_kernels backend's C++ kernels are not built or not supported on this "
                                          "CPU (they need AVX-512; make kernels)")
OPS_BUDGET = 300
# Cases known to miss the 300-op budget, and why (hit < miss is still asserted for them).
OVER_BUDGET = {("fused", "smollm2-135m-instruct"): "30 layers x 16 eager ATen ops per layer (fused_hit.py); "
                                                   "only fused kernels (the cpu_kernels backend) get under 300"}


@needs_kernels
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_paged_prefill_equals_sdpa_over_the_gathered_context(dtype, tol):
    torch.manual_seed(0)
    nb, bs, kvh, D, hq = 200, 16, 3, 64, 9
    blocks = torch.randn(nb, bs, 2, kvh, D, dtype=dtype)
    specs = [(20, 1012), (1, 37), (5, 40), (33, 33)]  # (new tokens, context): hit, decode, hit, all new
    rows = sum(n for n, _ in specs)
    qkv = torch.randn(rows, (hq + 2 * kvh) * D, dtype=dtype)
    perm, width = torch.randperm(nb), max(-(-c // bs) for _, c in specs)
    tables, seqs, start, used = [], [], 0, 0
    for n, c in specs:
        k = -(-c // bs)
        tables.append(perm[used:used + k].tolist() + [0] * (width - k))
        seqs.append([start, n, c])
        start, used = start + n, used + k
    out = torch.full((rows, hq * D), 7.0, dtype=dtype)
    cpu_kernels.paged_prefill(qkv, blocks, torch.tensor(seqs), torch.tensor(tables), 0.125, hq, out)
    for (st, n, c), t in zip(seqs, tables):
        kv = blocks[torch.tensor(t)].reshape(-1, 2, kvh, D)[:c].float()
        q = qkv[st:st + n, :hq * D].view(n, hq, D).transpose(0, 1).float()
        mask = torch.arange(c)[None, :] <= (c - n + torch.arange(n))[:, None]
        want = F.scaled_dot_product_attention(q, kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1),
                                              attn_mask=mask, scale=0.125, enable_gqa=True)
        got = out[st:st + n].view(n, hq, D).transpose(0, 1).float()
        assert (got - want).abs().max().item() < tol, (n, c)


@needs_kernels
def test_paged_prefill_rejects_a_block_outside_the_pool():
    blocks = torch.zeros(4, 16, 2, 1, 16)
    with pytest.raises(RuntimeError, match="names block 9 of a pool of 4"):
        cpu_kernels.paged_prefill(torch.zeros(2, 48), blocks, torch.tensor([0, 2, 20]), torch.tensor([1, 9]), 1.0, 1,
                                torch.zeros(2, 16))


def _hit_and_miss_ops(model: str, backend: str, graphs: bool = False) -> tuple[dict, dict]:
    """``op_totals`` of a 20-token hit over a cached 1,000-token prefix and of a 1,020-token miss.
    ``graphs``: both graph runners forced in with the eager stand-in (what the fused backend runs
    on CUDA; ``count_ops`` counts a replay as one op, and the ops inside it as ``replayed``)."""
    llm = LLM(model, device="cpu", dtype="float32", enable_prefix_caching=True, attention_backend=backend)
    if graphs:
        llm.engine.backend.graphs = DecodeGraphRunner(llm.engine, capture="eager")
        llm.engine.backend.prefill_graphs = PrefillGraphRunner(llm.engine, capture="eager")
    vocab = llm.engine.model.shape.vocab_size
    system = random_prompts(vocab, 1, 1000, 1000, 0)[0]
    qs = random_prompts(vocab, 6, 20, 20, 1)
    p1 = SamplingParams(max_tokens=1, temperature=0.0)
    for i in range(2):  # caches the system prompt; warms both paths
        completed(llm.generate([system + qs[i]], p1))
        completed(llm.generate([[t ^ 1 for t in system] + qs[i]], p1, tenant=f"w{i}"))
    ops = {}
    for side, prompt, tenant in (("hit", system + qs[4], None), ("miss", [t ^ 2 for t in system] + qs[5], "m")):
        cached = []
        ops[side] = op_totals(count_ops(
            lambda: cached.append(completed(llm.generate([prompt], p1, tenant=tenant))[0].num_cached_tokens),
            llm.engine.device))
        assert (cached[0] >= 992) == (side == "hit"), cached
    if graphs:  # the warm-up captured both buckets: the measured requests replayed them, nothing else
        assert llm.engine.backend.prefill_graphs.captures == 2 and llm.engine.backend.prefill_graphs.replays == 6
    return ops["hit"], ops["miss"]


@pytest.mark.parametrize("model", ["tiny-random", "smollm2-135m-instruct"])
@pytest.mark.parametrize("backend", ["fused", pytest.param("cpu_kernels", marks=needs_kernels)])
def test_a_prefix_hit_dispatches_fewer_ops_than_a_miss_and_at_most_300(backend, model):
    hit, miss = (o["ops"] for o in _hit_and_miss_ops(model, backend))
    assert hit < miss, (backend, model, hit, miss)
    if (backend, model) in OVER_BUDGET:
        if hit > OPS_BUDGET:
            pytest.xfail(f"{backend} on {model}: a hit dispatches {hit} ops (miss {miss}), over {OPS_BUDGET}: "
                         f"{OVER_BUDGET[backend, model]}")
        pytest.fail(f"{backend} on {model} now meets the budget ({hit} ops): take it out of OVER_BUDGET")
    assert hit <= OPS_BUDGET, (backend, model, hit, miss)


@pytest.mark.parametrize("model", ["tiny-random", "smollm2-135m-instruct"])
def test_with_cuda_graphs_a_prefix_hit_dispatches_at_most_300_ops_and_replays_less_work_than_a_miss(model):
    """The fused backend as it runs on CUDA: the hit and the miss each replay one prefill graph
    (``prefill_graphs.py``; here the eager stand-in, its replay counted as one op), so the host
    dispatches a few dozen ops for either; the work inside the replays still differs as the eager
    steps' does (on a GPU: the kernels, which ``make gpu-check``'s TTFT scan times)."""
    hit, miss = _hit_and_miss_ops(model, "fused", graphs=True)
    assert hit["ops"] <= OPS_BUDGET and miss["ops"] <= OPS_BUDGET, (model, hit, miss)
    eager_hit, eager_miss = _hit_and_miss_ops(model, "fused")
    assert hit["replayed"] < miss["replayed"] and hit["ops"] < eager_hit["ops"] < eager_miss["ops"], \
        (model, hit, miss, eager_hit, eager_miss)
    assert eager_hit["replayed"] == eager_miss["replayed"] == 0  # nothing replays without the runners


@needs_kernels
def test_hit_decode_and_mixed_steps_match_the_reference_backend():
    p = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    system = random_prompts(259, 1, 70, 70, 3)[0]
    prompts = [system + q for q in random_prompts(259, 4, 3, 9, 4)]
    tokens = {}
    for backend in ("reference", "cpu_kernels"):
        llm = LLM("tiny-random", device="cpu", dtype="float32", enable_prefix_caching=True, attention_backend=backend)
        completed(llm.generate([system + [5]], p))  # the prefix is cached: the next four are hits
        outs = completed(llm.generate(prompts, p))  # hits with decodes of earlier ones in the same steps
        assert all(o.num_cached_tokens >= 64 for o in outs)
        tokens[backend] = [o.outputs[0].token_ids for o in outs]
    assert tokens["cpu_kernels"] == tokens["reference"]
