"""What every benchmark section stands on: its workloads and its timers.

``python -m minikv.bench`` is several modules, one per section (:mod:`minikv.bench.speed`,
:mod:`minikv.bench.prefill`, :mod:`minikv.bench.sharing`, ...), and they measure on the same
footing: the same seeded prompts, the same clock, the same steady-state pool.  Those shared
pieces live here, below every section, so that sections import this module and never each
other's internals (an import circle between two sections is how a "helper" ends up owned by
whichever file happened to need it first).

* :func:`random_prompts` -- the one workload generator: seeded token-id prompts;
* :func:`resident`, :func:`completed` -- an engine made ready to time, and a check that what was
  timed was real work;
* :func:`sync`, :func:`timed` -- the clock, with the device's queue drained on both sides;
* :func:`hit_rate_vs_tenants` -- the isolation workload: N tenants sharing one system prompt,
  shared by ``--only isolation`` and ``--only sharing``.
"""
from __future__ import annotations

import gc
import random
import time
import warnings
from typing import TYPE_CHECKING

import torch

from ..engine import SamplingParams, UnsafeSettingWarning
from ..backends.host_memory import give_back_freed_memory

if TYPE_CHECKING:
    from ..llm import LLM


def random_prompts(vocab: int, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    edge = min(1000, vocab // 4)  # avoid special and rare ids at both ends of the vocabulary
    return [[rng.randrange(edge, vocab - edge) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def resident(llm):
    """``llm`` with its KV pool made resident (:meth:`KVPool.prefault`), before anything is timed.

    A CPU pool's pages are faulted in the first time each is written, and freed blocks go to the
    back of the free list (as in vLLM), so every run of a workload on a young pool writes blocks
    never written before, and pays their page faults, until the pool has been used all round.
    What a fault costs depends on the VM's moment (docs/BENCHMARKS.md, "Memory", has the counts
    and times), so those faults moved every figure with a prefill in it, and not on both sides of a ratio:
    transformers' buffers come from the heap its warm-up already touched.  A server that has been
    up a while has touched its whole pool; the benchmark times that steady state, on every engine
    it times (the isolation section also prints scrubbing on a fresh pool, where it differs most)."""
    llm.engine.pool.prefault()
    return llm


def completed(outputs: list) -> list:
    """``outputs``, once none of its requests failed.  The engine finishes a request whose forward
    raised with ``finish_reason="error"`` and keeps serving the rest (``step_guard.py``), so a
    benchmark that only counted tokens would time failures and print their speed (docs/BENCHMARKS.md,
    "GPU", tells of a run that did).  A failed request stops the benchmark instead, naming it and
    its error."""
    bad = [o for o in outputs if o.outputs[0].finish_reason == "error"]
    if bad:
        raise RuntimeError(f"{len(bad)} of {len(outputs)} benchmark requests failed, the first "
                           f"({bad[0].request_id!r}): {bad[0].outputs[0].error}")
    return outputs


def sync(device) -> None:
    """Wait for the device's queued work: CUDA runs asynchronously, so a clock read without this
    would time the launches, not the kernels.  A no-op on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device) -> tuple[int, float]:
    """``(fn(), seconds)``, the device drained before the clock starts and before it stops."""
    sync(device)
    t0 = time.perf_counter()
    result = fn()
    sync(device)
    return result, time.perf_counter() - t0


def hit_rate_vs_tenants(base: LLM, tenants=(1, 4, 16, 64), seed=0, questions_per_tenant=2,
                        extra_policies=(), measure=None) -> dict:
    """Prefix-cache hit rate (cached / prompt tokens) when N tenants share one system prompt.
    Each configuration is a fork of ``base``: a fresh pool, the same weights.  ``extra_policies``:
    more ``(label, fork settings)`` rows on the same requests; ``measure(llm, prompt, tenant) ->
    (cached, prompt tokens)`` replaces the one-request ``generate`` (``minikv.bench.sharing``)."""
    system = "You are the support assistant of ACME Corp. Answer politely, cite the policy, never share data. " * 3
    words = "order refund shipping invoice account password delivery warranty".split()
    policies = (("shared (unsafe)", dict(cache_isolation="shared")),
                ("tenant", dict(cache_isolation="tenant")),
                ("tenant + shared_prefixes", dict(cache_isolation="tenant", shared_prefixes=[system])),
                *extra_policies)
    results: dict[str, dict[int, float]] = {label: {} for label, _ in policies}
    for n in tenants:
        rng = random.Random(seed + n)  # the same requests for every policy: a fair comparison
        reqs = [(f"t{t}", system + " ".join(rng.choice(words) for _ in range(8)) + "?")
                for _ in range(questions_per_tenant) for t in range(n)]
        for label, kwargs in policies:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UnsafeSettingWarning)
                llm = base.fork(enable_prefix_caching=True, **kwargs)
            cached = total = 0
            for tenant, prompt in reqs:
                c, t = (measure or _generate_one)(llm, prompt, tenant)  # (not n: n is the tenant count)
                cached, total = cached + c, total + t
            results[label][n] = cached / total
    return results


def _generate_one(llm: LLM, prompt, tenant) -> tuple[int, int]:
    o = llm.generate(prompt, SamplingParams(max_tokens=1, temperature=0.0), tenant=tenant)[0]
    return o.num_cached_tokens, len(o.prompt_token_ids)


def release() -> None:
    """Between sections, and between the dtypes of one: the last engines and models are garbage
    now, and the heap keeps what they freed (``host_memory.keep_freed_memory``), so hand it back
    before the next ones are built, or every section's peak would stack on the one before."""
    gc.collect()
    give_back_freed_memory()
