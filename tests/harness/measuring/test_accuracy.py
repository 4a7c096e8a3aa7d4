"""run.accuracy: lm-eval multiple-choice tasks loaded from their YAML, choices tokenized by
lm-eval's rule, each choice's loglikelihood equal to Hugging Face's log-softmax over the same
tokens (a random Llama), the accuracy as lm-eval's `acc`; bad tasks and backends without prompt
log-probabilities named. (Parity with lm-eval itself on SmolLM2: tests/serving/
test_server_lm_eval.py.)"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import random_hf_llama

from engines.base import Backend, Finished, GenerationRequest, RequestEvent
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from harness.measuring.accuracy import (
    AccuracyTaskError,
    AccuracyTracker,
    Item,
    encode_pair,
    load_items,
    score_items,
)
from harness.running.run_config import RunConfig

VOCAB = 256


def write_task(folder: Path, docs: list[dict[str, Any]], **spec: Any) -> Path:
    data = folder / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {
        "task": "words",
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "{{answer}}",
        **spec,
    }
    path = folder / "words.yaml"
    path.write_text(json.dumps(task))  # JSON is YAML
    return path


def test_the_shipped_task_loads_as_lm_eval_renders_it() -> None:
    name, items = load_items("inferlab_mc")
    assert name == "inferlab_mc" and len(items) == 16
    first = items[0]
    assert first.context == "Question: What is the capital of France?\nAnswer:"
    assert first.choices == [" Paris", " London", " Rome", " Berlin"] and first.target == 0
    assert len(load_items("inferlab_mc", limit=3)[1]) == 3


def test_lm_evals_pair_rule_moves_the_contexts_trailing_spaces() -> None:
    class Chars:  # one token per character, to see the split
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert add_special_tokens is False
            return [ord(c) for c in text]

    head, tail = encode_pair(Chars(), "Answer: ", "yes")
    assert head == [ord(c) for c in "Answer:"] and tail == [ord(c) for c in " yes"]


@pytest.mark.parametrize(
    ("task", "message"),
    [
        ("nope", r"run.accuracy.task: 'nope' is not a task; allowed: inferlab_gen\|inferlab_mc"),
        ("inferlab_gen", r"output_type 'generate_until'; allowed: multiple_choice"),
    ],
)
def test_a_task_it_cannot_score_is_named(task: str, message: str) -> None:
    with pytest.raises(AccuracyTaskError, match=message):
        load_items(task)


def test_bad_settings_name_the_key() -> None:
    with pytest.raises(ValueError, match=r"run.accuracy.limit: 0 is invalid"):
        RunConfig.from_dict({"accuracy": {"task": "inferlab_mc", "limit": 0}})


class NoPromptLogprobs(Backend):
    name = "silent"

    def load(self) -> None:
        pass

    async def generate(self, request: GenerationRequest) -> AsyncIterator[RequestEvent]:
        yield Finished(request.request_id, 0, 0, "length", 3, 1)


def test_a_backend_without_prompt_logprobs_is_named() -> None:
    tokenizer_item = [Item("t10 t11", [" t12"], 0)]
    backend = NoPromptLogprobs()
    backend.tokenizer = type(  # type: ignore[attr-defined]
        "T", (), {"encode": staticmethod(lambda text, add_special_tokens=True: [1, 2, 3])}
    )()
    with pytest.raises(AccuracyTaskError, match="the silent backend reports no prompt log-prob"):
        asyncio.run(score_items(backend, tokenizer_item))


@pytest.mark.slow
@torch.inference_mode()
def test_loglikelihoods_equal_hf_and_accuracy_is_lm_evals_acc(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    folder = tmp_path / "llama"
    model = random_hf_llama(folder, VOCAB, seed=3)
    docs = [
        {"question": "t10 t11 t12", "choices": ["t20", "t21 t22", "t23"], "answer": 1},
        {"question": "t30 t31", "choices": ["t40 t41 t42", "t43"], "answer": 0},
        {"question": "t50", "choices": ["t60", "t61", "t62", "t63"], "answer": 3},
    ]
    task = write_task(tmp_path, docs)
    tracker = AccuracyTracker(str(task), None)
    backend = BuiltinBackend(EngineConfig.from_dict({"model": str(folder), "dtype": "float32"}))
    backend.load()
    tokenizer = backend.tokenizer
    try:
        tracker.stop(backend, {})
    finally:
        backend.close()
    result = tracker.results(tmp_path, None)["accuracy"]
    expected_correct = []
    for item, scores in zip(tracker.items, result["loglikelihoods"], strict=True):
        reference = []
        for choice in item.choices:
            head, tail = encode_pair(tokenizer, item.context, choice)
            ids = torch.tensor([head + tail])
            logprobs = model(ids).logits[0].float().log_softmax(-1)
            positions = range(len(head) - 1, len(head) + len(tail) - 1)
            reference.append(sum(float(logprobs[p, ids[0, p + 1]]) for p in positions))
        assert scores == pytest.approx(reference, abs=1e-4)
        expected_correct.append(reference.index(max(reference)) == item.target)
    metrics = result["metrics"]
    assert metrics["accuracy"] == sum(expected_correct) / 3 and metrics["accuracy_items"] == 3
