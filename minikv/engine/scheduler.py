"""Continuous batching: decide, every step, which sequences run and on how many tokens.

Static batching (one padded batch until its longest member finishes) wastes the GPU on
padding and on waiting.  Continuous batching (Orca, OSDI 2022; vLLM) re-forms the batch at
every step: finished sequences leave at once and waiting ones join, so a request that arrives
while others are decoding gets its first token without waiting for them to finish.

Each step, in order:

1. every running sequence gets a slot for its next token; if the pool is full, the most
   recently admitted sequence is *preempted by recompute* (its blocks are freed and it goes
   back to the head of the queue, to be prefilled again later) -- slower, never a crash;
2. waiting sequences are admitted while there is room in the pool, in the batch
   (``max_num_seqs``) and in the step's prefill budget (``max_num_batched_tokens``), in
   *fair-share* order (below).

The result is one *mixed* batch of decodes (1 token each) and prefills (all uncached tokens).

Admission order: fair share across tenants
------------------------------------------
Plain first-come-first-served lets one tenant starve the others: queue 100 requests, and a
neighbour's single request waits behind all of them -- a denial of service that needs no bug,
only volume.  So the next sequence admitted is chosen like this:

* sequences that were *preempted* go first, as before (they are at the head of the queue and
  already paid for a prefill once);
* otherwise each tenant's *oldest* waiting sequence is a candidate, and the candidate whose
  tenant has the **fewest sequences running** wins; ties go to the tenant admitted **longest
  ago** (a tenant never admitted counts as oldest), then to the earliest arrival.

Within one tenant the order stays first-come-first-served.  With equal running counts this is
round-robin across tenants; when slots free up, the tenant holding fewest of them gets the
next one.  The anonymous tenant (None) is one tenant like the others.  As before, if the chosen
sequence does not fit, admission stops for this step (no skipping ahead to smaller requests,
which could starve a large one forever).  Fairness is per tenant *name*: a client that can
open many accounts gets many shares, which is why a server also limits accounts and rates.
"""
from __future__ import annotations

import itertools
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Callable

from .block_manager import BlockManager
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    prefills: list[Sequence] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.prefills or self.decodes)


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 on_admit: Callable[[Sequence], None] | None = None):
        self.bm = block_manager
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.on_admit = on_admit
        self._last_admit: dict[str | None, int] = {}  # tenant -> when it was last admitted
        self._admissions = itertools.count()

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
        # 1. decodes: oldest first, so preemption victims are the newest arrivals.
        for seq in list(self.running):
            if seq not in self.running:  # preempted below while making room
                continue
            while not self.bm.append_slot(seq):
                victim = self.running[-1]
                self._preempt(victim, batch)
                if victim is seq:
                    break
            if seq in self.running:
                batch.decodes.append(seq)
        # 2. admissions (no new admissions in a step that had to preempt: the pool is tight).
        budget = self.max_num_batched_tokens
        while self.waiting and not batch.preempted and len(self.running) < self.max_num_seqs:
            seq = self._next_to_admit()
            cost = seq.num_tokens  # an upper bound; prefix hits make it cheaper
            if batch.prefills and cost > budget:
                break
            if not self.bm.allocate(seq):
                break
            self.waiting.remove(seq)
            self._last_admit[seq.tenant] = next(self._admissions)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefills.append(seq)
            budget -= seq.num_tokens - seq.num_computed_tokens
            if self.on_admit:
                self.on_admit(seq)
        if len(self._last_admit) > 4 * (len(self.waiting) + len(self.running)) + 64:
            present = {s.tenant for s in itertools.chain(self.waiting, self.running)}
            self._last_admit = {t: n for t, n in self._last_admit.items() if t in present}
        return batch

    def _next_to_admit(self) -> Sequence:
        """The waiting sequence that fair share admits next (see the module docstring)."""
        if self.waiting[0].num_preemptions:  # preempted sequences sit at the head; they go first
            return self.waiting[0]
        oldest: dict[str | None, Sequence] = {}
        for seq in self.waiting:
            oldest.setdefault(seq.tenant, seq)
        running = Counter(s.tenant for s in self.running)
        # min() keeps the first of equals, and ``oldest`` is in order of arrival.
        return min(oldest.values(), key=lambda s: (running[s.tenant], self._last_admit.get(s.tenant, -1)))
