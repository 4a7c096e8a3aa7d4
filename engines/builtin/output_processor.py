"""Output processing: what the engine does with a step's sampled tokens.

    the step's plan -> Preempted / Scheduled / PrefillChunk events
    sampled tokens -> forks for parallel sampling (n > 1) -> append -> detokenize incrementally
    -> stop tokens, EOS, length, stop strings -> text deltas -> Tokens / Finished events

vLLM's OutputProcessor does the same after its engine core; here it runs in the engine's step,
between the model runner and the step's end timestamp (so detokenization is inside the step's
timing, and each request's detokenize time is reported in its Finished event).
"""

from __future__ import annotations

import torch

from engines.base import (
    Finished,
    Preempted,
    PrefillChunk,
    PromptLogprobs,
    RequestEvent,
    Scheduled,
    TokenLogprob,
    Tokens,
    now_ns,
)
from engines.builtin.final_outputs import FinalOutputs
from engines.builtin.scheduler import Scheduler, StepPlan
from engines.builtin.sequence import Sequence
from models.tokenizer import Tokenizer

#: A step's new tokens by sequence key: [(token, text delta to stream, its log-probabilities
#: when the request asks)].
NewTokens = dict[str, list[tuple[int, str, TokenLogprob | None]]]


def seeded_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A sequence's own RNG when its request has a seed (reproducible whatever else runs)."""
    return None if seed is None else torch.Generator(device).manual_seed(seed)


class OutputProcessor:
    """Turns sampled tokens into sequence state, text and events. Shares the engine's
    `sequences` (key -> Sequence): forks are added to it, finished sequences removed."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        scheduler: Scheduler,
        sequences: dict[str, Sequence],
        eos_ids: list[int],
        max_model_len: int,
        device: torch.device,
        jump_forward: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduler = scheduler
        self.sequences = sequences
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.device = device
        self.jump_forward = jump_forward  # engine.structured_output_jump_forward
        self.detokenize_ns: dict[str, int] = {}  # per sequence key, reported in Finished
        self.final = FinalOutputs(tokenizer, sequences, self.finished, self.detokenize_ns)

    def add(self, seq: Sequence) -> None:
        """Give a new sequence its detokenizer (when its request wants text)."""
        if seq.sampling.detokenize and not seq.sampling.use_beam_search:
            # a beam's text is decoded once, if it wins (beam_events)
            seq.detok = self.tokenizer.new_stream(
                seq.prompt_token_ids, seq.sampling.skip_special_tokens
            )

    def schedule_events(self, plan: StepPlan, time_ns: int) -> list[RequestEvent]:
        """What the plan does to requests, stamped at the step's start: preempted ones, ones
        scheduled for the first time (a preempted one resuming is not), prompt chunks."""
        step = plan.step
        events: list[RequestEvent] = [
            Preempted(seq.request_id, step, time_ns, "kv cache full") for seq in plan.preempted
        ]
        for seq in plan.admitted:
            if seq.first_scheduled_step == step and seq.num_preemptions == 0:
                events.append(Scheduled(seq.request_id, step, time_ns))
        for item in plan.scheduled:
            if item.is_prefill:
                events.append(
                    PrefillChunk(
                        item.seq.request_id,
                        step,
                        time_ns,
                        item.num_new_tokens,
                        item.num_computed_before,
                    )
                )
        return events

    def process(
        self,
        plan: StepPlan,
        tokens: list[list[int]],
        logprobs: list[list[TokenLogprob] | None] | None = None,
    ) -> NewTokens:
        """Append each sequence's new tokens (one list per sampling sequence of `plan`, in plan
        order, the first token of each fork included; several with speculative decoding),
        detokenize, check stops after every token; finish what stopped, dropping the tokens
        after a stop. Returns key -> [(token, text delta to stream)] (text held back while it
        may start a stop string)."""
        out: NewTokens = {}
        sampled: list[Sequence] = []
        for item in plan.scheduled:
            if item.samples:
                sampled.append(item.seq)
                sampled += self._fork(item.seq)
        per_seq = logprobs if logprobs is not None else [None] * len(tokens)
        for seq, new_tokens, new_logprobs in zip(sampled, tokens, per_seq, strict=True):
            if seq.sampling.use_beam_search:
                continue  # a beam's token is chosen by its group (BeamSearch.report)
            appended = out[seq.key] = []
            for i, token in enumerate(new_tokens):
                found = new_logprobs[i] if new_logprobs is not None else None
                if found is not None and seq.sampling.ranks_samples:
                    seq.cumulative_logprob += found.logprob
                    if seq.sampling.logprobs is None:
                        found = None  # computed for the rank only
                appended.append((token, self._append(seq, token), found))
                if seq.is_finished:
                    break
            if self.jump_forward and seq.grammar is not None and not seq.is_finished:
                appended += self._jump_forward(seq)
        return out

    def _append(self, seq: Sequence, token: int) -> str:
        """One token: append, detokenize, check the stop conditions; returns its text delta."""
        seq.token_ids.append(token)
        p = seq.sampling
        reason = None
        if token in p.stop_token_ids or (token in self.eos_ids and not p.ignore_eos):
            reason = "stop" if seq.num_output_tokens >= p.min_tokens else None
        if seq.grammar is not None and (
            not seq.grammar.accept(token) or seq.grammar.is_terminated()
        ):
            # the grammar has ended (its stop token accepted, ignore_eos or not), or refused a
            # token only conflicting masks let through (min_tokens past its end)
            reason = "stop"
        if reason is None and (
            seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len
        ):
            reason = "length"
        delta = ""
        if seq.detok is not None:
            detok_start = now_ns()
            seq.text += seq.detok.step(token)
            if reason is not None:
                seq.text += seq.detok.flush()
            self.detokenize_ns[seq.key] = (
                self.detokenize_ns.get(seq.key, 0) + now_ns() - detok_start
            )
            if p.stop:
                hit = _find_stop(seq)
                if hit is not None:
                    seq.text, reason = hit, "stop"
            holdback = (
                0
                if reason or p.include_stop_str_in_output
                else (max((len(s) for s in p.stop), default=1) - 1)
            )
            visible = max(seq.emitted, len(seq.text) - holdback)
            delta = seq.text[seq.emitted : visible]
            seq.emitted = visible
        if reason is not None:
            self.scheduler.finish(seq, reason)
        return delta

    def _jump_forward(self, seq: Sequence) -> list[tuple[int, str, TokenLogprob | None]]:
        """Append the tokens the sequence's grammar forces next, unsampled (they join its next
        step as one chunk); stops as any token does."""
        assert seq.grammar is not None
        appended: list[tuple[int, str, TokenLogprob | None]] = []
        for token in seq.grammar.forced_tokens():
            appended.append((token, self._append(seq, token), None))
            seq.grammar_forced_tokens += 1
            if seq.is_finished:
                break
        return appended

    def prompt_logprobs_events(
        self,
        plan: StepPlan,
        chunks: list[tuple[Sequence, int, list[TokenLogprob]]],
        step: int,
        time_ns: int,
    ) -> list[RequestEvent]:
        """Add each prompt chunk's logprobs (the chunk's first position p, then those of prompt
        tokens p+1, ...) to its sequence; a PromptLogprobs event for each sequence of the plan
        whose prompt is now complete (once: a recompute after preemption reports nothing)."""
        for seq, first, found in chunks:
            if seq.prompt_logprobs is not None:
                del seq.prompt_logprobs[first + 1 :]  # a recompute writes its chunks again
                seq.prompt_logprobs += found
        events: list[RequestEvent] = []
        for item in plan.scheduled:
            seq = item.seq
            if seq.prompt_logprobs is not None and (
                len(seq.prompt_logprobs) == seq.num_prompt_tokens
            ):
                events.append(
                    PromptLogprobs(seq.request_id, step, time_ns, tuple(seq.prompt_logprobs))
                )
                seq.prompt_logprobs = None
        return events

    def events(self, new_tokens: NewTokens, step: int, time_ns: int) -> list[RequestEvent]:
        """The step's Tokens events, one per token (a speculative step's kept drafts arrive
        together: same step, same time), and Finished for what stopped, stamped `time_ns`; a
        finished sequence leaves `sequences`."""
        events: list[RequestEvent] = []
        for key, appended in new_tokens.items():
            seq = self.sequences[key]
            if seq.sampling.ranks_samples:
                events += self.final.hold(seq, appended, step, time_ns)
                continue
            for token, delta, logprob in appended:
                events.append(
                    Tokens(
                        seq.request_id,
                        step,
                        time_ns,
                        (token,),
                        delta,
                        seq.sample_index,
                        None if logprob is None else (logprob,),
                    )
                )
            if seq.is_finished:
                events.append(self.finished(seq, step, time_ns))
                del self.sequences[key]
        return events

    def finished(self, seq: Sequence, step: int, time_ns: int) -> Finished:
        return Finished(
            seq.request_id,
            step,
            time_ns,
            seq.finish_reason or "abort",
            seq.num_prompt_tokens,
            seq.num_output_tokens,
            seq.cached_prompt_tokens,
            seq.num_preemptions,
            seq.text,
            seq.sample_index,
            self.detokenize_ns.pop(seq.key, 0),
            seq.spec_steps,
            seq.spec_draft_tokens,
            seq.spec_accepted_tokens,
            structured_compile_ns=None if seq.grammar is None else seq.grammar_compile_ns,
            structured_cache_hit=seq.grammar_cache_hit,
            structured_forced_tokens=None if seq.grammar is None else seq.grammar_forced_tokens,
            cached_prompt_tokens_host=seq.tier_prompt_tokens.get("host"),
            cached_prompt_tokens_disk=seq.tier_prompt_tokens.get("disk"),
        )

    def forget(self, seq: Sequence) -> None:
        """A sequence that ends without a Finished event (failed): drop what was kept for it."""
        self.detokenize_ns.pop(seq.key, None)
        self.final.forget(seq)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """Parallel sampling: at the parent's first sampled token, one sequence per extra
        sample, sharing the prompt's KV (copy-on-write where they diverge). A fork the KV
        cache cannot hold now waits and recomputes its prompt instead."""
        children = []
        for index in range(1, parent.pending_forks + 1):
            child = parent.child(index)  # before the parent's first token: the prompt alone
            if parent.grammar is not None:  # before the parent accepts its first token
                child.grammar = parent.grammar.fork()
            if parent.sampling.seed is not None:
                child.generator = seeded_generator(parent.sampling.seed + index, self.device)
            if parent.detok is not None:
                child.detok = self.tokenizer.new_stream(
                    parent.prompt_token_ids, parent.sampling.skip_special_tokens
                )
            self.sequences[child.key] = child
            self.scheduler.fork(parent, child)
            children.append(child)
        parent.pending_forks = 0
        return children


def _find_stop(seq: Sequence) -> str | None:
    """The text truncated at the first stop string, or None when none occurs."""
    p = seq.sampling
    window = max(len(s) for s in p.stop) + 16
    search_from = max(0, seq.emitted - window)
    best = None
    for stop in p.stop:
        index = seq.text.find(stop, search_from)
        if index != -1 and (best is None or index < best[0]):
            best = (index, stop)
    if best is None:
        return None
    index, stop = best
    return seq.text[: index + len(stop)] if p.include_stop_str_in_output else seq.text[:index]
