"""Outputs a request gives all at once, at its end, not token by token: best_of > n (the n
most likely of its samples, known once all have finished) and beam search (its best
hypotheses, known once the search ends). They stream nothing before; then, per output (best
first, index 0..n-1), one Tokens event with every token and its text, and Finished."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from engines.base import Finished, RequestEvent, TokenLogprob, Tokens
from engines.builtin.beam_search import BeamGroup
from engines.builtin.sequence import Sequence
from models.tokenizer import Tokenizer


class FinalOutputs:
    """Shares the output processor's `sequences` (a best_of sample leaves them when it
    finishes), its Finished builder and its detokenize times."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        sequences: dict[str, Sequence],
        finished: Callable[[Sequence, int, int], Finished],
        detokenize_ns: dict[str, int],
    ) -> None:
        self.tokenizer = tokenizer
        self.sequences = sequences
        self.finished = finished
        self.detokenize_ns = detokenize_ns
        # best_of > n: each sample's logprobs (where asked) by key, and the finished samples
        # by request, held until every sample is in and the best n are known
        self._held_logprobs: dict[str, list[TokenLogprob]] = {}
        self._ranked: dict[str, list[tuple[Sequence, list[TokenLogprob] | None]]] = {}

    def beam_events(self, group: BeamGroup, step: int, time_ns: int) -> list[RequestEvent]:
        """A beam search's outputs, all at once: per hypothesis (best first, index 0..n-1) a
        Tokens event with every token and its text, then Finished."""
        events: list[RequestEvent] = []
        sampling, first = group.sampling, group.first
        hypotheses = group.outputs()
        for index, hyp in enumerate(hypotheses):
            text = ""
            if sampling.detokenize:
                text = self.tokenizer.decode(
                    list(hyp.token_ids), skip_special_tokens=sampling.skip_special_tokens
                )
            events.append(Tokens(group.request_id, step, time_ns, hyp.token_ids, text, index))
            events.append(
                Finished(
                    group.request_id,
                    step,
                    time_ns,
                    hyp.finish_reason,
                    first.num_prompt_tokens,
                    len(hyp.token_ids),
                    first.cached_prompt_tokens,
                    first.num_preemptions,
                    text,
                    index,
                    cumulative_logprob=hyp.cumulative_logprob,
                    cached_prompt_tokens_host=first.tier_prompt_tokens.get("host"),
                    cached_prompt_tokens_disk=first.tier_prompt_tokens.get("disk"),
                )
            )
        # none left to return (every candidate masked): the rest end empty
        events += self.empty(first, step, time_ns, "stop")[len(hypotheses) :]
        return events

    def hold(
        self,
        seq: Sequence,
        appended: list[tuple[int, str, TokenLogprob | None]],
        step: int,
        time_ns: int,
    ) -> list[RequestEvent]:
        """A best_of > n sample's new tokens, kept; once its request's every sample has
        finished, the n with the highest summed log-probabilities (best first, index 0..n-1):
        all of each one's tokens in one Tokens event, then Finished."""
        if seq.sampling.logprobs is not None:
            held = self._held_logprobs.setdefault(seq.key, [])
            held += [logprob for _, _, logprob in appended if logprob is not None]
        if not seq.is_finished:
            return []
        del self.sequences[seq.key]
        done = self._ranked.setdefault(seq.request_id, [])
        done.append((seq, self._held_logprobs.pop(seq.key, None)))
        if len(done) < seq.sampling.num_sequences:
            return []
        del self._ranked[seq.request_id]
        done.sort(key=lambda item: (-item[0].cumulative_logprob, item[0].sample_index))
        events: list[RequestEvent] = []
        for index, (sample, logprobs) in enumerate(done[: seq.sampling.n]):
            events.append(
                Tokens(
                    sample.request_id,
                    step,
                    time_ns,
                    tuple(sample.output_token_ids),
                    sample.text,
                    index,
                    None if logprobs is None else tuple(logprobs),
                )
            )
            events.append(
                replace(
                    self.finished(sample, step, time_ns),
                    index=index,
                    cumulative_logprob=sample.cumulative_logprob,
                )
            )
        for sample, _ in done:
            self.detokenize_ns.pop(sample.key, None)
        return events

    def empty(
        self, first: Sequence, step: int, time_ns: int, reason: str = "abort"
    ) -> list[RequestEvent]:
        """A request whose outputs come at the end (best_of > n, beam search) and has none
        to give (aborted, or a search left with none): each of its n outputs finishes with
        `reason`, without tokens; what was held for it goes."""
        self._ranked.pop(first.request_id, None)
        rid = first.request_id
        for key in [k for k in self._held_logprobs if k == rid or k.startswith(rid + "#")]:
            del self._held_logprobs[key]
        return [
            Finished(
                first.request_id,
                step,
                time_ns,
                reason,
                first.num_prompt_tokens,
                0,
                first.cached_prompt_tokens,
                first.num_preemptions,
                "",
                index,
            )
            for index in range(first.sampling.n)
        ]

    def forget(self, seq: Sequence) -> None:
        """A sample that ended without a Finished event (failed): what was held for it goes."""
        self._held_logprobs.pop(seq.key, None)
        self._ranked.pop(seq.request_id, None)
