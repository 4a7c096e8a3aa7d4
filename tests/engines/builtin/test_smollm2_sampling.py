"""The sampling surface on the real model (SmolLM2-135M-Instruct, its GGUF file read by the
engine and by transformers' own GGUF loader, fp32): logprobs in a batch of prompts, greedy
tokens under penalties and logit_bias, and beam search all equal Hugging Face's."""

from __future__ import annotations

import functools
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from engines.builtin import LLM, SamplingParams
from engines.hf.model import load_hf_model

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

transformers = pytest.importorskip("transformers")

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Water boils at",
]
STEPS = 8
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_model(smollm2_gguf: Path) -> torch.nn.Module:
    import gguf

    # transformers asks gguf for the tensor-name map ~400 times while loading; built once
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        model, _ = load_hf_model(
            str(smollm2_gguf), {}, torch.float32, torch.device("cpu"), 0, "eager"
        )
    return model.eval()


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> Iterator[LLM]:
    with LLM("smollm2-135m", dtype="float32", kv_cache="paged", max_model_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return [llm.engine.tokenize(text) for text in TEXTS]


@torch.inference_mode()
def hf_logprobs(model: torch.nn.Module, sequence: list[int], start: int) -> torch.Tensor:
    """HF's log-softmax at the positions that predict sequence[start:]."""
    logits = model(torch.tensor([sequence])).logits[0].float()
    return logits.log_softmax(-1)[start - 1 : -1]


def test_logprobs_of_a_batch_equal_hf(
    llm: LLM, hf_model: torch.nn.Module, prompts: list[list[int]]
) -> None:
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logprobs=5)
    for prompt, out in zip(prompts, llm.generate(prompts, params), strict=True):
        sample = out.outputs[0]
        assert sample.logprobs is not None
        reference = hf_logprobs(hf_model, prompt + sample.token_ids, len(prompt))
        for row, token, found in zip(reference, sample.token_ids, sample.logprobs, strict=True):
            assert found.token_id == token == int(row.argmax())
            assert abs(found.logprob - float(row[token])) < TOLERANCE
            top = [value for _, value in found.top]
            assert top == pytest.approx(row.topk(5).values.tolist(), abs=TOLERANCE)


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], processor: object) -> list[int]:
    ids = torch.tensor([prompt])
    for _ in range(STEPS):
        scores = model(ids).logits[:, -1].float()
        scores = processor(ids, scores)  # type: ignore[operator]
        ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=-1)
    return ids[0, len(prompt) :].tolist()


def test_penalties_and_logit_bias_in_one_batch_equal_hf_processors(
    llm: LLM, hf_model: torch.nn.Module, prompts: list[list[int]]
) -> None:
    """A batch whose rows each ask for another adjustment: each row's tokens are HF's with
    that row's logits processor; the adjustments change the plain greedy tokens."""
    bias = {prompts[2][-1]: 5.0, 13: 3.0}
    cases = [
        ({"repetition_penalty": 1.6}, transformers.RepetitionPenaltyLogitsProcessor(1.6)),
        (
            {"logit_bias": bias},
            transformers.SequenceBiasLogitsProcessor(
                {(token,): value for token, value in bias.items()}
            ),
        ),
        ({"repetition_penalty": 0.8}, transformers.RepetitionPenaltyLogitsProcessor(0.8)),
        ({}, lambda ids, scores: scores),
    ]
    params = [
        SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, **fields)
        for fields, _ in cases
    ]
    outs = llm.generate(prompts, params)
    changed = 0
    for prompt, (_, processor), out in zip(prompts, cases, outs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, processor)
        changed += out.outputs[0].token_ids != hf_greedy(hf_model, prompt, lambda i, s: s)
    assert changed >= 2  # the comparisons have teeth


@torch.inference_mode()
def test_beam_search_equals_hf(
    llm: LLM, hf_model: torch.nn.Module, prompts: list[list[int]]
) -> None:
    eos = llm.engine.eos_ids
    params = SamplingParams(max_tokens=STEPS, use_beam_search=True, beam_width=4, n=4)
    for prompt, out in zip(prompts[:2], llm.generate(prompts[:2], params), strict=True):
        ref = hf_model.generate(
            torch.tensor([prompt]),
            num_beams=4,
            num_return_sequences=4,
            max_new_tokens=STEPS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0],
            return_dict_in_generate=True,
            output_scores=True,
        )
        rows = ref.sequences[:, len(prompt) :].tolist()
        for sample, row, score in zip(out.outputs, rows, ref.sequences_scores, strict=True):
            assert sample.token_ids == row[: len(sample.token_ids)]
            assert sample.cumulative_logprob / len(sample.token_ids) == pytest.approx(
                float(score), abs=1e-4
            )


@pytest.mark.parametrize("mode", ["greedy", "sampled", "speculative"])
def test_every_shipped_schema_gives_valid_json(mode: str) -> None:
    """SmolLM2 asked for each shipped JSON schema (data/structured/constraints.jsonl) under
    its grammar: every output completes and validates (jsonschema), greedy, sampled and with
    n-gram speculative decoding."""
    pytest.importorskip("xgrammar")
    jsonschema = pytest.importorskip("jsonschema")
    from workloads.structured import shipped_constraints

    schemas = [params for _, params in shipped_constraints()["json"]]
    options: dict[str, object] = {"dtype": "float32", "max_model_len": 512}
    if mode == "speculative":
        options["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3}
    with LLM("smollm2-135m", **options) as llm:
        prompts = [
            llm.engine.tokenize(
                [{"role": "user", "content": f"Reply with JSON for this schema: {p.spec}"}]
            )
            for p in schemas
        ]
        params = [
            SamplingParams(
                max_tokens=256,
                temperature=0.8 if mode == "sampled" else 0.0,
                seed=1,
                structured_outputs=p,
            )
            for p in schemas
        ]
        outs = llm.generate(prompts, params)
    for constraint, out in zip(schemas, outs, strict=True):
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), json.loads(constraint.spec))
