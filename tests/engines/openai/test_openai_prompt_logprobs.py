"""engine=openai: SamplingParams.prompt_logprobs through completions' `echo` with `logprobs`, as
lm-eval's local-completions asks (issue 39). Against scripted answers: the request body, the
legacy logprobs object read into the built-in engine's PromptLogprobs event (ids as sent or as
the server returned them, ranks where the top-k decides them), the echoed text taken off the
output, and a server that ignores echo or a chat API named. Against `inferlab serve` (model=tiny,
in a thread): run.accuracy's every choice's loglikelihood equal to the built-in engine's within
1e-4, and a generation task's answers equal to it, through a whole `inferlab run`."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from omegaconf import OmegaConf
from tiny_server import OPTIONS

import configs
import engines.backends  # noqa: F401  (the engine groups' schemas, for compose)
from engines.base import Failed, Finished, GenerationRequest, PromptLogprobs, Tokens
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.openai.backend import OpenAIBackend
from engines.openai.config import OpenAIConfig
from engines.sampling_params import SamplingParams
from harness.measuring.accuracy import AccuracyTracker
from harness.running.experiment import run_experiment
from serving.testing import RunningServer, serve_engine

TINY = {"name": "tiny", "path": None, "tokenizer": None, "overrides": {}}
TOLERANCE = 1e-4


# ---- scripted answers ---------------------------------------------------------------------


def sse(*payloads: dict[str, Any]) -> bytes:
    return b"".join(f"data: {json.dumps(p)}\n\n".encode() for p in payloads) + b"data: [DONE]\n\n"


def scripted_backend(reply: bytes, bodies: list[dict[str, Any]], **options: Any) -> OpenAIBackend:
    async def handle(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(await request.aread()))
        return httpx.Response(200, content=reply, headers={"content-type": "text/event-stream"})

    config = OpenAIConfig.from_config(
        {"base_url": "http://scripted/v1", "check_server": False, **options}, TINY
    )
    backend = OpenAIBackend(config, TINY, transport=httpx.MockTransport(handle))
    backend.load()
    return backend


def events_of(backend: OpenAIBackend, request: GenerationRequest) -> list[Any]:
    async def collect() -> list[Any]:
        return [event async for event in backend.generate(request)]

    return asyncio.run(collect())


# A text prompt of three tokens, echoed with logprobs=2 as vLLM writes it: the first chunk holds
# the echo and the first generated token, the prompt's ids (return_token_ids), each position's
# own token first in top_logprobs (k + 1 entries where it is not among the k most likely).
ECHOED = sse(
    {
        "choices": [
            {
                "index": 0,
                "text": "Hi there you",
                "token_ids": [9],
                "prompt_token_ids": [4, 5, 6],
                "logprobs": {
                    "tokens": ["Hi", " there", " you"],
                    "token_logprobs": [None, -0.5, -3.0],
                    "top_logprobs": [
                        None,
                        {" there": -0.5, " here": -1.5},  # the most likely: rank 1
                        {" you": -3.0, " me": -0.2, " us": -1.0},  # not among the 2: rank 0
                        {" you": -0.7, ",": -0.9},
                    ],
                    "text_offset": [0, 2, 8],
                },
                "finish_reason": None,
            }
        ]
    },
    {"choices": [{"index": 0, "text": "!", "token_ids": [10], "finish_reason": "length"}]},
    {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}},
)


def test_a_prompt_logprobs_request_is_lm_evals_echo_and_reads_back_as_the_engines_event() -> None:
    bodies: list[dict[str, Any]] = []
    backend = scripted_backend(ECHOED, bodies)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2)
    events = events_of(backend, GenerationRequest("r", "Hi there", params))
    assert bodies[0]["echo"] is True and bodies[0]["logprobs"] == 2
    assert bodies[0]["prompt"] == "Hi there" and bodies[0]["max_tokens"] == 2
    kinds = [type(e) for e in events]
    assert kinds.index(PromptLogprobs) < kinds.index(Tokens)
    scored = next(e for e in events if isinstance(e, PromptLogprobs)).logprobs
    assert scored[0] is None and len(scored) == 3
    second, third = scored[1], scored[2]
    assert second is not None and third is not None
    assert (second.token_id, second.logprob, second.rank) == (5, -0.5, 1)
    assert second.top == ((-1, -0.5), (-1, -1.5))  # the ids of the top-k: unknown
    assert (third.token_id, third.logprob, third.rank) == (6, -3.0, 0)  # outside the k
    assert third.top == ((-1, -0.2), (-1, -1.0))
    finished = events[-1]
    assert isinstance(finished, Finished) and finished.text == " you!"  # the echo taken off
    assert [e.text for e in events if isinstance(e, Tokens)] == [" you", "!"]


def test_a_server_that_does_not_echo_fails_the_request_naming_echo() -> None:
    reply = sse(
        {"choices": [{"index": 0, "text": " you", "finish_reason": "length"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}},
    )
    backend = scripted_backend(reply, [])
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    events = events_of(backend, GenerationRequest("r", [4, 5, 6], params))
    assert isinstance(events[-1], Failed)
    assert "echo and logprobs=0: the server returned no log-probabilities for the 3-token" in (
        events[-1].error
    )


def test_chat_has_no_echo_and_says_so() -> None:
    backend = scripted_backend(b"", [], api="chat")
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    events = events_of(backend, GenerationRequest("r", "Hi", params))
    assert isinstance(events[-1], Failed)
    assert "SamplingParams.prompt_logprobs: engine.api=chat cannot return" in events[-1].error
    assert "allowed: engine.api=completions" in events[-1].error


# ---- against inferlab serve ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[RunningServer]:
    with serve_engine(OPTIONS) as running:
        yield running


@pytest.fixture(scope="module")
def builtin_results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The built-in engine in process, configured as the server is: inferlab_mc, and
    inferlab_gen with and without the chat template."""
    backend = BuiltinBackend(EngineConfig.from_dict({"model": "tiny", **OPTIONS}))
    backend.load()
    out = {}
    try:
        for key, task, chat in [
            ("mc", "inferlab_mc", False),
            ("gen", "inferlab_gen", False),
            ("chat", "inferlab_gen", True),
        ]:
            tracker = AccuracyTracker(task, None, chat)
            tracker.stop(backend, {})
            out[key] = tracker.results(Path(), None)["accuracy"]
    finally:
        backend.close()
    return out


def openai_backend(server: RunningServer, **options: Any) -> OpenAIBackend:
    config = OpenAIConfig.from_config({"base_url": f"{server.base_url}/v1", **options}, TINY)
    backend = OpenAIBackend(config, TINY)
    backend.load()
    return backend


def test_run_accuracy_through_the_server_equals_the_engine_in_process(
    server: RunningServer, builtin_results: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """`inferlab run engine=openai run.accuracy.task=inferlab_mc` against `inferlab serve`:
    every choice's loglikelihood (token ids sent as given, echo with logprobs) within 1e-4 of
    the built-in engine's in process, so the same choices and the same accuracy."""
    overrides = [
        "engine=openai",
        "model=tiny",
        f"engine.base_url={server.base_url}/v1",
        "run.accuracy.task=inferlab_mc",
        "workload.num_requests=2",
        "workload.input_len=8",
        "workload.output_len=4",
        "run.warmup_requests=0",
        "run.progress=false",
    ]
    config = OmegaConf.to_container(configs.compose(overrides), resolve=True)
    assert isinstance(config, dict)
    summary = run_experiment(config, tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary.get("error")
    reference = builtin_results["mc"]
    ours = summary["accuracy"]["loglikelihoods"]
    assert len(ours) == 16
    for mine, theirs in zip(ours, reference["loglikelihoods"], strict=True):
        assert mine == pytest.approx(theirs, abs=TOLERANCE)
        assert mine.index(max(mine)) == theirs.index(max(theirs))
    assert summary["metrics"]["accuracy"] == reference["metrics"]["accuracy"]
    # the client's own figures are the measured requests' alone, not the 64 scoring ones
    assert summary["engine"]["client"]["requests_finished"] == 2


@pytest.mark.parametrize("api", ["completions", "chat"])
def test_a_generation_task_through_the_server_answers_as_the_engine(
    server: RunningServer, builtin_results: dict[str, dict[str, Any]], api: str
) -> None:
    """inferlab_gen through completions (the text prompt, tokenized by the server) and, with
    apply_chat_template, through chat completions (the server applies the template): every
    answer and every filtered answer equal the built-in engine's in process."""
    chat = api == "chat"
    backend = openai_backend(server, api=api)
    tracker = AccuracyTracker("inferlab_gen", None, chat)
    try:
        tracker.stop(backend, {})
    finally:
        backend.close()
    ours = tracker.results(Path(), None)["accuracy"]
    reference = builtin_results["chat" if chat else "gen"]
    assert ours["responses"] == reference["responses"]
    assert ours["filters"] == reference["filters"]
    assert ours["metrics"] == reference["metrics"]
