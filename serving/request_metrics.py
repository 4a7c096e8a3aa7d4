"""One HTTP request's contribution to /metrics, from its engine events as they stream.

The units are vLLM's where vLLM has the metric, except that a prompt with n choices is one
engine request here (vLLM runs n child requests):

- per output: TTFT (the request's arrival at the server to a prompt's first token), ITL
  (between one choice's consecutive outputs), prompt and generation token counters;
- per finished choice: `request_success{finished_reason}`, its output tokens;
- per finished prompt: queue time (the engine took it -> its first step), prefill time (first
  step -> first token), decode time (first token -> its last token over every choice),
  inference time (first step -> last token), its prompt tokens, the most output tokens among
  its choices, n and max_tokens;
- per finished HTTP request: end-to-end latency (arrival -> its last choice finished).

Engine timestamps (`Arrived`, `Scheduled`, `Tokens`, `Finished`) come from the engine's one
clock, as the server's arrival stamp does. A request that fails or is aborted contributes what
it streamed before it ended and no per-finish histogram, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engines.base import Arrived, Failed, Finished, RequestEvent, Scheduled, Tokens
from engines.sampling_params import SamplingParams
from serving.metrics import ServerMetrics


@dataclass
class _Prompt:
    num_prompt_tokens: int
    n: int
    max_tokens: int
    open_choices: int
    queued_ns: int | None = None  # Arrived: the engine took the request
    scheduled_ns: int | None = None  # Scheduled: its first step
    first_token_ns: int | None = None
    last_token_ns: int | None = None  # over every choice
    max_output_tokens: int = 0


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
        self._last_output_ns: dict[tuple[int, int], int] = {}  # (prompt, choice) -> time

    def observe(self, prompt_index: int, event: RequestEvent) -> None:
        metrics, prompt = self.metrics, self.prompts[prompt_index]
        if isinstance(event, Tokens):
            if prompt.first_token_ns is None:
                prompt.first_token_ns = event.time_ns
                metrics.ttft.observe((event.time_ns - self.arrival_ns) / 1e9)
                metrics.prompt_tokens.inc(prompt.num_prompt_tokens)
            prompt.last_token_ns = event.time_ns
            choice = (prompt_index, event.index)
            previous = self._last_output_ns.get(choice)
            if previous is not None:
                metrics.itl.observe((event.time_ns - previous) / 1e9)
            self._last_output_ns[choice] = event.time_ns
            metrics.generation_tokens.inc(len(event.token_ids))
            self.num_tokens += len(event.token_ids)
        elif isinstance(event, Finished):
            self.open_choices -= 1
            prompt.open_choices -= 1
            prompt.max_output_tokens = max(prompt.max_output_tokens, event.num_output_tokens)
            metrics.request_success.inc(finished_reason=event.finish_reason)
            metrics.request_generation_tokens.observe(event.num_output_tokens)
            if prompt.open_choices == 0:
                self._prompt_finished(prompt)
            if self.open_choices == 0:
                metrics.e2e.observe((event.time_ns - self.arrival_ns) / 1e9)
        elif isinstance(event, Arrived):
            prompt.queued_ns = event.time_ns
        elif isinstance(event, Scheduled):
            if prompt.scheduled_ns is None:  # its first step, as vLLM's scheduled_ts
                prompt.scheduled_ns = event.time_ns
        elif isinstance(event, Failed):
            self.open_choices = 0  # the backend has dropped the request

    def _prompt_finished(self, prompt: _Prompt) -> None:
        metrics = self.metrics
        metrics.request_prompt_tokens.observe(prompt.num_prompt_tokens)
        metrics.request_max_num_generation_tokens.observe(prompt.max_output_tokens)
        metrics.request_params_n.observe(prompt.n)
        metrics.request_params_max_tokens.observe(prompt.max_tokens)
        queued, scheduled = prompt.queued_ns, prompt.scheduled_ns
        first, last = prompt.first_token_ns, prompt.last_token_ns
        if queued is None or scheduled is None or first is None or last is None:
            return  # the engine always sends all four before a Finished
        metrics.queue_time.observe((scheduled - queued) / 1e9)
        metrics.prefill_time.observe((first - scheduled) / 1e9)
        metrics.decode_time.observe((last - first) / 1e9)
        metrics.inference_time.observe((last - scheduled) / 1e9)
