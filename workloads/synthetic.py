"""Synthetic workloads: N requests with seeded lengths, arrivals, shared prefixes and sessions.

Prompts are random token ids (exact lengths; non-special ids only) or text: windows of a
corpus file's tokens decoded back to text (the engine re-tokenizes, so actual lengths may
differ slightly and are recorded beside the request).

shared_prefix {num_groups: G, prefix_len: P}: request (or session) i joins group i mod G; its
prompt is the group's P-token prefix followed by input_len - P tokens of its own, so input_len
is the whole prompt and P <= input_len is required (distributions that can draw less than P
are raised to P, counted as `raised_to_prefix_len`).

sessions {num_turns: T, think_time_s: x}: num_requests counts all requests, taken T at a time
as sessions (the last may be shorter). Turn 0 arrives by the arrival process; turn k > 0
`follows` turn k-1, arrives x seconds after it finished, and its prompt is only the new user
part (input_len tokens): the driver prepends the conversation so far. With both options, the
group prefix opens each session's turn 0 and later turns inherit it through the history.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.tokenizer import Tokenizer
from workloads.arrivals import Arrival, arrival_times, default_arrival, parse_arrival
from workloads.base import DrawnArrivals, WorkloadBase
from workloads.common import (
    check_choice,
    check_common,
    check_int,
    check_keys,
    check_mapping,
    check_number,
    invalid,
    resolve_path,
    rng_streams,
)
from workloads.lengths import clip_to_context, parse_length
from workloads.prompts import PROMPT_KINDS, TokenSource, tokenizer_or_default
from workloads.request import WorkloadRequest


@dataclass
class SyntheticWorkload(WorkloadBase, DrawnArrivals):
    num_requests: int = 16
    input_len: Any = 128  # length spec (workloads/lengths.py)
    output_len: Any = 64
    prompt: str = "random_ids"
    corpus: str | None = None  # text file for prompt=text; default: the shipped sonnets
    id_prefix: str = "req"
    arrival: dict[str, Any] | None = field(  # arrival spec (workloads/arrivals.py)
        default_factory=default_arrival, metadata={"schema": Arrival}
    )
    shared_prefix: dict[str, Any] | None = None  # {num_groups, prefix_len}
    sessions: dict[str, Any] | None = None  # {num_turns, think_time_s}

    def validate(self) -> SyntheticWorkload:
        check_int("num_requests", self.num_requests, 0)
        check_choice("prompt", self.prompt, PROMPT_KINDS)
        input_spec = parse_length("input_len", self.input_len)
        parse_length("output_len", self.output_len)
        check_common(self)
        parse_arrival(self.arrival)
        if self.corpus is not None:
            resolve_path("corpus", self.corpus)
        if self.shared_prefix is not None:
            _, prefix_len = self._prefix()
            if input_spec.kind in ("fixed", "uniform") and prefix_len > input_spec.low:
                raise invalid(
                    "shared_prefix.prefix_len",
                    prefix_len,
                    f"an integer in [1, {input_spec.low}] (input_len includes the "
                    "prefix, so prefix_len <= the smallest input_len)",
                )
        if self.sessions is not None:
            self._sessions()
        return self

    def _prefix(self) -> tuple[int, int]:
        spec = check_mapping(
            "shared_prefix", self.shared_prefix, "null or {num_groups: G, prefix_len: P}"
        )
        check_keys("shared_prefix", spec, ("num_groups", "prefix_len"), "shared_prefix")
        groups = check_int("shared_prefix.num_groups", spec.get("num_groups"), 1)
        prefix_len = check_int("shared_prefix.prefix_len", spec.get("prefix_len"), 1)
        assert groups is not None and prefix_len is not None
        return groups, prefix_len

    def _sessions(self) -> tuple[int, float]:
        spec = check_mapping("sessions", self.sessions, "null or {num_turns: T, think_time_s: x}")
        check_keys("sessions", spec, ("num_turns", "think_time_s"), "sessions")
        turns = check_int("sessions.num_turns", spec.get("num_turns"), 1)
        think = check_number("sessions.think_time_s", spec.get("think_time_s", 0.0), 0.0)
        assert turns is not None and think is not None
        return turns, think

    def build(
        self, tokenizer: Tokenizer | None = None, context_len: int | None = None
    ) -> list[WorkloadRequest]:
        self.validate()
        tok = tokenizer_or_default(tokenizer)
        length_rng, prompt_rng, arrival_rng = rng_streams(self.seed, 3)
        n = self.num_requests
        turns, think = self._sessions() if self.sessions is not None else (1, 0.0)
        num_sessions = math.ceil(n / turns)
        inputs = parse_length("input_len", self.input_len).sample(n, length_rng)
        outputs = parse_length("output_len", self.output_len).sample(n, length_rng)
        groups, prefix_len = self._prefix() if self.shared_prefix is not None else (0, 0)
        is_first = np.arange(n) % turns == 0
        raise_mask = is_first & (inputs < prefix_len)
        inputs[raise_mask] = prefix_len
        inputs, outputs, clip_info = clip_to_context(inputs, outputs, context_len)
        starts = arrival_times(self.arrival, num_sessions, arrival_rng)
        source = TokenSource(
            tok,
            self.prompt,
            resolve_path("corpus", self.corpus) if self.corpus is not None else None,
        )
        prefixes = [source.tokens(prefix_len, prompt_rng) for _ in range(groups)]
        requests = []
        for i in range(n):
            session, turn = divmod(i, turns)
            group = f"{self.id_prefix}-g{session % groups}" if groups else None
            own = int(inputs[i])
            if groups and turn == 0:
                # Clipping to the context may cut into the prefix; keep what fits.
                head = prefixes[session % groups][:own]
                ids = np.concatenate([head, source.tokens(own - len(head), prompt_rng)])
            else:
                ids = source.tokens(own, prompt_rng)
            rid, sid, follows = self._request_ids(i, session, turn, self.sessions is not None)
            arrival = think if turn else starts[session]
            requests.append(
                self._request(
                    rid,
                    source.render(ids),
                    own,
                    int(outputs[i]),
                    arrival,
                    prefix_group=group,
                    session_id=sid,
                    turn=turn,
                    follows=follows,
                )
            )
        self.info = {
            "type": "synthetic",
            "requests": n,
            "sessions": num_sessions if self.sessions else None,
            "prompt": self.prompt,
            "tokenizer": tok.name,
            "arrival": parse_arrival(self.arrival),
            "concurrency": self.concurrency,
            **self._totals(starts, inputs, outputs),
            "prefix_groups": groups or None,
            "raised_to_prefix_len": int(raise_mask.sum()),
            **clip_info,
            **self._cancel(requests),
        }
        return requests
