"""A vLLM-like offline API over LLMEngine: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field
from typing import Any, TypeGuard, cast

from engines.base import (
    Failed,
    Finished,
    Prompt,
    PromptLogprobs,
    TokenLogprob,
    Tokens,
    is_chat,
    now_ns,
)
from engines.builtin.config import EngineConfig
from engines.builtin.engine import LLMEngine
from engines.builtin.factory import build_engine
from engines.sampling_params import SamplingParams


@dataclass
class RequestMetrics:
    arrival_ns: int
    first_scheduled_step: int | None = None
    first_token_ns: int | None = None
    finished_ns: int | None = None
    token_times_ns: list[int] = field(default_factory=list)
    # speculative decoding, over every sample: steps that verified drafts, drafts, drafts kept
    spec_steps: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @property
    def ttft_s(self) -> float | None:
        if self.first_token_ns is None:
            return None
        return (self.first_token_ns - self.arrival_ns) / 1e9


@dataclass
class CompletionOutput:
    """One sample of a request (a request with SamplingParams.n = k has k of them)."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    # one per token when SamplingParams.logprobs asked for them, else None
    logprobs: list[TokenLogprob] | None = None
    # beam search: the beam's summed log-probabilities (its rank divides them by its
    # length ** length_penalty)
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    """A request's result. `token_ids`, `text` and `finish_reason` are those of sample 0;
    `outputs` holds every sample (vLLM's layout)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: RequestMetrics
    error: str | None = None
    # SamplingParams.prompt_logprobs: one per prompt token, None for the first
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs) or self.error is not None


class LLM:
    """`LLM(model="small", kv_cache="contiguous", dtype="float32", ...)`: any engine option.

    `close()` (or `with LLM(...) as llm:`) releases the engine: its tensor-parallel ranks, the
    draft model, the weights and the KV cache; a second LLM of the same process then starts
    as the first did. An LLM that is dropped instead releases them when it is
    garbage-collected, or when the process exits."""

    def __init__(self, model: str = "tiny", **options: Any) -> None:
        self.engine = build_engine(EngineConfig.from_dict({"model": model, **options}))
        self._ids = itertools.count()

    def close(self) -> None:
        """Release the engine (LLMEngine.close); idempotent. Later calls to generate raise
        EngineClosedError."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """Wrap an engine that is already built (e.g. the one a benchmark just measured)."""
        llm = cls.__new__(cls)
        llm.engine = engine
        llm._ids = itertools.count()
        return llm

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        priority: Seq[int] | None = None,
        lora_request: str | Seq[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids or chat messages); outputs in input order.
        `lora_request`: the adapter (one of engine.lora_modules) for every prompt, or one per
        prompt (None: the base model), as vLLM's argument of that name."""
        self.engine.ensure_open()
        prompt_list: list[Prompt]
        if isinstance(prompts, str) or _is_single_token_list(prompts) or is_chat(prompts):
            prompt_list = [prompts]
        else:  # not one prompt, so a sequence of them
            prompt_list = list(cast(Seq[Prompt], prompts))
        one = sampling_params is None or isinstance(sampling_params, SamplingParams)
        params: list[SamplingParams] = _per_prompt(
            "sampling_params", sampling_params or SamplingParams(), one, len(prompt_list)
        )
        one = lora_request is None or isinstance(lora_request, str)
        if not one and not isinstance(lora_request, list | tuple):
            raise ValueError(
                f"lora_request: {type(lora_request).__name__} is invalid; allowed: an adapter "
                "name, None, or a list of them (one per prompt)"
            )
        adapters: list[str | None] = _per_prompt(
            "lora_request", lora_request, one, len(prompt_list)
        )
        if not all(a is None or isinstance(a, str) for a in adapters):
            raise ValueError("lora_request: allowed: an adapter name or None for each prompt")
        engine = self.engine
        outputs: dict[str, RequestOutput] = {}
        order = []
        try:
            for i, (prompt, p) in enumerate(zip(prompt_list, params, strict=True)):
                request_id = str(next(self._ids))
                # tokenized here, as the engine would: a disaggregated engine keeps no sequences
                token_ids, arrival_ns = engine.tokenize(prompt), now_ns()
                engine.add_request(
                    request_id,
                    token_ids,
                    p,
                    arrival_ns,
                    priority=priority[i] if priority else 0,
                    lora_name=adapters[i],
                )
                samples = [CompletionOutput(i) for i in range(p.n)]
                outputs[request_id] = RequestOutput(
                    request_id, token_ids, samples, RequestMetrics(arrival_ns)
                )
                order.append(request_id)
        except Exception:
            # An invalid prompt rejects the whole call: drop the requests queued before it.
            for request_id in order:
                engine.abort_request(request_id)
            raise
        while engine.has_unfinished_requests():
            for event in engine.step():
                out = outputs.get(event.request_id)
                if out is None:
                    continue
                if isinstance(event, Tokens):
                    sample = out.outputs[event.index]
                    sample.token_ids.extend(event.token_ids)
                    sample.text += event.text
                    if event.logprobs is not None:
                        sample.logprobs = (sample.logprobs or []) + list(event.logprobs)
                    if out.metrics.first_token_ns is None:
                        out.metrics.first_token_ns = event.time_ns
                    if event.index == 0:
                        out.metrics.token_times_ns.append(event.time_ns)
                elif isinstance(event, PromptLogprobs):
                    out.prompt_logprobs = list(event.logprobs)
                elif isinstance(event, Finished):
                    sample = out.outputs[event.index]
                    sample.finish_reason = event.finish_reason
                    sample.text = event.text
                    sample.cumulative_logprob = event.cumulative_logprob
                    out.metrics.finished_ns = event.time_ns
                    out.metrics.spec_steps += event.spec_steps or 0
                    out.metrics.spec_draft_tokens += event.spec_draft_tokens or 0
                    out.metrics.spec_accepted_tokens += event.spec_accepted_tokens or 0
                elif isinstance(event, Failed):
                    out.error = event.error
        return [outputs[r] for r in order]


def _per_prompt(name: str, value: Any, one: bool, count: int) -> list[Any]:
    """`value` for each of `count` prompts: repeated when `one`, else as given, one per
    prompt (ValueError naming `name` otherwise)."""
    if one:
        return [value] * count
    values = list(value)
    if len(values) != count:
        raise ValueError(
            f"{name}: {len(values)} given for {count} prompts; give one, or one per prompt"
        )
    return values


def _is_single_token_list(x: object) -> TypeGuard[list[int]]:
    return isinstance(x, list) and bool(x) and all(isinstance(t, int) for t in x)
