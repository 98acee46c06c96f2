"""Fair-share admission: one tenant's queue must not starve another tenant's request.

The scheduler is exercised directly (it is torch-free): each simulated step schedules, gives
every scheduled sequence one token, and retires those that reached ``max_tokens``.
"""
from __future__ import annotations

from minikv import LLM, SamplingParams
from minikv.engine.block_manager import BlockManager
from minikv.engine.scheduler import CONTENDED_LINGER_S, Scheduler
from minikv.engine.sequence import Sequence


def _seq(rid, tenant, n_prompt=5, max_tokens=3):
    return Sequence(rid, list(range(1, n_prompt + 1)), SamplingParams(max_tokens=max_tokens), tenant=tenant)


def _scheduler(num_blocks=64, max_num_seqs=2, budget=4096):
    return Scheduler(BlockManager(num_blocks, 4), max_num_seqs, budget)


def _step(sched):
    """One simulated step: every scheduled sequence computes its scheduled tokens; the ones whose
    prompt is then complete (prefills and decodes, not chunks) get a token."""
    batch = sched.schedule()
    for s in batch.chunks + batch.prefills + batch.decodes:
        s.num_computed_tokens += s.num_scheduled_tokens
        sched.bm.commit(s)
    for s in batch.prefills + batch.decodes:
        s.output_token_ids.append(7)
        if len(s.output_token_ids) >= s.params.max_tokens:
            sched.remove(s)
    return batch


def _run(sched, steps):
    """Request ids admitted (prefilled) at each step, and preempted ones, step by step."""
    admitted, preempted = [], []
    for _ in range(steps):
        batch = _step(sched)
        admitted.append([s.request_id for s in batch.prefills])
        preempted.append([s.request_id for s in batch.preempted])
    return admitted, preempted


def test_one_request_is_not_stuck_behind_another_tenants_queue():
    sched = _scheduler(max_num_seqs=2)
    for i in range(10):
        sched.add(_seq(f"A{i}", "A"))
    sched.add(_seq("B0", "B"))
    admitted, _ = _run(sched, 2)
    # FCFS would admit A0, A1 now and B0 only after all ten of A's requests.
    assert admitted[0] == ["A0", "B0"], "B gets the slot beyond A's fair share in the very first batch"


def test_round_robin_when_one_slot_frees_at_a_time_and_fcfs_within_a_tenant():
    sched = _scheduler(max_num_seqs=1)
    for i in range(4):
        sched.add(_seq(f"A{i}", "A", max_tokens=1))
    for i in range(2):
        sched.add(_seq(f"B{i}", "B", max_tokens=1))
    sched.add(_seq("C0", "C", max_tokens=1))
    admitted, _ = _run(sched, 7)
    order = [rid for step in admitted for rid in step]
    assert order == ["A0", "B0", "C0", "A1", "B1", "A2", "A3"]


def test_the_tenant_with_fewest_running_sequences_goes_first():
    sched = _scheduler(max_num_seqs=4)
    for i in range(3):
        sched.add(_seq(f"A{i}", "A", max_tokens=50))
    admitted, _ = _run(sched, 1)
    assert admitted[0] == ["A0", "A1", "A2"]  # alone, a tenant may use every free slot
    sched.add(_seq("A3", "A"))
    sched.add(_seq("B0", "B"))
    admitted, _ = _run(sched, 1)
    assert admitted[0] == ["B0"], "A already holds 3 slots: the last free one goes to B"


def test_the_anonymous_tenant_is_one_tenant_among_others():
    sched = _scheduler(max_num_seqs=2)
    for i in range(5):
        sched.add(_seq(f"anon{i}", None))
    sched.add(_seq("B0", "B"))
    admitted, _ = _run(sched, 1)
    assert admitted[0] == ["anon0", "B0"]


def test_preempted_sequences_keep_their_place_at_the_head():
    # 6 blocks of 4 tokens; three 8-token prompts fill 6 blocks, so the first decode preempts.
    sched = _scheduler(num_blocks=6, max_num_seqs=8)
    for rid, tenant in (("A0", "A"), ("A1", "A"), ("B0", "B")):
        sched.add(_seq(rid, tenant, n_prompt=7, max_tokens=4))
    sched.add(_seq("C0", "C", n_prompt=3, max_tokens=4))  # C has nothing running: fair share would favour it
    admitted, preempted = _run(sched, 6)
    first = next(i for i, p in enumerate(preempted) if p)
    victim = preempted[first][0]
    later = [rid for step in admitted[first + 1:] for rid in step]
    assert later and later[0] == victim, f"{victim} was preempted and must be re-admitted first: {later}"
    sched.bm.check_invariants(sched.running)


def test_many_huge_prompts_cannot_keep_a_short_prompt_out_of_a_step():
    budget = 64
    sched = _scheduler(num_blocks=4096, max_num_seqs=64, budget=budget)
    for i in range(16):
        sched.add(_seq(f"A{i}", "A", n_prompt=600, max_tokens=4))
    for _ in range(3):
        batch = _step(sched)
        assert batch.num_tokens <= budget and not batch.prefills, "600-token prompts go in chunks"
    sched.add(_seq("B0", "B", n_prompt=10, max_tokens=4))
    batch = _step(sched)
    assert [s.request_id for s in batch.prefills] == ["B0"], "B's prompt is prefilled in the first step after it arrives"
    for _ in range(3):  # then B decodes in every step, while A's chunks fill the rest of the budget
        batch = _step(sched)
        assert any(s.request_id == "B0" for s in batch.decodes) and batch.num_tokens <= budget
        assert batch.chunks and all(s.tenant == "A" for s in batch.chunks)
    sched.bm.check_invariants(sched.running)


def test_the_fair_share_is_counted_in_tokens_not_requests():
    # A queues eight 64-token prompts, B eight 8-token ones.  By requests, B would get one
    # admission per A admission; by tokens, B's whole queue (64 tokens) weighs one of A's prompts.
    sched = _scheduler(num_blocks=4096, max_num_seqs=64, budget=64)
    for i in range(8):
        sched.add(_seq(f"A{i}", "A", n_prompt=64, max_tokens=50))
    for i in range(8):
        sched.add(_seq(f"B{i}", "B", n_prompt=8, max_tokens=50))
    first = [[s.request_id for s in (b.prefills + b.chunks)] for b in (_step(sched), _step(sched))]
    assert first == [["A0"], [f"B{i}" for i in range(8)]]  # B7 in part: A0's decode took a token
    served = sched.served["A"] - sched.served["B"]
    assert 0 <= served <= 64, f"after both had their turn, A is {served} tokens ahead"


def test_served_clocks_start_at_the_busy_tenants_least():
    # A tenant that was idle starts level with the busy ones: no credit for idling, no debt.
    sched = _scheduler(num_blocks=4096, max_num_seqs=64, budget=32)
    sched.add(_seq("A0", "A", n_prompt=400, max_tokens=2))
    for _ in range(5):
        _step(sched)
    sched.add(_seq("B0", "B", n_prompt=400, max_tokens=2))
    _step(sched)
    # B started at A's clock (160 tokens), got the first turn (ties go to the tenant served
    # longest ago), and the two then alternate: neither may run ahead by more than a step.
    shares = []
    for _ in range(6):
        batch = _step(sched)
        shares.append([s.tenant for s in batch.chunks + batch.prefills])
    assert all(len(set(x)) == 1 for x in shares)
    assert all(a != b for a, b in zip(shares, shares[1:])), f"the two must alternate: {shares}"
    assert abs(sched.served["A"] - sched.served["B"]) <= 32


def test_engine_serves_the_single_request_in_the_first_step_with_unchanged_tokens():
    llm = LLM("tiny-random", device="cpu", block_size=4, num_blocks=128, max_num_seqs=2)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng = llm.engine
    for i in range(6):
        eng.add_request(f"A{i}", f"tenant A's request number {i}", params, tenant="A")
    eng.add_request("B0", "tenant B's only request", params, tenant="B")
    first = {o.request_id for o in eng.step()}
    assert first == {"A0", "B0"}
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0].token_ids for o in eng.step() if o.finished})
    alone = llm.fork().generate("tenant B's only request", params, tenant="B")[0].outputs[0].token_ids
    assert done["B0"] == alone
    eng.check_invariants()


def test_the_contended_budget_applies_only_while_tenants_compete():
    now = [0.0]
    sched = Scheduler(BlockManager(4096, 4), 64, 256, contended_budget=32, clock=lambda: now[0])
    sched.add(_seq("A0", "A", n_prompt=2000, max_tokens=2))
    sizes = [_step(sched).num_tokens for _ in range(2)]
    assert sizes == [256, 256], "a tenant alone gets the full budget"
    sched.add(_seq("B0", "B", n_prompt=10, max_tokens=3))
    for _ in range(3):  # B's prefill, then its decodes: two tenants, so steps of at most 32 tokens
        batch = _step(sched)
        assert batch.num_tokens <= 32 and any(s.tenant == "A" for s in batch.chunks), batch.num_tokens
    assert "B0" not in {s.request_id for s in sched.running}  # B finished
    now[0] += CONTENDED_LINGER_S / 2  # B's next request is a round trip away: A's steps stay small
    assert _step(sched).num_tokens <= 32, "B still competes just after its request ended"
    sched.add(_seq("B1", "B", n_prompt=10, max_tokens=1))
    batch = _step(sched)
    assert batch.num_tokens <= 32 and "B1" in {s.request_id for s in batch.prefills}, "B goes first, in a small step"
    now[0] += CONTENDED_LINGER_S + 0.01  # B has been gone for longer than the linger
    assert _step(sched).num_tokens == 256, "alone again: the full budget"
    unset = Scheduler(BlockManager(4096, 4), 64, 256)  # no contended budget: the full one always
    unset.add(_seq("A0", "A", n_prompt=600))
    unset.add(_seq("B0", "B", n_prompt=600))
    assert _step(unset).num_tokens == 256
