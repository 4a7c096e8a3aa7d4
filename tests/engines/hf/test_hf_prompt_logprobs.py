"""engine=hf: SamplingParams.prompt_logprobs gives the built-in engine's PromptLogprobs event, in
both sub-modes: each prompt token's log-probability, rank and top-k equal the engine's within
1e-4 (fp32) on a random Llama checkpoint the test writes, before the request's first token; a
request that does not ask gets none; so run.accuracy's multiple-choice tasks score on it as on the
built-in engine."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from checkpoints import random_hf_llama

from engines.base import (
    Finished,
    GenerationRequest,
    PromptLogprobs,
    RequestEvent,
    TokenLogprob,
    Tokens,
)
from engines.builtin import LLM
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.hf.backend import HFBackend
from engines.sampling_params import SamplingParams
from harness.measuring.accuracy import AccuracyTracker

pytest.importorskip("transformers")

VOCAB = 256
TOP = 3
TOLERANCE = 1e-4
PROMPTS = [[5, 17, 9, 200, 33, 41, 7], [12, 80], [90, 91, 92, 93, 94, 95, 96, 97, 98, 99, 100]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hf_prompt_logprobs")
    random_hf_llama(path, VOCAB, seed=5)
    return path


@pytest.fixture(scope="module")
def builtin(folder: Path) -> list[list[TokenLogprob | None]]:
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    with LLM(model=str(folder), dtype="float32", max_model_len=64) as llm:
        outs = llm.generate(PROMPTS, params)
    found = [out.prompt_logprobs for out in outs]
    assert all(f is not None for f in found)
    return [list(f) for f in found if f is not None]


def drive(backend: HFBackend, requests: list[GenerationRequest]) -> list[list[RequestEvent]]:
    async def one(request: GenerationRequest) -> list[RequestEvent]:
        return [event async for event in backend.generate(request)]

    async def main() -> list[list[RequestEvent]]:
        return await asyncio.gather(*(one(r) for r in requests))

    return asyncio.run(main())


@pytest.mark.parametrize("mode", ["generate", "generate_batch"])
def test_prompt_logprobs_equal_the_builtin_engines(
    folder: Path, builtin: list[list[TokenLogprob | None]], mode: str
) -> None:
    backend = HFBackend.from_config(
        {"model": str(folder), "dtype": "float32", "device": "cpu", "mode": mode}
    )
    backend.load()
    asked = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP)
    requests = [GenerationRequest(f"r{i}", p, asked) for i, p in enumerate(PROMPTS)]
    requests.append(GenerationRequest("plain", PROMPTS[0], SamplingParams(max_tokens=2)))
    try:
        results = drive(backend, requests)
    finally:
        backend.close()
    for events, prompt, reference in zip(results, PROMPTS, builtin, strict=False):
        kinds = [type(e) for e in events]
        assert kinds.count(PromptLogprobs) == 1 and isinstance(events[-1], Finished)
        assert kinds.index(PromptLogprobs) < kinds.index(Tokens)  # before the first token
        found = next(e for e in events if isinstance(e, PromptLogprobs)).logprobs
        assert len(found) == len(prompt) and found[0] is None and reference[0] is None
        for mine, theirs, token in zip(found[1:], reference[1:], prompt[1:], strict=True):
            assert mine is not None and theirs is not None
            assert mine.token_id == theirs.token_id == token
            assert mine.logprob == pytest.approx(theirs.logprob, abs=TOLERANCE)
            assert mine.rank == theirs.rank  # random weights: no near-ties at this size
            assert [t for t, _ in mine.top] == [t for t, _ in theirs.top]
            assert [v for _, v in mine.top] == pytest.approx(
                [v for _, v in theirs.top], abs=TOLERANCE
            )
    assert not any(isinstance(e, PromptLogprobs) for e in results[-1])  # not asked


def test_run_accuracy_on_hf_equals_the_builtin_engine(folder: Path, tmp_path: Path) -> None:
    """A multiple-choice task scored on engine=hf: every choice's loglikelihood within 1e-4 of
    the built-in engine's on the same checkpoint."""
    docs = [
        {"question": "t10 t11 t12", "choices": ["t20", "t21 t22", "t23"], "answer": 1},
        {"question": "t30 t31", "choices": ["t40 t41 t42", "t43"], "answer": 0},
    ]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = tmp_path / "words.yaml"
    task.write_text(
        json.dumps(
            {
                "task": "words",
                "dataset_path": "json",
                "dataset_kwargs": {"data_files": {"test": str(data)}},
                "output_type": "multiple_choice",
                "doc_to_text": "{{question}}",
                "doc_to_choice": "{{choices}}",
                "doc_to_target": "{{answer}}",
            }
        )
    )
    options = {"model": str(folder), "dtype": "float32", "device": "cpu"}
    scores = []
    for backend in (
        HFBackend.from_config(options),
        BuiltinBackend(EngineConfig.from_dict(options)),
    ):
        tracker = AccuracyTracker(str(task), None)
        backend.load()
        try:
            tracker.stop(backend, {})
        finally:
            backend.close()
        scores.append(tracker.results(tmp_path, None)["accuracy"])
    hf, builtin = scores
    for mine, theirs in zip(hf["loglikelihoods"], builtin["loglikelihoods"], strict=True):
        assert mine == pytest.approx(theirs, abs=TOLERANCE)
    assert hf["metrics"] == builtin["metrics"]
