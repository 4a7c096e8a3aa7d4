"""Beam search over the engine's sequences, as Hugging Face's `generate(num_beams=k)` defines
it (transformers 5: `GenerationMixin._beam_search`), `length_penalty` and `early_stopping`
included.

A request with `SamplingParams.use_beam_search` is a group of at most `beam_width` live beams,
each an ordinary `Sequence` that the scheduler runs beside any other request. Where a sequence
would sample, a beam yields candidates instead (`beam_candidates`, in the model runner): the
top `beams_to_keep` tokens of its log-softmax, after min_tokens' masks, penalties, bias and
token masks (applied to the log-probabilities, in HF's order). Once every live beam of the
group has its candidates, the group advances in one move, as HF's loop does:

    candidates of all beams, scored by the beam's sum + the token's log-probability
    -> the best `beams_to_keep` -> those that stop (a stop id, or the length limit) and rank
    among the first `beam_width` become finished hypotheses (score / length ** penalty)
    -> the best `beam_width` that do not stop are the next live beams

A beam chosen once continues in its own sequence; chosen twice or more, it is forked: the
child starts from the parent's KV (paged: the parent's blocks shared, reference counts raised,
the partly filled last block copied on the child's first write; contiguous: a copy of the
parent's region). A beam chosen by nothing is pruned and its KV freed. The search ends when
no finished hypothesis could still be beaten (HF's heuristic), when `beam_width` have finished
under `early_stopping=True`, or when no beam can continue; the `n` best hypotheses are the
request's outputs, all at once (a beam's tokens are not final until the search ends).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engines.builtin.sampler import Sampler, SamplingBatch
from engines.builtin.scheduler import Scheduler
from engines.builtin.sequence import Sequence
from engines.sampling_params import SamplingParams

#: HF's starting score of an empty slot of finished hypotheses (a score nothing real reaches)
_NO_SCORE = -1.0e9


def stop_ids(sampling: SamplingParams, eos_ids: list[int]) -> set[int]:
    """The token ids that end a beam: EOS (unless ignore_eos) and the stop ids."""
    return set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_ids))


def beams_to_keep(sampling: SamplingParams, eos_ids: list[int]) -> int:
    """Candidates kept per step: enough that `beam_width` survive even if every stop id is
    among the best (HF: max(2, 1 + number of EOS ids) * num_beams)."""
    return max(2, 1 + len(stop_ids(sampling, eos_ids))) * sampling.num_beams


def penalized(total: float, length: int, length_penalty: float) -> float:
    """HF's hypothesis score, total / length ** length_penalty, where a large penalty's power
    overflows to inf (the score to 0, or to -inf for a negative penalty) instead of raising."""
    try:
        factor = float(length) ** length_penalty
    except OverflowError:
        factor = math.inf
    if factor == 0.0:
        return -math.inf if total < 0 else math.inf if total > 0 else 0.0
    return total / factor


def beam_candidates(
    logits: torch.Tensor, seqs: list[Sequence], sampler: Sampler, eos_ids: list[int]
) -> list[tuple[list[int], list[float]]]:
    """logits [B, V] of beams -> per beam, its best tokens and their log-probabilities (best
    first). HF's order: log-softmax of the raw logits, then the logits processors (here
    min_tokens' masks, penalties, logit_bias and token masks) on the log-probabilities."""
    logprobs = logits.float().log_softmax(dim=-1)
    batch = SamplingBatch.from_sequences(seqs, eos_ids, logits.device)
    logprobs = sampler.masked(logprobs, batch)
    keep = min(max(beams_to_keep(s.sampling, eos_ids) for s in seqs), logprobs.shape[-1])
    values, ids = logprobs.topk(keep, dim=-1)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its output tokens and how it ranks."""

    token_ids: tuple[int, ...]
    cumulative_logprob: float
    score: float  # cumulative_logprob / len(token_ids) ** length_penalty
    finish_reason: str  # "stop" | "length"


@dataclass(eq=False)
class BeamGroup:
    """One beam-search request: its live beams and finished hypotheses."""

    request_id: str
    sampling: SamplingParams
    max_output_tokens: int  # max_tokens, or less where max_model_len ends the beams first
    first: Sequence  # the request's first beam (its prompt, its prefix-cache hit)
    live: list[Sequence]
    cumulative: dict[int, float]  # seq_id -> the beam's summed log-probabilities
    candidates: dict[int, tuple[list[int], list[float]]] = field(default_factory=dict)
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied
    next_index: int = 1  # sample_index of the next fork (beams' keys stay unique)
    num_forks: int = 0
    num_pruned: int = 0

    @property
    def width(self) -> int:
        return self.sampling.num_beams

    def outputs(self) -> list[Hypothesis]:
        """The `n` best hypotheses, best first."""
        return self.finished[: self.sampling.n]


class BeamSearch:
    """The engine's beam groups. Shares the engine's `sequences` (forks are added, pruned
    beams removed) and asks the scheduler to fork, free and run beams."""

    def __init__(
        self,
        scheduler: Scheduler,
        sequences: dict[str, Sequence],
        eos_ids: list[int],
        max_model_len: int,
    ) -> None:
        self.scheduler = scheduler
        self.sequences = sequences
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.groups: dict[str, BeamGroup] = {}

    def add(self, seq: Sequence) -> None:
        """A new beam-search request: one beam, its prompt; the first step forks it."""
        room = self.max_model_len - seq.num_prompt_tokens
        self.groups[seq.request_id] = BeamGroup(
            seq.request_id,
            seq.sampling,
            min(seq.sampling.max_tokens, room),
            seq,
            [seq],
            {seq.seq_id: 0.0},
        )

    def report(
        self, candidates: list[tuple[Sequence, tuple[list[int], list[float]]]]
    ) -> list[BeamGroup]:
        """Record the step's candidates; advance every group whose live beams all have theirs.
        Returns the groups whose search ended (their beams are gone from the scheduler)."""
        touched: dict[str, BeamGroup] = {}
        for seq, found in candidates:
            group = self.groups.get(seq.request_id)
            if group is None or seq not in group.live:
                continue  # aborted meanwhile
            group.candidates[seq.seq_id] = found
            seq.awaits_group = True
            touched[group.request_id] = group
        ended = []
        for group in touched.values():
            if len(group.candidates) == len(group.live) and self._advance(group):
                ended.append(self.groups.pop(group.request_id))
        return ended

    def drop(self, request_id: str, reason: str) -> BeamGroup | None:
        """End a group before its search does (an abort or a failure): its beams finish with
        `reason` and leave the engine."""
        group = self.groups.pop(request_id, None)
        if group is not None:
            for beam in group.live:
                self._remove(beam, reason)
        return group

    # ---- one move of the search -------------------------------------------------------------

    def _advance(self, group: BeamGroup) -> bool:
        """HF's step c-g for one group; True when its search has ended."""
        sampling = group.sampling
        ends = stop_ids(sampling, self.eos_ids)
        length = group.live[0].num_output_tokens + 1  # every live beam has the same length
        ranked = []
        for position, beam in enumerate(group.live):
            ids, logprobs = group.candidates.pop(beam.seq_id)
            base = group.cumulative[beam.seq_id]
            ranked += [
                (base + lp, position, token, beam)
                for token, lp in zip(ids, logprobs, strict=True)
                if lp != float("-inf")
            ]
        # HF's topk over [beam, token] flattened; ties go to the earlier beam, the lower id
        ranked.sort(key=lambda c: (-c[0], c[1], c[2]))
        ranked = ranked[: beams_to_keep(sampling, self.eos_ids)]
        at_limit = length >= group.max_output_tokens
        full = sampling.early_stopping is True and len(group.finished) == group.width
        new: list[Hypothesis] = []
        chosen: list[tuple[Sequence, int, float]] = []
        for rank, (total, _, token, beam) in enumerate(ranked):
            if token in ends or at_limit:
                if rank < group.width and group.improvable and not full:
                    reason = "stop" if token in ends else "length"
                    tokens = (*beam.output_token_ids, token)
                    score = penalized(total, length, sampling.length_penalty)
                    new.append(Hypothesis(tokens, total, score, reason))
            elif len(chosen) < group.width:
                chosen.append((beam, token, total))
        if new:
            merged = sorted(group.finished + new, key=lambda h: -h.score)
            group.finished = merged[: group.width]
        if chosen:
            group.improvable = group.improvable and self._could_improve(group, chosen[0][2], length)
        done = (
            not chosen
            or not group.improvable
            or (sampling.early_stopping is True and len(group.finished) == group.width)
        )
        if done:
            # A search the heuristic ends before n hypotheses finished (a score that saturated
            # at -inf) returns its best live beams too: the request gets its n outputs
            for beam, token, total in chosen[: sampling.n - len(group.finished)]:
                tokens = (*beam.output_token_ids, token)
                score = penalized(total, length, sampling.length_penalty)
                group.finished.append(Hypothesis(tokens, total, score, "stop"))
            for beam in group.live:
                self._remove(beam, "pruned")
            group.live = []
            return True
        self._continue(group, chosen)
        return False

    def _could_improve(self, group: BeamGroup, best_total: float, length: int) -> bool:
        """HF's early-stop heuristic: could the best live beam still beat the worst finished
        hypothesis (once there are `beam_width` of them)?"""
        sampling = group.sampling
        if sampling.early_stopping == "never" and sampling.length_penalty > 0.0:
            best_length = group.max_output_tokens  # a positive penalty favours the longest
        else:
            best_length = length
        best_possible = penalized(best_total, best_length, sampling.length_penalty)
        if len(group.finished) < group.width:
            return best_possible > _NO_SCORE
        return best_possible > min(h.score for h in group.finished)

    def _continue(self, group: BeamGroup, chosen: list[tuple[Sequence, int, float]]) -> None:
        """Prune the beams nothing chose, fork those chosen more than once, append each new
        beam's token; the new beams, best first, are the group's live beams."""
        parents = {beam.seq_id for beam, _, _ in chosen}
        for beam in group.live:
            if beam.seq_id not in parents:
                self._remove(beam, "pruned")
                group.cumulative.pop(beam.seq_id)
                group.num_pruned += 1
        used: set[int] = set()
        placed: list[tuple[Sequence, int, float]] = []
        for beam, token, total in chosen:
            if beam.seq_id in used:
                child = self._fork(group, beam)
                placed.append((child, token, total))
            else:
                used.add(beam.seq_id)
                placed.append((beam, token, total))
        # tokens last: a fork copies its parent's tokens as they were before this move
        for seq, token, total in placed:
            seq.awaits_group = False
            seq.token_ids.append(token)
            group.cumulative[seq.seq_id] = total
        group.live = [seq for seq, _, _ in placed]

    def _fork(self, group: BeamGroup, parent: Sequence) -> Sequence:
        child = parent.child(group.next_index)
        group.next_index += 1
        group.num_forks += 1
        child.num_preemptions = parent.num_preemptions
        self.sequences[child.key] = child
        self.scheduler.fork(parent, child)
        return child

    def _remove(self, beam: Sequence, reason: str) -> None:
        """A beam leaves: its KV memory back to the cache, out of the engine's sequences."""
        if not beam.is_finished:
            self.scheduler.finish(beam, reason)
        self.sequences.pop(beam.key, None)
