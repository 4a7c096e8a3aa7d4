"""The scheduler plans each engine step: which sequences run, how many tokens each computes,
which memory they get. The plan is what the model runner executes and what gets recorded.

Continuous batching (vLLM v1's unified view): every sequence has `num_computed_tokens`, and a
step gives it `num_tokens - num_computed_tokens` new tokens: the whole prompt for a new
sequence, one token for a running decode. Prefills and decodes share a step, within
`max_num_seqs` and `max_num_batched_tokens`. When the KV cache cannot grow a running sequence,
the newest running sequence is preempted and will be recomputed (vLLM's policy).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from engines.builtin.config import EngineConfig
from engines.builtin.kv_cache import KVCacheManager
from engines.builtin.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    num_computed_before: int

    @property
    def is_decode(self) -> bool:
        """One new token on top of a cached context."""
        return self.num_new_tokens == 1 and self.num_computed_before > 0

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_before < self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the sequence's known tokens (so a token is drawn)?"""
        return self.num_computed_before + self.num_new_tokens == self.seq.num_tokens


@dataclass
class StepPlan:
    step: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)  # decodes first
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    allocated_blocks: dict[int, list[int]] = field(default_factory=dict)
    freed_blocks: list[int] = field(default_factory=list)
    copied_blocks: list[tuple[int, int]] = field(default_factory=list)
    padding_tokens: int = 0
    num_waiting: int = 0

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_decodes(self) -> int:
        return sum(1 for s in self.scheduled if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if not s.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        return self.num_decodes

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, max_num_seqs: int,
                 max_num_batched_tokens: int) -> None:
        self.config = config
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.step_counter = 0
        self._freed_since_last_plan: list[int] = []

    # ---- queue ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """FCFS within priority (lower value first), as vLLM's priority policy."""
        keys = [(s.priority, s.arrival_ns, s.seq_id) for s in self.waiting]
        index = bisect.bisect(keys, (seq.priority, seq.arrival_ns, seq.seq_id))
        self.waiting.insert(index, seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._freed_since_last_plan += self.kv.free(seq.seq_id)

    # ---- planning ---------------------------------------------------------------------------

    def schedule(self) -> StepPlan:
        plan = StepPlan(step=self.step_counter, freed_blocks=self._freed_since_last_plan)
        self._freed_since_last_plan = []
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []

        for seq in list(self.running):
            if seq not in self.running:  # preempted earlier in this loop
                continue
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget:
                continue
            while not self.kv.can_allocate(seq.seq_id, seq.num_tokens):
                victim = self.running[-1]
                self._preempt(victim, plan)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            self._allocate(seq, plan)
            budget -= num_new
            item = ScheduledSequence(seq, num_new, seq.num_computed_tokens)
            (decodes if item.is_decode else prefills).append(item)

        while self.waiting and len(self.running) < self.max_num_seqs and not plan.preempted:
            seq = self.waiting[0]
            num_new = seq.num_tokens - seq.num_computed_tokens
            if num_new > budget or not self.kv.can_allocate(seq.seq_id, seq.num_tokens):
                break
            self.waiting.pop(0)
            self._allocate(seq, plan)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            if seq.first_scheduled_step is None:
                seq.first_scheduled_step = plan.step
            plan.admitted.append(seq)
            budget -= num_new
            prefills.append(ScheduledSequence(seq, num_new, seq.num_computed_tokens))

        plan.scheduled = decodes + prefills
        plan.num_waiting = len(self.waiting)
        if plan.scheduled:
            self.step_counter += 1
        return plan

    def _allocate(self, seq: Sequence, plan: StepPlan) -> None:
        new_blocks = self.kv.allocate(seq.seq_id, seq.num_tokens)
        if new_blocks:
            plan.allocated_blocks[seq.seq_id] = new_blocks

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Recompute preemption: drop the KV, requeue at the front of its priority class."""
        self.running.remove(seq)
        plan.freed_blocks += self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        plan.preempted.append(seq)
        self.waiting.insert(0, seq)

    def complete_step(self, plan: StepPlan) -> None:
        """Advance each scheduled sequence past the tokens this step computed."""
        retains = self.kv.retains_kv
        for item in plan.scheduled:
            seq = item.seq
            computed = item.num_computed_before + item.num_new_tokens
            seq.num_computed_tokens = computed if retains else 0
            self.kv.commit(seq.seq_id, computed)
