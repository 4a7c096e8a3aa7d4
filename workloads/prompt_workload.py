"""Prompt-set workloads: real prompts (ShareGPT, MT-Bench, one-per-line text), seeded arrivals.

Order: the set's own order (or a seeded shuffle), then the first num_requests requests; when
more are asked for than the set holds it starts over from the top (`passes` in info counts the
rounds), each repeat getting fresh request ids. num_requests counts requests, so an MT-Bench
session is 2 of them (a session cut by the count keeps its first turn only).

Output lengths: a ShareGPT reply following the prompt gives the reference output length (its
token count) when use_reference_output is true; otherwise output_len is sampled.

MT-Bench questions are 2-turn chat sessions: turn 2 `follows` turn 1 and arrives think_time_s
after it finished; the driver prepends turn 1 and its reply. Other formats send raw text
unless chat is true. prompt_tokens_requested is the token count of the user text alone (no
chat template, no history).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from models.tokenizer import Tokenizer
from workloads.arrivals import Arrival, arrival_times, default_arrival, parse_arrival
from workloads.base import DrawnArrivals, WorkloadBase
from workloads.common import (
    check_bool,
    check_choice,
    check_common,
    check_int,
    check_number,
    invalid,
    resolve_path,
    rng_streams,
)
from workloads.lengths import clip_to_context, parse_length
from workloads.prompt_sets import PROMPT_FORMATS, PromptItem, load_prompt_set
from workloads.prompts import tokenizer_or_default
from workloads.request import WorkloadRequest


@dataclass
class PromptsWorkload(WorkloadBase, DrawnArrivals):
    path: str | None = None  # required
    format: str = "sharegpt"
    num_requests: int | None = None  # None: every prompt (every turn) once
    output_len: Any = 256  # length spec, for prompts without a reference output
    use_reference_output: bool = True
    shuffle: bool = False
    chat: bool | None = None  # None: true for mt_bench, false otherwise
    think_time_s: float = 0.0  # multi-turn: pause after a turn finishes
    arrival: dict[str, Any] | None = field(  # arrival spec (workloads/arrivals.py)
        default_factory=default_arrival, metadata={"schema": Arrival}
    )
    id_prefix: str = "prompt"

    @property
    def sends_chat(self) -> bool:
        return self.format == "mt_bench" if self.chat is None else bool(self.chat)

    def validate(self) -> PromptsWorkload:
        if self.path is None or self.path == "???":
            raise invalid("path", self.path, "a prompt file path (required)")
        resolve_path("path", self.path)
        check_choice("format", self.format, PROMPT_FORMATS)
        check_int("num_requests", self.num_requests, 0, allow_none=True)
        parse_length("output_len", self.output_len)
        check_bool("use_reference_output", self.use_reference_output)
        check_bool("shuffle", self.shuffle)
        check_bool("chat", self.chat, allow_none=True)
        if self.format == "mt_bench" and self.chat is False:
            raise invalid(
                "chat",
                self.chat,
                "true or null for format mt_bench (its turns are a chat conversation)",
            )
        check_number("think_time_s", self.think_time_s, 0.0)
        parse_arrival(self.arrival)
        check_common(self)
        return self

    def _plan(self, items: list[PromptItem], n: int) -> list[tuple[int, int, PromptItem]]:
        """(session index, turn, item) per request: items in order, cycling, cut at n."""
        plan: list[tuple[int, int, PromptItem]] = []
        k = 0
        while len(plan) < n:
            item = items[k % len(items)]
            for turn in range(min(len(item.turns), n - len(plan))):
                plan.append((k, turn, item))
            k += 1
        return plan

    def build(
        self, tokenizer: Tokenizer | None = None, context_len: int | None = None
    ) -> list[WorkloadRequest]:
        self.validate()
        tok = tokenizer_or_default(tokenizer)
        path = resolve_path("path", self.path)
        pset = load_prompt_set(path, self.format)
        length_rng, order_rng, arrival_rng = rng_streams(self.seed, 3)
        items = list(pset.items)
        if self.shuffle:
            items = [items[j] for j in order_rng.permutation(len(items))]
        n = self.num_requests
        if n is None:
            n = sum(len(item.turns) for item in items)
        plan = self._plan(items, n)
        sessions = self.format == "mt_bench"  # multi-turn: session ids and follows
        texts = [item.turns[turn] for _, turn, item in plan]
        ids = [tok.encode(text, add_special_tokens=False) for text in texts]
        inputs = np.array([max(1, len(x)) for x in ids], dtype=np.int64)
        outputs = parse_length("output_len", self.output_len).sample(n, length_rng)
        used_reference = 0
        for i, (_, turn, item) in enumerate(plan):
            if self.use_reference_output and item.reference_output and turn == 0:
                outputs[i] = max(
                    1, len(tok.encode(item.reference_output, add_special_tokens=False))
                )
                used_reference += 1
        clipped_inputs, outputs, clip_info = clip_to_context(inputs, outputs, context_len)
        roots = [i for i, (_, turn, _) in enumerate(plan) if turn == 0]
        starts = arrival_times(self.arrival, len(roots), arrival_rng)
        start_of = dict(zip(roots, starts.tolist(), strict=True))
        requests = []
        for i, (k, turn, _) in enumerate(plan):
            text = texts[i]
            if clipped_inputs[i] < inputs[i]:  # too long for the context: keep the head
                text = tok.decode(ids[i][: int(clipped_inputs[i])])
            prompt: Any = [{"role": "user", "content": text}] if self.sends_chat else text
            rid, sid, follows = self._request_ids(i, k, turn, sessions)
            arrival = self.think_time_s if turn else start_of[i]
            requests.append(
                self._request(
                    rid,
                    prompt,
                    int(clipped_inputs[i]),
                    int(outputs[i]),
                    arrival,
                    session_id=sid,
                    turn=turn,
                    follows=follows,
                )
            )
        self.info = {
            "type": "prompts",
            "path": str(path),
            "format": self.format,
            "tokenizer": tok.name,
            "items_read": pset.items_read,
            "items_skipped": dict(pset.skipped),
            "items_usable": len(items),
            "requests": n,
            "sessions": len(roots) if sessions else None,
            "passes": -(-len({k for k, _, _ in plan}) // len(items)) if plan else 0,
            "chat": self.sends_chat,
            "reference_output_lens_used": used_reference,
            "arrival": parse_arrival(self.arrival),
            "concurrency": self.concurrency,
            **self._totals(starts, clipped_inputs, outputs),
            **clip_info,
            **self._cancel(requests),
        }
        return requests
