"""The scheduler plans each engine step: which sequences run, how many tokens each computes,
which memory they get. The plan is what the model runner executes and what gets recorded.

Continuous batching (vLLM v1's unified view): every sequence has `num_computed_tokens`, and a
step gives it `num_tokens - num_computed_tokens` new tokens: the whole prompt for a new
sequence, one token for a running decode. Prefills and decodes share a step, within
`max_num_seqs` and `max_num_batched_tokens` (the token budget). Each step serves, in order,
the running decodes (one token each), the running sequences still in prefill, then waiting
sequences (FCFS within priority). When the KV cache cannot grow a running sequence, the newest
running sequence is preempted and will be recomputed (vLLM's policy).

Chunked prefill (`enable_chunked_prefill`, vLLM's semantics): a prefill takes as many tokens
as the remaining budget allows, so a prompt longer than the budget is split over several steps
and shares each of them with the running decodes; its first token is sampled on the step whose
chunk reaches the end of the prompt. Without it a prompt must fit the budget whole.

Static batching (`batching=static`): when nothing runs, up to `max_num_seqs` waiting sequences
(in queue order, as many as the KV cache and the budget admit) form a batch, prefilled in one
step padded to the longest prompt; the batch then decodes until every member has finished. A
finished member keeps its KV memory and its row, computing one padding token per step, until
the whole batch is done; only then is the next batch admitted. Padding is real compute, recorded
in `StepPlan.padding_tokens` (see `PaddingRow` and `ScheduledSequence.num_padding_tokens`).
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from engines.builtin.config import EngineConfig
from engines.builtin.kv_cache import KVCacheManager
from engines.builtin.kv_cache.tiers import BlockTransfer
from engines.builtin.limits import EngineLimits
from engines.builtin.sequence import Sequence, SequenceStatus
from engines.builtin.spec_decode.proposer import Proposal
from models.config import ceil_div

#: how many steps a request may wait for an adapter slot while later requests under running
#: adapters pass it (next_to_admit); then they wait behind it
ADAPTER_PATIENCE_STEPS = 16


@dataclass
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int
    num_computed_before: int
    #: Static batching: padding tokens computed after this sequence's new tokens, in its own
    #: row (right padding to the batch's longest row). Causal attention keeps them out of the
    #: real tokens' results, and they are never sampled.
    num_padding_tokens: int = 0
    #: Speculative decoding: the drafts this step verifies, computed after the sequence's last
    #: token (they are the last `num_draft_tokens` of `num_new_tokens`). None: no drafts.
    proposal: Proposal | None = None

    @property
    def num_draft_tokens(self) -> int:
        return 0 if self.proposal is None else len(self.proposal.token_ids)

    @property
    def new_token_ids(self) -> list[int]:
        """The tokens this step computes: the sequence's next ones, then any drafts."""
        start = self.num_computed_before
        own = self.seq.token_ids[start : start + self.num_new_tokens - self.num_draft_tokens]
        return own if self.proposal is None else own + self.proposal.token_ids

    @property
    def is_decode(self) -> bool:
        """One new token on top of a cached context, past the prompt (a one-token last chunk
        of a prompt is still prefill)."""
        return (
            self.num_new_tokens == 1
            and self.num_computed_before > 0
            and self.num_computed_before >= self.seq.num_prompt_tokens
        )

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_before < self.seq.num_prompt_tokens

    @property
    def samples(self) -> bool:
        """Does this step reach the end of the sequence's known tokens (so a token is drawn)?"""
        own = self.num_new_tokens - self.num_draft_tokens
        return self.num_computed_before + own == self.seq.num_tokens


@dataclass
class PaddingRow:
    """Static batching: the row of a finished batch member that still holds its slot.

    With a KV cache it is a one-token decode (pad id 0) at the position of the sequence's last
    sampled token; it attends over the sequence's context as a real row of a static batch
    does, and its K/V are not stored.
    Without a KV cache (kv_cache=none) it is a fresh `num_tokens`-token row (positions from 0)
    that attends only to itself. Its output is dropped; nothing samples it.
    """

    seq: Sequence
    num_tokens: int
    start: int  # position of the row's first token

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0


@dataclass
class StepPlan:
    step: int
    scheduled: list[ScheduledSequence] = field(default_factory=list)  # decodes first
    admitted: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    allocated_blocks: dict[int, list[int]] = field(default_factory=dict)
    freed_blocks: list[int] = field(default_factory=list)
    copied_blocks: list[tuple[int, int]] = field(default_factory=list)
    # KV tiers: evicted blocks to save and tier hits to load, in order, before the copies
    kv_transfers: list[BlockTransfer] = field(default_factory=list)
    padding_rows: list[PaddingRow] = field(default_factory=list)  # static batching only
    padding_tokens: int = 0
    num_waiting: int = 0
    # speculative decoding, known after the step: per verifying row, (drafts, drafts kept)
    spec_rounds: list[tuple[int, int]] = field(default_factory=list)

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
    def num_draft_tokens(self) -> int:
        """Speculative drafts this step verifies (counted in num_prefill_tokens: a verifying
        row computes several tokens over its cached context, as a prefill chunk does)."""
        return sum(s.num_draft_tokens for s in self.scheduled)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(kept for _, kept in self.spec_rounds)

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens computed this step."""
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        limits: EngineLimits,
    ) -> None:
        self.config = config
        self.kv = kv
        self.max_model_len = limits.max_model_len
        self.max_num_seqs = limits.max_num_seqs
        self.max_num_batched_tokens = limits.max_num_batched_tokens
        self.static = config.batching == "static"
        self.chunked = config.enable_chunked_prefill
        # the most tokens one prompt's chunk takes of a step (chunked prefill only)
        self.max_chunk = config.long_prefill_token_threshold or limits.max_num_batched_tokens
        self.prefix_caching = config.enable_prefix_caching
        # LoRA: the most distinct adapters running at once (their slots), and whether an
        # adapter is read and may run (set by the engine: its reading is off the step loop)
        self.max_loras = config.max_loras
        self.lora_ready: Callable[[str], bool] = lambda name: True
        self._slot_waits: dict[int, int] = {}  # seq_id -> the step it first waited for a slot
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        #: Static batching: finished members of the current batch, still holding their KV
        #: memory and their row until the whole batch is done (batch order).
        self.batch: list[Sequence] = []
        self.step_counter = 0
        self._freed_since_last_plan: list[int] = []
        # Cumulative since load, for a server's /metrics (vLLM's num_preemptions,
        # prefix_cache_queries and prefix_cache_hits): recompute preemptions, and, with prefix
        # caching, the tokens each admission from the queue looked up and found cached.
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_tier_hits: dict[str, int] = {}  # of those, loaded back from each KV tier
        # Aborted sequences (a cancelled request, a client gone) and when their KV memory came
        # back, in steps started between the abort and the free: the claim that an abort frees
        # its blocks before the next step (0) is then a number a run shows, not an assumption
        # (static batching keeps a member's memory until its batch ends: more than 0 there).
        self.num_aborted = 0
        self.abort_blocks_freed = 0
        self.abort_free_steps_max: int | None = None  # None: nothing aborted held memory yet
        self._aborted_at: dict[int, int] = {}  # seq_id -> step_counter at its abort

    # ---- queue ------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        """FCFS within priority (lower value first), as vLLM's priority policy."""
        keys = [(s.priority, s.arrival_ns, s.seq_id) for s in self.waiting]
        index = bisect.bisect(keys, (seq.priority, seq.arrival_ns, seq.seq_id))
        self.waiting.insert(index, seq)
        if self.prefix_caching and seq.sampling.prompt_logprobs is None:
            self.kv.prefetch_prefix(seq.token_ids, seq.kv_namespace)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._slot_waits.pop(seq.seq_id, None)
        if reason == "abort":
            self.num_aborted += 1
            self._aborted_at[seq.seq_id] = self.step_counter
        if seq in self.running:
            self.running.remove(seq)
            if self.static:
                # The slot stays reserved until the whole batch is done.
                if not self.running:
                    for member in self.batch:
                        self._freed_since_last_plan += self._free(member.seq_id)
                    self.batch = []
                return
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._freed_since_last_plan += self._free(seq.seq_id)

    def _free(self, seq_id: int) -> list[int]:
        """A finished sequence's KV memory back to the cache, an aborted one's timed."""
        freed = self.kv.free(seq_id)
        aborted_at = self._aborted_at.pop(seq_id, None)
        if aborted_at is not None:
            self.abort_blocks_freed += len(freed)
            lag = self.step_counter - aborted_at
            self.abort_free_steps_max = max(lag, self.abort_free_steps_max or 0)
        return freed

    # ---- planning ---------------------------------------------------------------------------

    def schedule(self, proposals: Mapping[int, Proposal] | None = None) -> StepPlan:
        """The next step's plan; `proposals` (seq_id -> drafts, speculative decoding) extend
        running decodes by their drafts where the budget and the KV cache allow."""
        plan = StepPlan(step=self.step_counter, freed_blocks=self._freed_since_last_plan)
        self._freed_since_last_plan = []
        if self.static:
            self._schedule_static(plan)
        else:
            self._schedule_continuous(plan, proposals or {})
        plan.num_waiting = len(self.waiting)
        plan.copied_blocks = self.kv.take_copies()  # copy-on-write, done before the forward
        plan.kv_transfers = self.kv.take_transfers()
        if plan.scheduled:
            self.step_counter += 1
        return plan

    def _schedule_continuous(self, plan: StepPlan, proposals: Mapping[int, Proposal]) -> None:
        budget = self.max_num_batched_tokens
        decodes: list[ScheduledSequence] = []
        prefills: list[ScheduledSequence] = []
        scheduled: set[Sequence] = set()

        def is_decode(seq: Sequence) -> bool:
            return seq.num_tokens - seq.num_computed_tokens == 1 and seq.num_computed_tokens >= max(
                1, seq.num_prompt_tokens
            )

        # Running decodes first (one token each), then running sequences still in prefill
        # (chunked prefill's partial prompts; with kv_cache=none every running sequence).
        for decode_pass in (True, False):
            for seq in list(self.running):
                if seq not in self.running or is_decode(seq) is not decode_pass:
                    continue  # preempted earlier in this loop, or not this pass
                if seq.awaits_group:
                    continue  # a beam with its candidates in: nothing to compute (even
                    # without a KV cache, where its count restarts at 0 every step)
                num_new = seq.num_tokens - seq.num_computed_tokens
                if self.chunked:
                    num_new = min(num_new, budget, self.max_chunk)
                if num_new == 0 or num_new > budget:
                    continue
                while not self.kv.can_allocate(seq.seq_id, seq.num_computed_tokens + num_new):
                    # The newest running sequence not already scheduled in this step (the
                    # decode pass runs first); at worst the sequence itself.
                    victim = next(v for v in reversed(self.running) if v not in scheduled)
                    self._preempt(victim, plan)
                    if victim is seq:
                        break
                if seq.status is not SequenceStatus.RUNNING:
                    continue
                self._allocate(seq, seq.num_computed_tokens + num_new, plan)
                budget -= num_new
                item = ScheduledSequence(seq, num_new, seq.num_computed_tokens)
                (decodes if item.is_decode else prefills).append(item)
                scheduled.add(seq)

        # Then waiting sequences, in queue order; with chunked prefill the last one admitted
        # may get only the first chunk of its prompt.
        while len(self.running) < self.max_num_seqs and not plan.preempted:
            admit = self.next_to_admit()
            if admit is None:
                break
            seq = admit
            cached = self._match_prefix(seq)
            if seq.remote_kv is not None:  # a prefill instance computed the prompt
                seq.num_computed_tokens = max(cached, seq.num_prompt_tokens - 1)
            num_new = seq.num_tokens - seq.num_computed_tokens
            if self.chunked:
                num_new = min(num_new, budget, self.max_chunk)
            total = seq.num_computed_tokens + num_new
            if num_new == 0 or num_new > budget or not self.kv.can_allocate(seq.seq_id, total):
                if cached:  # give the adopted prefix blocks back until it is admitted
                    self.kv.free(seq.seq_id)
                seq.num_computed_tokens = 0
                break
            if seq.first_scheduled_step is None:
                seq.cached_prompt_tokens = cached
            if self.prefix_caching:  # counted once admitted: a lookup given back is retried
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += cached
                # KV tiers (empty without them; the last match's only when it found some):
                # every admission's loads, a readmission's after a preemption too
                for tier in self.kv.last_match_tiers:
                    loaded = self.kv.last_match_tiers[tier] if cached else 0
                    seq.tier_prompt_tokens[tier] = seq.tier_prompt_tokens.get(tier, 0) + loaded
                    self.prefix_tier_hits[tier] = self.prefix_tier_hits.get(tier, 0) + loaded
            self.waiting.remove(seq)
            self._allocate(seq, total, plan)
            if seq.num_computed_tokens > cached:
                self._load_remote_kv(seq, cached)
            self._admit(seq, plan)
            budget -= num_new
            prefills.append(ScheduledSequence(seq, num_new, seq.num_computed_tokens))

        if not decodes and not prefills and self._all_running_idle() and self.next_to_admit():
            # Beams waiting for siblings that wait in the queue for the memory or the seats
            # those beams hold: the newest gives them up (it recomputes when readmitted).
            self._preempt(self.running[-1], plan)

        # Last, drafts (speculative decoding) extend rows that reach their sequence's end (a
        # decode; with kv_cache=none its whole context), in the budget and KV memory left:
        # they never take what any sequence's own tokens need.
        for item in decodes + prefills:
            proposal = proposals.get(item.seq.seq_id)
            if proposal is None or not item.samples or item.seq in plan.admitted:
                continue
            fitted = self._fit_drafts(item.seq, proposal, budget)
            if fitted is not None:
                item.proposal = fitted
                item.num_new_tokens += len(fitted.token_ids)
                budget -= len(fitted.token_ids)
                self._allocate(item.seq, item.num_computed_before + item.num_new_tokens, plan)
        # decodes first: the runner packs them so. A sequence readmitted after a preemption
        # with all but its last token cached is admitted as one (its next token on a cached
        # context), after the running ones
        items = decodes + prefills
        plan.scheduled = [s for s in items if s.is_decode] + [s for s in items if not s.is_decode]

    def next_to_admit(self) -> Sequence | None:
        """The first waiting sequence with something to compute (a preempted beam whose
        candidates are in waits for its group instead) whose adapter can run now (one still
        being read, or one more adapter than the slots hold, waits; later requests may pass
        it, as in vLLM). Once one has waited ADAPTER_PATIENCE_STEPS steps for a slot, later
        requests under an adapter wait too, so that the running adapters drain and free a
        slot (a steady stream for one adapter would otherwise hold it for ever)."""
        active = {s.lora_name for s in self.running if s.lora_name is not None}
        overdue = False
        for seq in self.waiting:
            if seq.awaits_group:
                continue
            name = seq.lora_name
            if name is None:
                return seq
            if overdue:
                continue
            if name not in active and len(active) >= self.max_loras:
                since = self._slot_waits.setdefault(seq.seq_id, self.step_counter)
                overdue = self.step_counter - since >= ADAPTER_PATIENCE_STEPS
                continue
            if self.lora_ready(name):  # its read starts only once a slot could take it
                self._slot_waits.pop(seq.seq_id, None)
                return seq
        return None

    def _all_running_idle(self) -> bool:
        """Running sequences with nothing to compute: beams whose candidates wait for the
        rest of their group (engines/builtin/beam_search.py)."""
        return bool(self.running) and all(seq.awaits_group for seq in self.running)

    def _fit_drafts(self, seq: Sequence, proposal: Proposal, budget: int) -> Proposal | None:
        """The proposal cut to what the token budget and the free KV memory take beyond the
        decode's own token (drafts never preempt anyone); None when no draft fits."""
        keep = min(len(proposal.token_ids), budget)
        while keep and not self.kv.can_allocate(seq.seq_id, seq.num_tokens + keep):
            keep -= 1
        if keep == 0:
            return None
        if keep == len(proposal.token_ids):
            return proposal
        probs = None if proposal.probs is None else proposal.probs[:keep]
        return Proposal(proposal.token_ids[:keep], probs)

    def _schedule_static(self, plan: StepPlan) -> None:
        if not self.running:
            self._admit_static_batch(plan)
            return
        # The batch decodes; finished members compute padding in their rows.
        if self.kv.retains_kv:
            plan.scheduled = [
                ScheduledSequence(seq, 1, seq.num_computed_tokens) for seq in self.running
            ]
            plan.padding_rows = [
                PaddingRow(seq, 1, seq.num_tokens - 1) for seq in self.batch if seq.is_finished
            ]
        else:
            # No KV cache: every row recomputes its context, padded to the longest one.
            width = max(seq.num_tokens for seq in self.running)
            plan.scheduled = [
                ScheduledSequence(seq, seq.num_tokens, 0, width - seq.num_tokens)
                for seq in self.running
            ]
            plan.padding_rows = [PaddingRow(seq, width, 0) for seq in self.batch if seq.is_finished]
        plan.padding_tokens = sum(s.num_padding_tokens for s in plan.scheduled) + sum(
            r.num_tokens for r in plan.padding_rows
        )

    def _adapter_fits(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        """Whether `seq`'s adapter can run beside `running`'s: a slot for it, then its
        weights read (the read starts only once a slot could take it)."""
        name = seq.lora_name
        if name is None:
            return True
        active = {s.lora_name for s in running if s.lora_name is not None}
        return (name in active or len(active) < self.max_loras) and self.lora_ready(name)

    def _admit_static_batch(self, plan: StepPlan) -> None:
        """Up to max_num_seqs waiting sequences, in queue order, while the KV cache can reserve
        each one's whole final length (a static batch never grows or preempts) and the padded
        batch fits the token budget: its prefill (members x longest prompt) with a KV cache,
        its widest recompute (members x longest final length) without one."""
        batch: list[Sequence] = []
        final: dict[int, int] = {}  # seq_id -> the most tokens the sequence can reach
        width = 0  # the widest padded row the batch will compute
        for seq in self.waiting:
            if len(batch) == self.max_num_seqs:
                break
            if not self._adapter_fits(seq, batch):
                continue
            most = min(seq.num_prompt_tokens + seq.sampling.max_tokens, self.max_model_len)
            most = max(most, seq.num_tokens)
            new_width = max(width, seq.num_tokens if self.kv.retains_kv else most)
            if batch and (len(batch) + 1) * new_width > self.max_num_batched_tokens:
                break
            # Padding K/V is never stored (the model runner skips those writes), so a member
            # reserves its own final length only.
            if not self.kv.can_allocate(seq.seq_id, most):
                break
            self._allocate(seq, most, plan)
            batch.append(seq)
            final[seq.seq_id] = most
            width = new_width
        if not batch:
            return
        longest = max(seq.num_tokens for seq in batch)
        for seq in batch:
            self.waiting.remove(seq)
            self._admit(seq, plan)
            plan.scheduled.append(
                ScheduledSequence(
                    seq,
                    seq.num_tokens - seq.num_computed_tokens,
                    seq.num_computed_tokens,
                    longest - seq.num_tokens,
                )
            )
        self.batch = batch
        plan.padding_tokens = sum(s.num_padding_tokens for s in plan.scheduled)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Run `child` beside `parent` on a copy of its KV (shared blocks for paged KV), or,
        when the cache has no room for the copy (or the parent, a preempted beam, holds no
        KV), queue it to recompute its context."""
        child.num_computed_tokens = parent.num_computed_tokens
        room = len(self.running) < self.max_num_seqs and parent.status is SequenceStatus.RUNNING
        if room and self.kv.retains_kv and self.kv.can_fork(parent.seq_id, child.seq_id):
            self.kv.fork(parent.seq_id, child.seq_id)
            child.status = SequenceStatus.RUNNING
            self.running.insert(self.running.index(parent) + 1, child)
        else:
            child.num_computed_tokens = 0
            self._requeue_first(child)

    def _requeue_first(self, seq: Sequence) -> None:
        """Queue `seq` ahead of every waiting sequence of its priority and behind every more
        urgent one (it arrived before its class's waiting ones)."""
        classes = [s.priority for s in self.waiting]
        self.waiting.insert(bisect.bisect_left(classes, seq.priority), seq)

    def _match_prefix(self, seq: Sequence) -> int:
        """Prefix caching: adopt the cached full blocks of the prompt's prefix; the sequence
        then starts computing after them (the last prompt token is always computed)."""
        # a request that asks for its prompt's logprobs computes every prompt token: a cached
        # block has K/V but no logits (vLLM v1 skips the cache for it too)
        wants_logits = seq.sampling.prompt_logprobs is not None
        if not self.prefix_caching or seq.num_computed_tokens or wants_logits:
            return 0
        cached = self.kv.match_prefix(seq.seq_id, seq.token_ids, seq.kv_namespace)
        seq.num_computed_tokens = cached
        return cached

    def _load_remote_kv(self, seq: Sequence, cached: int) -> None:
        """Disaggregation: the blocks after the `cached` prefix are filled from the K/V a
        prefill instance computed, up to the last prompt token (computed here, to sample);
        a partly filled last block is loaded whole (its rest is written by this step)."""
        assert seq.remote_kv is not None and cached % self.kv.block_size == 0
        first = cached // self.kv.block_size
        last = ceil_div(seq.num_computed_tokens, self.kv.block_size)
        self.kv.load_blocks(seq.seq_id, first, seq.remote_kv[first:last])
        seq.remote_prompt_tokens += seq.num_computed_tokens - cached

    def _admit(self, seq: Sequence, plan: StepPlan) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.first_scheduled_step is None:
            seq.first_scheduled_step = plan.step
        plan.admitted.append(seq)

    def _allocate(self, seq: Sequence, num_tokens: int, plan: StepPlan) -> None:
        new_blocks = self.kv.allocate(seq.seq_id, num_tokens)
        if new_blocks:
            plan.allocated_blocks.setdefault(seq.seq_id, []).extend(new_blocks)

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        """Recompute preemption: drop the KV, requeue at the front of its priority class."""
        self.running.remove(seq)
        plan.freed_blocks += self.kv.free(seq.seq_id)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        plan.preempted.append(seq)
        self._requeue_first(seq)

    def complete_step(self, plan: StepPlan, kept_drafts: Mapping[int, list[int]]) -> None:
        """Advance each scheduled sequence past the tokens this step computed and kept:
        `kept_drafts` (seq_id -> the drafts verification kept, speculative rows only). The K/V
        of rejected drafts are dropped: the sequence's count stops before them, and with paged
        KV the blocks they alone occupy go back to the pool. Prefix-cache hashes cover kept
        tokens only."""
        retains = self.kv.retains_kv
        for item in plan.scheduled:
            seq = item.seq
            computed = item.num_computed_before + item.num_new_tokens
            tokens = seq.token_ids
            if item.proposal is not None:
                kept = kept_drafts.get(seq.seq_id, [])
                computed -= item.num_draft_tokens - len(kept)
                tokens = tokens + kept
            seq.num_computed_tokens = computed if retains else 0
            self.kv.commit(seq.seq_id, computed, tokens, seq.kv_namespace)
            if item.proposal is not None:
                self._freed_since_last_plan += self.kv.truncate(seq.seq_id, computed)
