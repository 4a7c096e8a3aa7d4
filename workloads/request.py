"""What a workload produces: requests with the time each should arrive."""

from __future__ import annotations

from dataclasses import dataclass

from engines.base import GenerationRequest
from engines.structured_outputs import StructuredOutputsParams


@dataclass
class WorkloadRequest:
    request: GenerationRequest
    arrival_s: float  # offset from the start of the run (for a follow-up turn: think time)
    prompt_tokens_requested: int | None = None  # the length the workload aimed for
    #: Multi-turn sessions: the request id of the previous turn. The driver sends this request
    #: `arrival_s` seconds after that turn finished, with the conversation so far prepended:
    #: for chat messages, the previous turn's messages plus its reply as an assistant message;
    #: for token ids, the previous prompt and output ids; for text, previous prompt + output.
    follows: str | None = None
    #: Seconds after it is sent at which the driver closes the request's stream (the workload's
    #: `cancel_fraction` / `cancel_after_s`); None: never. One that finishes first is simply ok.
    cancel_after_s: float | None = None
    #: Structured traffic left unenforced (workload.structured_enforce=false): the constraint
    #: the request runs without, its output judged against it (the validity a grammar buys)
    expected_format: StructuredOutputsParams | None = None
    #: A turn that answers the previous turn's tool calls (workload type tool_calls): the
    #: result each function returns, by name. The driver sends the previous answer with its
    #: calls and then one tool message per call before this turn's own messages.
    tool_results: dict[str, str] | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id
