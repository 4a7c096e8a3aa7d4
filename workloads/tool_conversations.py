"""Tool-call conversations: the agent loop as traffic. Each conversation is a session of two
turns: the user's question with the functions offered (turn 0, answered with tool calls), then
the calls' results sent back as tool messages (turn 1, answered in prose), as an application
built on OpenAI's tools API runs it.

The conversations come from a JSONL file (the shipped data/structured/tool_conversations.jsonl,
written for this project, CC0; docs/structured_output.md, Tool-call traffic), one per line:

    {"name": ..., "tools": [OpenAI tool objects], "messages": [the chat so far],
     "call": the function the question asks for, "results": {function name: its result}}

The driver sends turn 1 `think_time_s` after turn 0 finished (the time the tool took), with
turn 0's messages, its answer and its calls, and a tool message per call holding the result
the file gives for that function. A turn 0 that made no call leaves nothing to answer: its
turn 1 is recorded as failed, saying so. Each turn's calls are judged in requests.parquet
(`tool_calls_valid`: every call names an offered function and its arguments satisfy that
function's schema). `structured_fraction` draws from the answer turns alone (a call turn's
constraint is its tool choice's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engines.base import GenerationRequest
from engines.tool_calls import ToolUse
from models.tokenizer import Tokenizer
from workloads.arrivals import Arrival, arrival_times, default_arrival, parse_arrival
from workloads.base import DrawnArrivals, WorkloadBase
from workloads.common import (
    check_bool,
    check_choice,
    check_common,
    check_int,
    check_number,
    make_sampling,
    resolve_path,
    rng_streams,
)
from workloads.lengths import parse_length
from workloads.prompts import tokenizer_or_default
from workloads.request import WorkloadRequest
from workloads.trace_files import read_text

SHIPPED_CONVERSATIONS = "data/structured/tool_conversations.jsonl"
#: turn 0's tool choice: `named` forces each conversation's own `call`
CALL_CHOICES = ("required", "auto", "named")
#: turn 1's: `auto` offers the tools again (the model may call once more), `none` asks for prose
ANSWER_CHOICES = ("auto", "none")


@dataclass(frozen=True)
class ToolConversation:
    name: str
    tools: tuple[dict[str, Any], ...]  # OpenAI tool objects, checked by ToolUse.of
    messages: tuple[dict[str, Any], ...]
    call: str  # the function the question asks for
    results: dict[str, str]  # function name -> the result a call of it returns


@dataclass
class ToolCallsWorkload(WorkloadBase, DrawnArrivals):
    path: str = SHIPPED_CONVERSATIONS
    # requests, two per conversation (a conversation cut by the count keeps its first turn);
    # None: each conversation in the file once
    num_requests: int | None = None
    shuffle: bool = False
    tool_choice: str = "required"  # turn 0: required | auto | named
    answer_tool_choice: str = "auto"  # turn 1: auto | none
    parallel_tool_calls: bool = True
    call_output_len: Any = 192  # turn 0's max_tokens (a length spec)
    answer_output_len: Any = 64  # turn 1's
    think_time_s: float = 0.0  # the tool's time: between turn 0's end and turn 1
    arrival: dict[str, Any] | None = field(  # when conversations start (workloads/arrivals.py)
        default_factory=default_arrival, metadata={"schema": Arrival}
    )
    # a call ends where its grammar does: the answer stops at EOS, not at max_tokens
    ignore_eos: bool = False
    id_prefix: str = "tool"

    def validate(self) -> ToolCallsWorkload:
        resolve_path("path", self.path)
        check_int("num_requests", self.num_requests, 1, allow_none=True)
        check_bool("shuffle", self.shuffle)
        check_choice("tool_choice", self.tool_choice, CALL_CHOICES)
        check_choice("answer_tool_choice", self.answer_tool_choice, ANSWER_CHOICES)
        check_bool("parallel_tool_calls", self.parallel_tool_calls)
        parse_length("call_output_len", self.call_output_len)
        parse_length("answer_output_len", self.answer_output_len)
        check_number("think_time_s", self.think_time_s, 0.0)
        parse_arrival(self.arrival)
        check_common(self)
        return self

    def build(
        self, tokenizer: Tokenizer | None = None, context_len: int | None = None
    ) -> list[WorkloadRequest]:
        """Two requests per conversation: turn 0 (`<id_prefix>-s<k>-t0`) and the turn 1 that
        follows it, cut at num_requests. `context_len` is not used to cut prompts: a
        conversation too long for the model fails its requests, named by the engine."""
        self.validate()
        tok = tokenizer_or_default(tokenizer)
        path = resolve_path("path", self.path)
        conversations = load_tool_conversations(str(path))
        length_rng, order_rng, arrival_rng = rng_streams(self.seed, 3)
        order = (
            order_rng.permutation(len(conversations))
            if self.shuffle
            else np.arange(len(conversations))
        )
        wanted = 2 * len(conversations) if self.num_requests is None else self.num_requests
        count = -(-wanted // 2)  # conversations begun
        chosen = [conversations[int(order[k % len(order)])] for k in range(count)]
        calls = parse_length("call_output_len", self.call_output_len).sample(count, length_rng)
        answers = parse_length("answer_output_len", self.answer_output_len).sample(
            count, length_rng
        )
        starts = arrival_times(self.arrival, count, arrival_rng)
        requests: list[WorkloadRequest] = []
        # each conversation's tools and prompt length, once (a run may repeat it many times)
        uses = {
            id(c): (self._tool_use(c, self.tool_choice), self._tool_use(c, self.answer_tool_choice))
            for c in conversations
        }
        asked_of = {
            id(c): sum(len(tok.encode(str(m.get("content") or ""))) for m in c.messages)
            for c in conversations
        }
        for k, conversation in enumerate(chosen):
            call_tools, answer_tools = uses[id(conversation)]
            messages = [dict(m) for m in conversation.messages]
            asked = asked_of[id(conversation)]
            session = f"{self.id_prefix}-s{k}"
            first = self._turn(f"{session}-t0", messages, call_tools, int(calls[k]), session, 0)
            requests.append(WorkloadRequest(first, float(starts[k]), asked))
            second = self._turn(f"{session}-t1", [], answer_tools, int(answers[k]), session, 1)
            requests.append(
                WorkloadRequest(
                    second,
                    self.think_time_s,
                    None,
                    follows=first.request_id,
                    tool_results=dict(conversation.results),
                )
            )
        requests = requests[:wanted]
        self.info = {
            "type": "tool_calls",
            "path": str(path),
            "conversations_read": len(conversations),
            "requests": len(requests),
            "sessions": count,
            "tool_choice": self.tool_choice,
            "answer_tool_choice": self.answer_tool_choice,
            "tokenizer": tok.name,
            "arrival": parse_arrival(self.arrival),
            "concurrency": self.concurrency,
            "conversation_names": dict(
                sorted((n, [c.name for c in chosen].count(n)) for n in {c.name for c in chosen})
            ),
            **self._totals(
                starts,
                np.array([r.prompt_tokens_requested for r in requests if r.follows is None]),
                np.array([r.request.sampling.max_tokens for r in requests]),
            ),
            # structured traffic on the answer turns alone: a call turn's tool choice is its
            # constraint
            **self._cancel(requests, [r for r in requests if r.follows is not None]),
        }
        return requests

    def _tool_use(self, conversation: ToolConversation, choice: str) -> ToolUse:
        named = {"type": "function", "function": {"name": conversation.call}}
        tools = ToolUse.of(
            conversation.tools, named if choice == "named" else choice, self.parallel_tool_calls
        )
        assert tools is not None  # a conversation offers at least one tool (loaded so)
        return tools

    def _turn(
        self,
        request_id: str,
        messages: list[dict[str, Any]],
        tools: ToolUse,
        max_tokens: int,
        session: str,
        turn: int,
    ) -> GenerationRequest:
        sampling = make_sampling(max_tokens, self.temperature, self.ignore_eos, self.sampling)
        return GenerationRequest(
            request_id, messages, sampling, session_id=session, turn=turn, tools=tools
        )


def load_tool_conversations(path: str) -> list[ToolConversation]:
    """The conversations of a JSONL file; ValueError naming the line and the field."""
    conversations = []
    for number, line in enumerate(read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}: line {number}"
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected a JSON object")
        conversations.append(_conversation(row, where))
    if not conversations:
        raise ValueError(f"{path}: no conversations (expected one JSON object per line)")
    return conversations


def _conversation(row: dict[str, Any], where: str) -> ToolConversation:
    tools = row.get("tools")
    if not isinstance(tools, list) or not tools:
        raise ValueError(f"{where}: tools: expected a non-empty list of OpenAI tool objects")
    try:
        checked = ToolUse.of(tools, "auto", True)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    assert checked is not None
    names = [f.name for f in checked.tools]
    messages = row.get("messages")
    if (
        not isinstance(messages, list)
        or not messages
        or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
    ):
        raise ValueError(f"{where}: messages: expected a non-empty list of chat messages")
    call = row.get("call")
    if call not in names:
        raise ValueError(f"{where}: call: {call!r} is not among its tools; allowed: {names}")
    results = row.get("results")
    if not isinstance(results, dict) or not all(isinstance(k, str) for k in results):
        raise ValueError(f"{where}: results: expected an object of function name -> result")
    return ToolConversation(
        name=str(row.get("name") or where),
        tools=tuple(tools),
        messages=tuple(messages),
        call=call,
        results={
            name: value if isinstance(value, str) else json.dumps(value)
            for name, value in results.items()
        },
    )
