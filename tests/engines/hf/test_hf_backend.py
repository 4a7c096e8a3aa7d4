"""engine=hf: transformers on the very same weights gives the built-in engine's greedy tokens,
through the same Backend interface, in both sub-modes; static batches count their padding."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
import torch

from engines.base import ConfigError, Failed, Finished, GenerationRequest, StepRecord, Tokens
from engines.builtin import LLM
from engines.hf.backend import HFBackend
from engines.sampling_params import SamplingParams
from engines.tool_calls import ToolUse
from harness.running.experiment import run_experiment

PROMPTS = [list(range(5, 12)), list(range(40, 52)), [7, 8, 9]]
MAX_TOKENS = [5, 6, 7]


def drive(backend: HFBackend, requests: list[GenerationRequest]) -> list[list]:
    async def one(request: GenerationRequest) -> list:
        return [event async for event in backend.generate(request)]

    async def main() -> list[list]:
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def greedy_requests(prompts=PROMPTS) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS[i], temperature=0.0, ignore_eos=True)
        )
        for i, p in enumerate(prompts)
    ]


def builtin_tokens(model: str, prompts=PROMPTS) -> list[list[int]]:
    llm = LLM(model)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def tokens_of(events: list) -> list[int]:
    return [t for e in events if isinstance(e, Tokens) for t in e.token_ids]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    return builtin_tokens("tiny")


@pytest.mark.parametrize("mode", ["generate", "generate_batch"])
def test_same_weights_same_greedy_tokens(mode: str, reference: list[list[int]]) -> None:
    backend = HFBackend.from_config({"model": "tiny", "mode": mode, "max_num_seqs": 4})
    backend.load()
    try:
        results = drive(backend, greedy_requests())
    finally:
        backend.close()
    assert [tokens_of(events) for events in results] == reference
    for events, n in zip(results, MAX_TOKENS, strict=True):
        final = events[-1]
        assert isinstance(final, Finished) and final.finish_reason == "length"
        assert final.num_output_tokens == n
        times = [e.time_ns for e in events if isinstance(e, Tokens)]
        assert times == sorted(times) and len(times) == n


def test_static_batches_report_steps_and_padding() -> None:
    backend = HFBackend.from_config({"model": "tiny", "mode": "generate", "max_num_seqs": 4})
    backend.load()
    steps: list[StepRecord] = []
    backend.step_observers.append(steps.append)
    try:
        drive(backend, greedy_requests())
    finally:
        backend.close()
    # one batch of three runs max(MAX_TOKENS) steps; the first is the padded prefill
    assert len(steps) == max(MAX_TOKENS)
    prefill = steps[0]
    lengths = [len(p) for p in PROMPTS]
    assert prefill.prefill_tokens == sum(lengths)
    assert prefill.padding_tokens == 3 * max(lengths) - sum(lengths)
    # rows past their own max_tokens still compute: static batching's padding
    assert [s.decode_tokens for s in steps[1:]] == [3, 3, 3, 3, 2, 1][: len(steps) - 1]
    assert [s.padding_tokens for s in steps[1:]] == [0, 0, 0, 0, 1, 2][: len(steps) - 1]


def test_checkpoint_folder_matches_builtin(tmp_path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    backend = HFBackend.from_config({"model": str(tmp_path), "mode": "generate"})
    backend.load()
    try:
        got = [tokens_of(events) for events in drive(backend, greedy_requests())]
    finally:
        backend.close()
    assert got == builtin_tokens(str(tmp_path))


def test_bad_options_name_the_field() -> None:
    with pytest.raises(
        ConfigError,
        match=r"engine.mode: 'beam' is invalid; allowed: "
        r"generate\|generate_batch",
    ):
        HFBackend.from_config({"mode": "beam"})
    with pytest.raises(ConfigError, match=r"unknown option\(s\) \['kv_cache'\]"):
        HFBackend.from_config({"kv_cache": "paged"})
    # wrong types name the field too (they used to be TypeErrors or slip through)
    for options, message in [
        (
            {"max_model_len": "abc"},
            "engine.max_model_len: 'abc' is invalid; allowed: null or an integer >= 2",
        ),
        ({"num_threads": 1.5}, "engine.num_threads: 1.5 is invalid"),
        ({"max_num_seqs": True}, "engine.max_num_seqs: True is invalid"),
        ({"seed": "0"}, "engine.seed: '0' is invalid; allowed: an integer"),
        ({"device": "tpu"}, "engine.device: 'tpu' is invalid; allowed: auto|cpu|cuda"),
    ]:
        with pytest.raises(ConfigError) as info:
            HFBackend.from_config(options)
        assert message in str(info.value)


def test_unsupported_request_fails_alone() -> None:
    backend = HFBackend.from_config(
        {"model": "tiny", "mode": "generate_batch", "max_model_len": 64}
    )
    backend.load()
    sampled = GenerationRequest("sampled", [5, 6, 7], SamplingParams(max_tokens=4, temperature=0.8))
    too_long = GenerationRequest(
        "long", list(range(5, 70)), SamplingParams(max_tokens=4, temperature=0.0)
    )
    tools = ToolUse.of([{"type": "function", "function": {"name": "f"}}], "auto", None)
    with_tools = GenerationRequest(
        "tools",
        [{"role": "user", "content": "hi"}],
        SamplingParams(max_tokens=4, temperature=0.0),
        tools=tools,
    )
    try:
        sampled_events, long_events, tool_events, *good = drive(
            backend, [sampled, too_long, with_tools, *greedy_requests()]
        )
    finally:
        backend.close()
    assert isinstance(tool_events[-1], Failed)
    assert "tools: engine=hf does not offer the model tools" in tool_events[-1].error
    assert isinstance(sampled_events[-1], Failed)
    assert "engine.mode=generate_batch runs greedy decoding only" in sampled_events[-1].error
    assert isinstance(long_events[-1], Failed) and "max_model_len=64" in long_events[-1].error
    assert all(isinstance(events[-1], Finished) for events in good)


@pytest.mark.slow
def test_generate_batch_starts_its_thread_with_the_first_request() -> None:
    """Not at load: the harness probes the CPU right after load, and torch work on the main
    thread ran at about half speed while transformers' generation thread was alive."""
    before = set(threading.enumerate())
    backend = HFBackend.from_config({"model": "tiny", "mode": "generate_batch"})
    backend.load()
    try:
        assert set(threading.enumerate()) == before
        events = drive(backend, greedy_requests()[:1])[0]
        assert isinstance(events[-1], Finished)
        assert set(threading.enumerate()) - before  # the manager runs from then on
    finally:
        backend.close()
    assert set(threading.enumerate()) == before


def test_harness_run_through_hf(tmp_path: Path) -> None:
    config = {
        "engine": {"backend": "hf", "mode": "generate", "max_num_seqs": 4, "dtype": "float32"},
        "model": {"name": "tiny"},
        "workload": {
            "type": "synthetic",
            "num_requests": 6,
            "input_len": [8, 16],
            "output_len": 6,
            "ignore_eos": True,
            "temperature": 0.0,
        },
        "run": {"warmup_requests": 1},
    }
    summary = run_experiment(config, tmp_path, progress=False)
    assert summary["status"] == "complete", summary.get("error")
    metrics = summary["metrics"]
    assert metrics["num_completed"] == 6 and metrics["output_tokens_total"] == 36
    assert metrics["padding_tokens_total"] > 0  # two static batches of mixed prompt lengths
    assert summary["engine"]["backend"] == "hf" and summary["engine"]["mode"] == "generate"
