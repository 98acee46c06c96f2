"""Continuous batching: decide, every step, which sequences run and on how many tokens.

Static batching (one padded batch until its longest member finishes) wastes the GPU on
padding and on waiting.  Continuous batching (Orca, OSDI 2022; vLLM) re-forms the batch at
every step: finished sequences leave at once and waiting ones join, so a request that arrives
while others are decoding gets its first token without waiting for them to finish.

One rule for prefill and decode
-------------------------------
A running sequence has ``num_tokens`` tokens, of which ``num_computed_tokens`` have K/V in the
pool; a step computes some of the rest.  A *decode* is the case of one token left; a *prefill*
has more.  (vLLM's v1 scheduler is built the same way: no phases, only computed tokens catching
up with tokens.)  Each step has a **token budget**, ``max_num_batched_tokens``, handed out so:

1. every decode gets its one token first -- a user watching a stream feels each step it
   misses.  If the pool has no slot for it, the most recently admitted sequence is *preempted
   by recompute* (its blocks are freed, it goes back to the head of the queue) -- slower, never
   a crash;
2. what is left goes to prefills, in *fair order* (below): a running sequence still prefilling
   gets its next chunk, or a waiting sequence is admitted (its blocks allocated, prefix hits
   found) and gets its first.  Decodes that leave less than one block still leave one block to
   prefills, so a crowd of streams cannot hold every prompt back.

**Chunked prefill.**  A prompt longer than what is left of the budget is not a step of its own:
it is cut, and the rest waits for later steps.  So no prompt, however long, holds the engine for
more than one budget, and the decodes of everyone else keep their pace.  A chunk that does not
finish the prompt (*non-final*) ends on a **block boundary**.  Then the next chunk is exactly a
prefill whose first blocks are already computed -- a prefix hit, to every attention backend --
and every full block it wrote is committed (hashed, registered for later hits) after the step,
as a prompt prefilled in one piece would have it committed.  A block is registered only once its
K/V are computed, so no other sequence can hit a block a chunk has not yet written.  A non-final
chunk samples no token; its seq's ``num_scheduled_tokens`` says how many tokens the step computes.

Fair order: tokens, not requests
--------------------------------
Plain first-come-first-served lets one tenant starve the others, and counting requests is not
enough either: sixteen prompts of 6,000 tokens would weigh as much as sixteen of 40.  The step's
budget is what a tenant takes from the others, so fairness is counted in **tokens scheduled**
(decodes and chunks; prefix hits cost nothing and count nothing):

* sequences that were *preempted* are re-admitted first (they sit at the head of the queue and
  already paid for a prefill once);
* otherwise each tenant with prefill work offers one candidate -- its oldest running sequence
  still prefilling, else its oldest waiting one -- and the tenant that has been **served the
  fewest tokens** gets the next chunk; ties go to the tenant served **longest ago**, then to the
  earliest arrival.  The choice is made again after every chunk.

``served`` is a virtual clock per tenant, as in fair queueing (and the ``min_vruntime`` of Linux's
CFS): a tenant that had no work and gets some starts at the least ``served`` among the busy ones,
so idling banks no credit to flood with later, and a newcomer is neither behind nor far ahead.
Within a tenant the order is first-come-first-served.  If the chosen waiting sequence does not fit
the pool or ``max_num_seqs``, admission stops for this step (no skipping ahead to smaller
requests, which could starve a large one forever); running prefills still get their chunks.
Fairness is per tenant *name*: a client that can open many accounts gets many shares, which is
why a server also limits accounts and rates.

**A smaller budget under contention.**  Fair order decides who gets the step; the budget decides
how long the step takes, and everyone's decode waits for it.  On a CPU a step's time grows with
its tokens, so one tenant's long prompts stretch every other tenant's steps however fair the
order.  A small budget fixes that, but costs a lone long prompt dearly (each chunk is a step, with
a step's overheads).  So ``contended_budget`` (``contended_num_batched_tokens``), when set, is
the budget of the steps in which two or more tenants compete; a tenant alone gets the full one.
A tenant still *competes* for :data:`CONTENDED_LINGER_S` after its last work: a client that sends
requests one after another is between two of them for a round trip, and if the budget sprang back
the moment its request ended, each next request would find a full-budget step in flight.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus

#: seconds a tenant counts as competing after it last had work (see the module docstring)
CONTENDED_LINGER_S = 1.0


@dataclass
class ScheduledBatch:
    prefills: list[Sequence] = field(default_factory=list)  # their prompt completes: sample a token
    chunks: list[Sequence] = field(default_factory=list)  # prefills cut short: K/V only, no token
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)  # newly allocated this step (in prefills or chunks)

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.chunks or self.decodes)

    @property
    def num_tokens(self) -> int:
        """Tokens this step computes: what the budget bounds."""
        return sum(s.num_scheduled_tokens for s in self.prefills + self.chunks + self.decodes)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 on_admit: Callable[[Sequence], None] | None = None, contended_budget: int | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.contended_budget = contended_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.on_admit = on_admit
        self.served: dict[str | None, int] = {}  # tenant -> tokens scheduled (a virtual clock)
        self._last_turn: dict[str | None, int] = {}  # tenant -> when it last got a chunk
        self._turns = itertools.count()
        self._busy: set[str | None] = set()  # tenants with work at the last step
        self._seen: dict[str | None, float] = {}  # tenant -> when it last had work (clock())
        self._clock = clock

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
            self.bm.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.running.remove(seq)
        self.bm.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        batch.preempted.append(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        self._start_clocks()
        # 1. decodes, oldest first, so preemption victims are the newest arrivals.
        for seq in list(self.running):
            if seq not in self.running or seq.num_tokens - seq.num_computed_tokens > 1:
                continue  # preempted below while making room, or still prefilling (step 2)
            while not self.bm.append_slot(seq):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq in self.running:
                batch.decodes.append(seq)
                seq.num_scheduled_tokens = 1
                self._charge(seq, 1)
        # 2. prefill chunks in fair order (no admissions in a step that had to preempt: the pool is tight).
        budget = max(self.budget() - len(batch.decodes), self.bm.block_size)
        admitting, scheduled = not batch.preempted, set(batch.decodes)
        while budget > 0:
            seq = self._next_prefill(scheduled, admitting)
            if seq is None:
                break
            if seq.status is SequenceStatus.WAITING:
                if min(seq.num_tokens, self.bm.block_size) > budget or not self._admit(seq, batch):
                    admitting = False  # it waits for the next step, and everyone behind it
                    continue
            n = self._chunk_size(seq, budget)
            if n == 0:
                break
            scheduled.add(seq)
            budget -= n
            self._charge(seq, n)
            (batch.prefills if seq.num_computed_tokens + n == seq.num_tokens else batch.chunks).append(seq)
        return batch

    def budget(self) -> int:
        """This step's token budget: the contended one while two or more tenants compete."""
        if self.contended_budget is not None and len(self._seen) > 1:
            return min(self.contended_budget, self.max_num_batched_tokens)
        return self.max_num_batched_tokens

    def _admit(self, seq: Sequence, batch: ScheduledBatch) -> bool:
        """Allocate a waiting sequence's blocks (prefix hits included) and make it running."""
        if len(self.running) >= self.max_num_seqs or not self.bm.allocate(seq):
            return False
        self.waiting.remove(seq)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.admitted.append(seq)
        if self.on_admit:
            self.on_admit(seq)
        return True

    def _chunk_size(self, seq: Sequence, budget: int) -> int:
        """Tokens ``seq`` computes this step: all it has left if they fit, else the most that
        end on a block boundary (0 if not even one block fits)."""
        start, left = seq.num_computed_tokens, seq.num_tokens - seq.num_computed_tokens
        if left <= budget:
            n = left
        else:
            n = (start + budget) // self.bm.block_size * self.bm.block_size - start
        seq.num_scheduled_tokens = max(n, 0)
        return seq.num_scheduled_tokens

    def _next_prefill(self, scheduled: set, admitting: bool) -> Sequence | None:
        """The sequence that gets the next chunk (see the module docstring), or None."""
        if admitting and self.waiting and self.waiting[0].num_preemptions:
            return self.waiting[0]  # preempted sequences sit at the head; they go first
        heads: dict[str | None, Sequence] = {}
        for seq in self.running:  # in order of admission: a tenant's oldest prefill first
            if seq not in scheduled and seq.num_tokens - seq.num_computed_tokens > 1:
                heads.setdefault(seq.tenant, seq)
        if admitting and len(self.running) < self.max_num_seqs:
            for seq in self.waiting:  # in order of arrival
                heads.setdefault(seq.tenant, seq)
        if not heads:
            return None
        # min() keeps the first of equals: running before waiting, then in order of arrival.
        return min(heads.values(), key=lambda s: (self.served[s.tenant], self._last_turn.get(s.tenant, -1)))

    def _charge(self, seq: Sequence, n: int) -> None:
        self.served[seq.tenant] += n
        self._last_turn[seq.tenant] = next(self._turns)

    def _start_clocks(self) -> None:
        """Set the virtual clock of each tenant that has just got work: never below the least
        ``served`` of the tenants that were already busy (so idle time is not banked)."""
        busy = {s.tenant for s in itertools.chain(self.waiting, self.running)}
        staying = [self.served[t] for t in busy & self._busy]
        floor = min(staying, default=0)
        for tenant in busy - self._busy:
            self.served[tenant] = max(self.served.get(tenant, 0), floor)
        self._busy = busy
        now = self._clock()
        self._seen = {t: when for t, when in self._seen.items() if now - when <= CONTENDED_LINGER_S}
        self._seen.update(dict.fromkeys(busy, now))
        if len(self.served) > 4 * len(busy) + 64:  # forget tenants long gone (bounded memory)
            self.served = {t: n for t, n in self.served.items() if t in busy}
            self._last_turn = {t: n for t, n in self._last_turn.items() if t in busy}
