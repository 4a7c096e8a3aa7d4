"""What a workload produces: requests with the time each should arrive."""

from __future__ import annotations

from dataclasses import dataclass

from engines.base import GenerationRequest


@dataclass
class WorkloadRequest:
    request: GenerationRequest
    arrival_s: float  # offset from the start of the run
    prompt_tokens_requested: int | None = None  # the length the workload aimed for

    @property
    def request_id(self) -> str:
        return self.request.request_id
