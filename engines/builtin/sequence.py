"""A request inside the engine: its tokens, how many are in the KV cache, and its state."""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from engines.base import TokenLogprob
from engines.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engines.builtin.structured.backend import Matcher
    from models.tokenizer import DetokenizerStream

_ids = itertools.count()


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_ns: int
    priority: int = 0
    #: the LoRA adapter the request runs under (engine.lora_modules); None: the base model
    lora_name: str | None = None
    #: what its cached K/V depend on besides its tokens (the adapter as loaded: LoRAManager.
    #: namespace), so that no other namespace reuses them; None: the base model
    kv_namespace: str | None = None
    seq_id: int = field(default_factory=lambda: next(_ids))
    token_ids: list[int] = field(init=False)
    #: Tokens whose K/V are in the cache (prompt and output alike). The scheduler gives each
    #: step `num_tokens - num_computed_tokens` new tokens, or a chunk of them.
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    first_scheduled_step: int | None = None
    num_preemptions: int = 0
    cached_prompt_tokens: int = 0
    #: prompt tokens loaded back from each KV tier (tiers.py), over every admission (a request
    #: preempted and readmitted loads again): {"host": n, "disk": m}; empty without tiers
    tier_prompt_tokens: dict[str, int] = field(default_factory=dict)
    #: Disaggregation (engines/builtin/disaggregation): a prefill instance's request hands its
    #: prompt's K/V over once computed (`export_kv`); a decode instance's carries them in
    #: (`remote_kv`: the first len(prompt) - 1 tokens' K/V, a row per block, loaded instead of
    #: computed at every admission, kept until the sequence ends) and counts the tokens loaded
    export_kv: bool = False
    remote_kv: torch.Tensor | None = None
    remote_prompt_tokens: int = 0
    #: SamplingParams.prompt_logprobs: the prompt tokens' so far (None for the first), chunk by
    #: chunk; None once reported (a recompute after preemption does not report them again)
    prompt_logprobs: list[TokenLogprob | None] | None = field(default=None)
    #: Speculative decoding: steps that verified drafts, drafts proposed, drafts kept.
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    generator: torch.Generator | None = None  # per-request RNG when sampling.seed is set
    #: SamplingParams.bad_words tokenized (engines/builtin/penalties.py bad_words_token_ids)
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    #: Parallel sampling (n > 1): which of the request's samples this is, and how many more
    #: samples its first sampling step still has to draw (each becomes a forked sequence).
    sample_index: int = 0
    pending_forks: int = 0
    #: SamplingParams.structured_outputs: the sequence's place in its grammar
    grammar: Matcher | None = None
    grammar_compile_ns: int = 0  # the compile time its request paid (0: a cache hit)
    grammar_cache_hit: bool | None = None
    grammar_forced_tokens: int = 0  # appended by jump-forward decoding, never sampled
    #: best_of > n: the raw log-probabilities of the sample's tokens, summed (its rank)
    cumulative_logprob: float = 0.0
    #: Beam search: the beam's candidates are in, and it has nothing to compute until its
    #: group moves (a preempted one waits out of the queue's way)
    awaits_group: bool = False
    # Detokenized output: `text` is everything decoded, `emitted` how much was streamed out
    # (text is held back while it could still be the start of a stop string).
    text: str = ""
    emitted: int = 0
    detok: DetokenizerStream | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_token_ids)
        if self.sampling.prompt_logprobs is not None:
            self.prompt_logprobs = [None]

    def child(self, sample_index: int) -> Sequence:
        """A new sample of this request beside this one (parallel sampling, a forked beam):
        its tokens so far, its scheduling history, its bad words; the request's prompt
        logprobs are reported once, by the first sequence, so none here."""
        child = Sequence(
            self.request_id,
            self.prompt_token_ids,
            self.sampling,
            self.arrival_ns,
            self.priority,
            self.lora_name,
            self.kv_namespace,
            sample_index=sample_index,
        )
        child.token_ids = list(self.token_ids)
        child.first_scheduled_step = self.first_scheduled_step
        child.cached_prompt_tokens = self.cached_prompt_tokens
        child.tier_prompt_tokens = dict(self.tier_prompt_tokens)
        child.remote_prompt_tokens = self.remote_prompt_tokens
        child.prompt_logprobs = None
        child.bad_words_token_ids = self.bad_words_token_ids
        return child

    @property
    def key(self) -> str:
        """Unique within the engine: the request id, plus the sample index for n > 1."""
        if self.sample_index == 0:
            return self.request_id
        return f"{self.request_id}#{self.sample_index}"

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def in_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens
