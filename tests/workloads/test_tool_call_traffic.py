"""Tool-call conversations as a workload (workload type tool_calls, issue 40): two turns per
conversation, the second following the first with its calls answered by the file's results;
the built-in engine renders, constrains and parses the tools in process as `inferlab serve`
does, and engine=openai sends them to a server and reads its `tool_calls` back, so the two
paths give the same calls for the same greedy tokens. Each turn's calls are judged against the
function's schema; a turn with nothing to answer fails, named; bad values are named."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from omegaconf import OmegaConf
from tiny_server import OPTIONS

import configs
import engines.backends  # noqa: F401  (the engine groups' schemas, for compose)
import workloads
from engines.base import Failed, Finished, GenerationRequest
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.openai.backend import OpenAIBackend
from engines.openai.config import OpenAIConfig
from engines.sampling_params import SamplingParams
from engines.structured_outputs import StructuredOutputsParams
from engines.tool_calls import ToolCallOutput, ToolUse
from harness.running.driver import RequestTrace, conversation
from harness.running.experiment import run_experiment
from serving.testing import RunningServer, serve_engine
from workloads.request import WorkloadRequest
from workloads.tool_conversations import SHIPPED_CONVERSATIONS, load_tool_conversations

pytest.importorskip("jsonschema")
pytest.importorskip("xgrammar")

TINY = {"name": "tiny", "path": None, "tokenizer": None, "overrides": {}}
# the tools' description makes longer prompts than other tiny-server tests'
ENGINE = {**OPTIONS, "max_model_len": 1024, "kv_cache_memory_bytes": 16 << 20}
# one call each: a random model left free to add calls would write them until max_tokens
WORKLOAD = {
    "type": "tool_calls",
    "num_requests": 8,
    "call_output_len": 128,
    "parallel_tool_calls": False,
}


def build(options: dict[str, Any]) -> tuple[list[WorkloadRequest], dict[str, Any]]:
    workload = workloads.from_config(options)
    return workload.build(), workload.info


# ---- the workload -------------------------------------------------------------------------


def test_each_conversation_is_a_call_turn_and_an_answer_turn_that_follows_it() -> None:
    requests, info = build({**WORKLOAD, "num_requests": 28, "think_time_s": 0.5})
    shipped = load_tool_conversations(SHIPPED_CONVERSATIONS)
    assert len(requests) == 28 == info["requests"] and info["sessions"] == 14
    calls, answers = requests[0::2], requests[1::2]
    for k, (call, answer) in enumerate(zip(calls, answers, strict=True)):
        source = shipped[k % len(shipped)]  # the file's order, then over again
        assert call.request_id == f"tool-s{k}-t0" and call.follows is None
        assert call.request.prompt == list(source.messages) and call.tool_results is None
        assert call.request.tools is not None and call.request.tools.mode == "required"
        assert call.request.sampling.ignore_eos is False  # a call ends where its grammar does
        assert answer.follows == call.request_id and answer.arrival_s == 0.5
        assert answer.request.prompt == [] and answer.tool_results == source.results
        assert answer.request.tools is not None and answer.request.tools.mode == "auto"
        assert answer.request.session_id == call.request.session_id == f"tool-s{k}"
    assert sum(info["conversation_names"].values()) == 14
    cut, info = build({**WORKLOAD, "num_requests": 5})  # the third keeps its first turn
    assert [w.request_id for w in cut][-2:] == ["tool-s1-t1", "tool-s2-t0"]
    assert info["sessions"] == 3 and info["requests"] == 5


def test_structured_traffic_constrains_answer_turns_alone() -> None:
    requests, info = build({**WORKLOAD, "structured_fraction": 0.5})
    constrained = [w for w in requests if w.request.sampling.structured_outputs is not None]
    assert len(constrained) == 2 == info["structured_planned"]
    assert all(w.follows is not None for w in constrained)


def test_named_forces_each_conversations_own_function() -> None:
    requests, _ = build({**WORKLOAD, "tool_choice": "named", "answer_tool_choice": "none"})
    shipped = load_tool_conversations(SHIPPED_CONVERSATIONS)
    for k, call in enumerate(requests[0::2]):
        tools = call.request.tools
        assert tools is not None and tools.mode == "named" and tools.named == shipped[k].call
    assert all(a.request.tools.mode == "none" for a in requests[1::2])


def test_the_seed_shuffles_the_same_way_and_the_arrivals_come_from_the_block() -> None:
    options = {**WORKLOAD, "shuffle": True, "arrival": {"process": "poisson", "rate": 4.0}}
    first, _ = build(options)
    again, _ = build(options)
    assert [w.request.prompt for w in first] == [w.request.prompt for w in again]
    starts = [w.arrival_s for w in first[0::2]]
    assert starts == sorted(starts) and starts[-1] > 0


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("tool_choice", "any", "required|auto|named"),
        ("answer_tool_choice", "required", "auto|none"),
        ("num_requests", 0, "an integer >= 1"),
        ("call_output_len", -1, ""),
        ("path", "no/such/file.jsonl", "no file at"),
    ],
)
def test_bad_values_are_named(field: str, value: Any, allowed: str) -> None:
    with pytest.raises((ValueError, FileNotFoundError), match=f"workload.{field}") as info:
        build({**WORKLOAD, field: value})
    assert allowed in str(info.value)


@pytest.mark.parametrize(
    ("row", "named"),
    [
        ({"tools": []}, "tools: expected a non-empty list"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0]: "),
        ({"call": "other"}, "call: 'other' is not among its tools"),
        ({"messages": "hi"}, "messages: expected a non-empty list"),
        ({"results": ["x"]}, "results: expected an object"),
    ],
)
def test_a_bad_conversation_file_is_named_by_line_and_field(
    tmp_path: Path, row: dict[str, Any], named: str
) -> None:
    good = json.loads(Path(SHIPPED_CONVERSATIONS).read_text().splitlines()[0])
    path = tmp_path / "conversations.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, **row}) + "\n")
    with pytest.raises(ValueError, match="line 2: ") as info:
        load_tool_conversations(str(path))
    assert named in str(info.value)


# ---- the driver's follow-up turn ----------------------------------------------------------


def test_the_answer_turn_sends_the_calls_and_one_result_per_call() -> None:
    requests, _ = build(WORKLOAD)
    call, answer = requests[0], requests[1]
    made = (
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "no_such", "arguments": "{}"}},
    )  # fmt: skip
    trace = RequestTrace(call, 0, tool_output=ToolCallOutput(None, made))
    prompt = conversation(trace, answer)
    assert prompt[:-3] == call.request.prompt
    assert prompt[-3] == {"role": "assistant", "content": None, "tool_calls": list(made)}
    assert prompt[-2] == {
        "role": "tool",
        "tool_call_id": "call_1",
        "content": answer.tool_results["get_weather"],
    }
    assert prompt[-1]["tool_call_id"] == "call_2" and "no function named" in prompt[-1]["content"]
    with pytest.raises(ValueError, match="made no tool call"):
        conversation(RequestTrace(call, 0, tool_output=ToolCallOutput("hello", ())), answer)


# ---- the backends -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(ENGINE) as running:
        yield running


@pytest.fixture(scope="module")
def builtin() -> Iterator[BuiltinBackend]:
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **ENGINE}))
    backend.load()
    yield backend
    backend.close()


def finished(backend: Any, request: GenerationRequest) -> Finished | Failed:
    async def collect() -> list[Any]:
        return [event async for event in backend.generate(request)]

    return asyncio.run(collect())[-1]


def calls_of(event: Finished | Failed) -> list[tuple[str, str]]:
    assert isinstance(event, Finished) and event.tool_output is not None, event
    return [(c["function"]["name"], c["function"]["arguments"]) for c in event.tool_output.calls]


@pytest.mark.parametrize("choice", ["required", "named"])
def test_the_engine_in_process_and_through_the_server_make_the_same_calls(
    server: RunningServer, builtin: BuiltinBackend, choice: str
) -> None:
    """Greedy decoding under the tool choice's grammar: the built-in backend's calls, parsed
    in process, equal those `inferlab serve` returns to engine=openai; both valid."""
    config = OpenAIConfig.from_config({"base_url": f"{server.base_url}/v1", "api": "chat"}, TINY)
    client = OpenAIBackend(config, TINY)
    client.load()
    requests, _ = build({**WORKLOAD, "tool_choice": choice, "temperature": 0.0})
    for item in requests[0::2]:
        ours, theirs = finished(builtin, item.request), finished(client, item.request)
        assert calls_of(ours) == calls_of(theirs) and calls_of(ours)
        tools = item.request.tools
        assert tools is not None and tools.calls_valid(ours.tool_output.calls)  # type: ignore[union-attr]
        assert isinstance(theirs, Finished) and theirs.num_output_tokens == ours.num_output_tokens


def test_a_request_with_tools_needs_a_chat_prompt_and_one_constraint(
    builtin: BuiltinBackend,
) -> None:
    tools = ToolUse.of([{"type": "function", "function": {"name": "f"}}], "required", None)
    failed = finished(builtin, GenerationRequest("text", "hello", tools=tools))
    assert isinstance(failed, Failed) and "tools: a request with tools needs a chat prompt" in (
        failed.error
    )
    guided = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="a+"))
    failed = finished(
        builtin,
        GenerationRequest("two", [{"role": "user", "content": "hi"}], guided, tools=tools),
    )
    assert isinstance(failed, Failed) and "tool_choice already constrains" in failed.error


# ---- whole runs ---------------------------------------------------------------------------


def run(tmp_path: Path, name: str, *overrides: str) -> tuple[pd.DataFrame, dict[str, Any]]:
    options = [
        "model=tiny",
        "workload=tool_calls",
        "workload.num_requests=8",
        "workload.call_output_len=128",
        "workload.parallel_tool_calls=false",
        "workload.answer_output_len=8",
        "run.warmup_requests=0",
        "run.progress=false",
        *overrides,
    ]
    config = OmegaConf.to_container(configs.compose(options), resolve=True)
    assert isinstance(config, dict)
    summary = run_experiment(config, tmp_path / name, progress=False)
    return pd.read_parquet(tmp_path / name / "requests.parquet"), summary


def test_a_run_in_process_and_one_through_the_server_judge_the_same_calls(
    server: RunningServer, tmp_path: Path
) -> None:
    engine = [f"engine.{key}={value}" for key, value in ENGINE.items()]
    rows = {}
    for name, overrides in (
        ("builtin", engine),
        ("openai", ["engine=openai", "engine.api=chat", f"engine.base_url={server.base_url}/v1"]),
    ):
        requests, summary = run(tmp_path, name, *overrides)
        assert summary["status"] == "complete", summary.get("error")
        assert (requests["status"] == "ok").all(), requests["error"].tolist()
        metrics = summary["metrics"]
        assert metrics["tool_call_requests"] == 8 and metrics["tool_call_validity"] == 1.0
        rows[name] = requests.set_index("request_id").sort_index()
    ours, theirs = rows["builtin"], rows["openai"]
    calls = ours[ours["turn"] == 0]
    assert (calls["tool_calls"] >= 1).all() and calls["tool_calls_valid"].all()
    assert (calls["tool_choice"] == "required").all()
    # the answer turn's prompt holds the call turn's prompt, its calls and their results
    answers = ours[ours["turn"] == 1]
    for sid, answer in answers.iterrows():
        call = ours.loc[str(sid).replace("-t1", "-t0")]
        assert answer["prompt_tokens"] > call["prompt_tokens"] + call["output_tokens"]
    columns = ["tool_choice", "tool_calls", "tool_calls_valid", "prompt_tokens"]
    assert ours[columns].equals(theirs[columns])  # the same calls, the same histories


def test_an_answer_turn_after_no_call_fails_naming_why(tmp_path: Path) -> None:
    """tool_choice=auto leaves the (random) model free: it writes no call, so its answer turn
    has nothing to answer and is recorded as failed, saying so; the call turns are ok and
    unjudged."""
    requests, summary = run(tmp_path, "auto", "workload.tool_choice=auto")
    calls = requests[requests["turn"] == 0]
    assert (calls["status"] == "ok").all() and (calls["tool_calls"] == 0).all()
    assert calls["tool_calls_valid"].isna().all()
    answers = requests[requests["turn"] == 1]
    assert (answers["status"] == "failed").all()
    assert answers["error"].str.contains("made no tool call").all()
    assert summary["metrics"]["tool_call_validity"] is None
