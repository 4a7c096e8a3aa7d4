"""What every workload type shares: the config keys for request ids and sampling, the `info`
that build() fills, and the steps of build() that do not depend on where the lengths come from
(a request's ids in a multi-turn session, the request itself, the totals in `info`).

The arrival block (workloads/arrivals.py) is shared by the types that draw arrivals
(synthetic, prompts); a trace brings its own timestamps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.base import Prompt
from workloads.arrivals import concurrency_of, max_concurrency_of
from workloads.common import length_totals, make_request, plan_cancellation, span_info
from workloads.lora import plan_lora
from workloads.request import WorkloadRequest
from workloads.structured import plan_structured


@dataclass
class WorkloadBase:
    """The config keys every workload type has (a subclass sets its own id_prefix default).
    Being a base, they come first among a type's fields (`inferlab run --cfg job`)."""

    seed: int = 0
    ignore_eos: bool = True  # benchmarks want exact output lengths
    temperature: float = 0.0
    id_prefix: str = "req"
    sampling: dict[str, Any] = field(default_factory=dict)  # extra SamplingParams fields
    # Cancellation (AIPerf's --request-cancellation-rate/-delay): exactly
    # round(cancel_fraction * n) requests, drawn with the seed, are cancelled by the driver
    # cancel_after_s seconds after each is sent (workloads/common.py: plan_cancellation)
    cancel_fraction: float = 0.0
    cancel_after_s: float | None = None
    # Structured traffic (vLLM's --structured-output-ratio): exactly
    # round(structured_fraction * n) requests, drawn with the seed, carry a constraint drawn
    # from the shipped ones of structured_kinds (workloads/structured.py)
    structured_fraction: float = 0.0
    structured_kinds: list[str] = field(default_factory=lambda: ["json"])
    # false: those requests run free, their outputs judged against the constraint they would
    # have had (the validity the grammar buys, measured side by side)
    structured_enforce: bool = True
    # LoRA traffic (vLLM's --lora-assignment): round(lora_fraction * sessions) of them, drawn
    # with the seed, run under an adapter of lora_adapters, assigned round_robin, random or
    # zipf (weight 1 / k**lora_zipf_exponent for the k-th); workloads/lora.py
    lora_adapters: list[str] = field(default_factory=list)
    lora_assignment: str = "round_robin"
    lora_fraction: float = 1.0
    lora_zipf_exponent: float = 1.0

    def __post_init__(self) -> None:
        self.info: dict[str, Any] = {}  # filled by build(); not a config key

    def _request_ids(
        self, index: int, session: int, turn: int, in_sessions: bool
    ) -> tuple[str, str | None, str | None]:
        """(request id, session id, the id of the turn it follows) of request `index`; turn
        `turn` of session `session` when the workload has sessions."""
        if not in_sessions:
            return f"{self.id_prefix}-{index}", None, None
        session_id = f"{self.id_prefix}-s{session}"
        follows = f"{session_id}-t{turn - 1}" if turn else None
        return f"{session_id}-t{turn}", session_id, follows

    def _request(
        self,
        request_id: str,
        prompt: Prompt,
        prompt_tokens: int,
        output_len: int,
        arrival_s: float,
        **where: Any,
    ) -> WorkloadRequest:
        """One request with this workload's sampling settings (`where`: prefix_group,
        session_id, turn, follows)."""
        return make_request(self, request_id, prompt, prompt_tokens, output_len, arrival_s, **where)

    def _cancel(
        self,
        requests: list[WorkloadRequest],
        constrainable: list[WorkloadRequest] | None = None,
    ) -> dict[str, Any]:
        """Mark the requests the workload cancels, those it constrains (drawn from
        `constrainable`, default all) and the adapters they run under (in place); `info`'s
        keys about them."""
        return {
            **plan_cancellation(requests, self.cancel_fraction, self.cancel_after_s, self.seed),
            **plan_structured(
                requests if constrainable is None else constrainable,
                self.structured_fraction,
                list(self.structured_kinds),
                self.seed,
                self.structured_enforce,
            ),
            **plan_lora(
                requests,
                list(self.lora_adapters),
                self.lora_assignment,
                self.lora_fraction,
                self.lora_zipf_exponent,
                self.seed,
            ),
        }

    @staticmethod
    def _totals(arrivals: np.ndarray, inputs: np.ndarray, outputs: np.ndarray) -> dict[str, Any]:
        """`info`'s arrival span, offered rate and length totals."""
        return {**span_info(arrivals), **length_totals(inputs, outputs)}


class DrawnArrivals:
    """The closed loop's numbers of a type with an `arrival` key."""

    arrival: dict[str, Any] | None

    @property
    def concurrency(self) -> int | None:
        return concurrency_of(self.arrival)

    @property
    def max_concurrency(self) -> int | None:
        return max_concurrency_of(self.arrival)
