"""One HTTP request's contribution to /metrics, from its engine events as they stream.

The units are vLLM's (v1). vLLM runs a prompt with n choices as n child requests
(vllm/v1/engine/parallel_sampling.py) and records each child's stats as a whole request's
(vllm/v1/engine/output_processor.py, vllm/v1/metrics/stats.py), so its request series count
sequences (prompt x choice). Here a prompt with n choices is one engine request, and each of
its choices is counted as vLLM counts a child:

- per sequence, at its first token: TTFT (the HTTP request's arrival at the server -> that
  choice's first token);
- per output: ITL (between one choice's consecutive outputs), the generation token counter;
- per finished sequence (`stop`, `length`): `request_success{finished_reason}`, end-to-end
  latency (arrival -> that choice finished), queue time (the engine took the prompt -> its first
  step), prefill time (first step -> the choice's first token), decode time (its first token ->
  its last), inference time (first step -> its last token), its prompt tokens, output tokens
  and max_tokens;
- per finished prompt (vLLM's parent request): n and the most output tokens among its choices;
- per prompt, at its first token: the prompt token counter. This one differs from vLLM, which
  adds the prompt once per child: here the choices share one prefill, and the counter says
  how many prompt tokens were prefilled.

So for any n, success and E2E always agree, and TTFT equals them plus the sequences that were
aborted or failed after their first token (vLLM records TTFT at that token too, and records
nothing at finish for an aborted child). Engine timestamps (`Arrived`, `Scheduled`, `Tokens`,
`Finished`) come from the engine's one clock, as the server's arrival stamp does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engines.base import Arrived, Failed, Finished, RequestEvent, Scheduled, Tokens
from engines.sampling_params import SamplingParams
from serving.metrics import ServerMetrics


@dataclass
class _Choice:
    """One sequence: a prompt's choice, counted as vLLM counts a child request."""

    first_token_ns: int | None = None
    last_token_ns: int | None = None


@dataclass
class _Prompt:
    num_prompt_tokens: int
    n: int
    max_tokens: int
    open_choices: int
    queued_ns: int | None = None  # Arrived: the engine took the request
    scheduled_ns: int | None = None  # Scheduled: its first step
    prefilled: bool = False  # its first token came: its prompt tokens are counted
    max_output_tokens: int = 0
    choices: dict[int, _Choice] = field(default_factory=dict)


class RequestObserver:
    def __init__(
        self,
        metrics: ServerMetrics,
        prompts: Sequence[list[int]],
        sampling: Sequence[SamplingParams],
        arrival_ns: int,
    ) -> None:
        self.metrics = metrics
        self.arrival_ns = arrival_ns
        self.prompts = [
            _Prompt(len(ids), params.n, params.max_tokens, params.n)
            for ids, params in zip(prompts, sampling, strict=True)
        ]
        self.open_choices = sum(p.n for p in self.prompts)  # 0 once finished or failed
        self.num_tokens = 0  # output tokens streamed

    def observe(self, prompt_index: int, event: RequestEvent) -> None:
        prompt = self.prompts[prompt_index]
        if isinstance(event, Tokens):
            self._tokens(prompt, event)
        elif isinstance(event, Finished):
            self._finished(prompt, event)
        elif isinstance(event, Arrived):
            prompt.queued_ns = event.time_ns
        elif isinstance(event, Scheduled):
            if prompt.scheduled_ns is None:  # its first step, as vLLM's scheduled_ts
                prompt.scheduled_ns = event.time_ns
        elif isinstance(event, Failed):
            self.open_choices = 0  # the backend has dropped the request

    def _tokens(self, prompt: _Prompt, event: Tokens) -> None:
        metrics = self.metrics
        if not prompt.prefilled:
            prompt.prefilled = True
            metrics.prompt_tokens.inc(prompt.num_prompt_tokens)
        choice = prompt.choices.setdefault(event.index, _Choice())
        if choice.first_token_ns is None:
            choice.first_token_ns = event.time_ns
            metrics.ttft.observe((event.time_ns - self.arrival_ns) / 1e9)
        else:
            assert choice.last_token_ns is not None
            metrics.itl.observe((event.time_ns - choice.last_token_ns) / 1e9)
        choice.last_token_ns = event.time_ns
        metrics.generation_tokens.inc(len(event.token_ids))
        self.num_tokens += len(event.token_ids)

    def _finished(self, prompt: _Prompt, event: Finished) -> None:
        self.open_choices -= 1
        prompt.open_choices -= 1
        prompt.max_output_tokens = max(prompt.max_output_tokens, event.num_output_tokens)
        self._sequence_finished(prompt, event)
        if prompt.open_choices == 0:
            self.metrics.request_max_num_generation_tokens.observe(prompt.max_output_tokens)
            self.metrics.request_params_n.observe(prompt.n)

    def _sequence_finished(self, prompt: _Prompt, event: Finished) -> None:
        """What vLLM records when a child request finishes, for this choice."""
        metrics = self.metrics
        metrics.request_success.inc(finished_reason=event.finish_reason)
        metrics.e2e.observe((event.time_ns - self.arrival_ns) / 1e9)
        metrics.request_prompt_tokens.observe(prompt.num_prompt_tokens)
        metrics.request_generation_tokens.observe(event.num_output_tokens)
        metrics.request_params_max_tokens.observe(prompt.max_tokens)
        choice = prompt.choices.get(event.index, _Choice())
        queued, scheduled = prompt.queued_ns, prompt.scheduled_ns
        first, last = choice.first_token_ns, choice.last_token_ns
        if queued is None or scheduled is None or first is None or last is None:
            return  # the engine always sends all four before a Finished
        metrics.queue_time.observe((scheduled - queued) / 1e9)
        metrics.prefill_time.observe((first - scheduled) / 1e9)
        metrics.decode_time.observe((last - first) / 1e9)
        metrics.inference_time.observe((last - scheduled) / 1e9)
