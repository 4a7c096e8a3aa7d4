"""Penalties, min_p, logit_bias, allowed_token_ids and bad_words (engines/builtin/penalties.py):
greedy tokens equal Hugging Face's own logits processors applied to HF's logits step by step
(a hand-written reference for OpenAI's presence/frequency definition), batch 1 and a mixed
batch in every KV mode; n-gram speculative decoding gives the same tokens; masks hold."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import random_hf_llama

from engines.builtin import LLM, SamplingParams
from engines.builtin.sampler import Sampler, SamplingBatch

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

transformers = pytest.importorskip("transformers")

VOCAB = 512
STEPS = 16
PROMPT_LENS = (5, 12, 3, 18, 9, 7)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("penalties_llama")
    return random_hf_llama(folder, VOCAB, 5), folder


def prompts(count: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(7, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS[:count]]


Processor = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]


def openai_penalties(presence: float, frequency: float) -> Processor:
    """OpenAI's definition: minus frequency * count and presence * [count > 0] over the
    output tokens (not the prompt's)."""

    def apply(ids: torch.Tensor, scores: torch.Tensor, prompt_len: int) -> torch.Tensor:
        counts = torch.bincount(ids[0, prompt_len:], minlength=VOCAB).float()
        return scores - frequency * counts - presence * (counts > 0).float()

    return apply


def hf(processor: Any) -> Processor:
    return lambda ids, scores, _prompt_len: processor(ids, scores)


#: (engine parameters, the HF reference processor on the raw logits)
CASES: dict[str, tuple[dict[str, Any], Processor]] = {
    "presence": ({"presence_penalty": 1.5}, openai_penalties(1.5, 0.0)),
    "frequency": ({"frequency_penalty": 1.7}, openai_penalties(0.0, 1.7)),
    "negative_frequency": ({"frequency_penalty": -1.5}, openai_penalties(0.0, -1.5)),
    "repetition": (
        {"repetition_penalty": 1.8},
        hf(transformers.RepetitionPenaltyLogitsProcessor(1.8)),
    ),
    "repetition_below_1": (
        {"repetition_penalty": 0.7},
        hf(transformers.RepetitionPenaltyLogitsProcessor(0.7)),
    ),
    "logit_bias": (
        {"logit_bias": {17: 4.0, 101: 6.0, 300: -100.0}},
        hf(transformers.SequenceBiasLogitsProcessor({(17,): 4.0, (101,): 6.0, (300,): -100.0})),
    ),
    # greedy: min_p keeps the top token, so the argmax is HF's with its warper too
    "min_p": ({"min_p": 0.3}, hf(transformers.MinPLogitsWarper(0.3))),
}


@torch.inference_mode()
def hf_greedy(model: torch.nn.Module, prompt: list[int], processor: Processor) -> list[int]:
    """HF's logits at each step, the processor applied, then the argmax."""
    ids = torch.tensor([prompt])
    for _ in range(STEPS):
        scores = model(ids).logits[:, -1].float()
        scores = processor(ids, scores, len(prompt))
        ids = torch.cat([ids, scores.argmax(-1, keepdim=True)], dim=-1)
    return ids[0, len(prompt) :].tolist()


def greedy(**fields: Any) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, **fields)


def generate(
    folder: Path, batch: list[list[int]], params: Any, **options: object
) -> list[list[int]]:
    with LLM(model=str(folder), dtype="float32", max_model_len=128, **options) as llm:
        return [out.outputs[0].token_ids for out in llm.generate(batch, params)]


@pytest.mark.parametrize("case", list(CASES))
def test_batch_of_one_equals_hf_logits_processors(
    hf_model: tuple[torch.nn.Module, Path], case: str
) -> None:
    model, folder = hf_model
    fields, processor = CASES[case]
    prompt = prompts(1)[0]
    found = generate(folder, [prompt], greedy(**fields))[0]
    assert found == hf_greedy(model, prompt, processor)


def test_the_penalties_change_the_tokens(hf_model: tuple[torch.nn.Module, Path]) -> None:
    """The comparisons above have teeth: the random model repeats itself when greedy, and each
    penalty (not min_p, which keeps the argmax) changes what it writes."""
    model, _ = hf_model
    prompt = prompts(1)[0]
    plain = hf_greedy(model, prompt, lambda ids, scores, n: scores)
    assert len(set(plain)) < len(plain)  # it repeats
    changed = []
    for case, (_fields, processor) in CASES.items():
        if case != "min_p":
            changed.append(hf_greedy(model, prompt, processor) != plain)
    assert all(changed)


MIXED = ["presence", None, "repetition", "logit_bias", None, "frequency"]


@pytest.mark.parametrize("kv_cache", ["none", "contiguous", "paged"])
def test_mixed_batch_equals_hf_in_every_kv_mode(
    hf_model: tuple[torch.nn.Module, Path], kv_cache: str
) -> None:
    """Rows with and without penalties in one batch: each row's tokens are its own HF
    reference's (rows that ask for none are plain greedy)."""
    model, folder = hf_model
    batch = prompts(len(MIXED))
    params = [greedy(**(CASES[c][0] if c else {})) for c in MIXED]
    found = generate(folder, batch, params, kv_cache=kv_cache)
    for prompt, case, tokens in zip(batch, MIXED, found, strict=True):
        processor = CASES[case][1] if case else (lambda ids, scores, n: scores)
        assert tokens == hf_greedy(model, prompt, processor), case


def test_ngram_speculative_decoding_gives_the_same_tokens(
    hf_model: tuple[torch.nn.Module, Path],
) -> None:
    """Drafts count as output for the penalties at the positions after them, so verification
    keeps exactly the tokens decoding one at a time would write."""
    _, folder = hf_model
    batch = [p * 3 for p in prompts(4)]  # repeated prompts give the n-gram proposer matches
    # penalties that favour repeating keep many drafts, and a kept draft changes the next
    # position's counts
    cases = ("negative_frequency", "repetition_below_1", "presence", "repetition")
    params = [greedy(**CASES[c][0]) for c in cases]
    params.append(greedy())
    batch.append(batch[0])
    plain = generate(folder, batch, params, kv_cache="paged")
    spec = generate(
        folder,
        batch,
        params,
        kv_cache="paged",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    assert spec == plain


def test_drafts_count_as_output_at_the_positions_after_them() -> None:
    """Speculative decoding scores position i after drafts d_0..d_(i-1): its penalties and
    bad words see them, exactly as a sequence that had already written them."""
    torch.manual_seed(1)
    logits = torch.randn(3, VOCAB)
    params = SamplingParams(
        temperature=0.0, frequency_penalty=1.0, presence_penalty=0.5, repetition_penalty=1.3
    )
    drafts = [[], [40], [40, 41]]
    seq = _FakeSeq(params, output=[39])
    seq.bad_words_token_ids = [[41, 42]]
    sampler = Sampler(0, torch.device("cpu"))
    cpu = torch.device("cpu")
    batch = SamplingBatch.from_sequences([seq] * 3, [2], cpu, [0, 1, 2], drafts)  # type: ignore[list-item]
    found = sampler.masked(logits, batch)
    for row, ahead in enumerate(drafts):
        alone = _FakeSeq(params, output=[39, *ahead])
        alone.bad_words_token_ids = seq.bad_words_token_ids
        one = SamplingBatch.from_sequences([alone], [2], cpu)  # type: ignore[list-item]
        torch.testing.assert_close(found[row], sampler.masked(logits[row : row + 1], one)[0])
    assert found[2, 42] == float("-inf") and found[1, 42] > float("-inf")  # "t41 t42" banned


def test_allowed_token_ids_and_bad_words_are_never_sampled(
    hf_model: tuple[torch.nn.Module, Path],
) -> None:
    """Sampled rows (temperature 1) draw only allowed ids; greedy rows biased toward the bad
    words' tokens never write a banned one or complete a two-token bad word."""
    _, folder = hf_model
    allowed = [9, 40, 77, 200, 411]
    sampled = SamplingParams(
        max_tokens=24, temperature=1.0, seed=4, ignore_eos=True, allowed_token_ids=allowed
    )
    biased = greedy(logit_bias={5: 100.0, 7: 100.0}, bad_words=["t5", "t7 t7"])
    found = generate(folder, prompts(3), [sampled, biased, biased], kv_cache="paged")
    assert set(found[0]) <= set(allowed)
    for tokens in found[1:]:
        assert 5 not in tokens
        assert 7 in tokens  # the bias wins where no bad word forbids it
        assert all((a, b) != (7, 7) for a, b in itertools.pairwise(tokens))


def test_min_p_distribution_equals_hf_warper() -> None:
    """After temperature, the distribution sampled from is HF's MinPLogitsWarper's softmax
    (what speculative decoding's rejection sampler verifies against)."""
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    temperatures, min_ps = [0.7, 1.0, 1.3], [0.1, 0.0, 0.5]
    seqs = [
        _FakeSeq(SamplingParams(temperature=t, min_p=m))
        for t, m in zip(temperatures, min_ps, strict=True)
    ]
    batch = SamplingBatch.from_sequences(seqs, [2], torch.device("cpu"))  # type: ignore[arg-type]
    found = Sampler(0, torch.device("cpu")).distributions(logits, batch)
    for row, (t, m) in enumerate(zip(temperatures, min_ps, strict=True)):
        scaled = logits[row : row + 1] / t
        expected = transformers.MinPLogitsWarper(m)(None, scaled).softmax(-1) if m else None
        expected = scaled.softmax(-1) if expected is None else expected
        torch.testing.assert_close(found[row : row + 1], expected)


class _FakeSeq:
    """What SamplingBatch reads of a sequence."""

    def __init__(self, sampling: SamplingParams, output: list[int] | None = None) -> None:
        self.sampling = sampling
        self.output_token_ids: list[int] = list(output or [])
        self.num_output_tokens = len(self.output_token_ids)
        self.prompt_token_ids: list[int] = [3]
        self.bad_words_token_ids: list[list[int]] = []
        self.generator = None


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": math.nan}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"min_p": 1.5}, "min_p"),
        ({"logit_bias": {3: 101.0}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
    ],
)
def test_bad_values_name_the_field(fields: dict[str, Any], name: str) -> None:
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{name}: .*allowed: "):
        SamplingParams(**fields)


def test_ids_outside_the_vocabulary_are_refused(hf_model: tuple[torch.nn.Module, Path]) -> None:
    _, folder = hf_model
    with LLM(model=str(folder), dtype="float32", max_model_len=128) as llm:
        for fields, name in (
            ({"logit_bias": {VOCAB: 1.0}}, "logit_bias"),
            ({"allowed_token_ids": [1, VOCAB + 3]}, "allowed_token_ids"),
        ):
            with pytest.raises(ValueError, match=rf"SamplingParams\.{name}: .*vocabulary"):
                llm.generate([[5, 6]], SamplingParams(**fields))


@pytest.mark.parametrize("penalty", [1e-308, 1e-40, 1e-38, 1e39, 1e308])
@pytest.mark.parametrize("temperature", [0.0, 1e-5, 1.0])
def test_a_repetition_penalty_past_float32_keeps_the_distribution_finite(
    penalty: float, temperature: float
) -> None:
    """Hostile pass (issue 39): float32 holds 1e-40 as 0 and 1e39 as inf, and 10 / 1e-38
    overflows; the seen token's logit became +inf or NaN, the softmax NaN, and a sampled row
    drew token 0 again and again. Now a tiny penalty makes the seen token (id 3, the prompt)
    certain, a huge one makes it impossible, and every probability stays finite."""
    logits = torch.linspace(-2.0, 2.0, 16).unsqueeze(0)
    logits[0, 3] = 10.0 if penalty < 1 else -10.0
    logits[0, 4] = 0.0  # unseen: untouched
    seq = _FakeSeq(SamplingParams(temperature=temperature, repetition_penalty=penalty, seed=1))
    batch = SamplingBatch.from_sequences([seq], [], torch.device("cpu"))  # type: ignore[list-item]
    probs = Sampler(0, torch.device("cpu")).distributions(logits, batch)
    assert bool(torch.isfinite(probs).all()), probs
    if penalty < 1:
        assert probs[0, 3].item() == pytest.approx(1.0)
    else:
        assert probs[0, 3].item() == 0.0 and probs.sum().item() == pytest.approx(1.0)
    token = Sampler(0, torch.device("cpu"))(logits, batch)
    assert (token.item() == 3) == (penalty < 1)


def test_allowed_token_ids_the_other_masks_leave_empty_are_refused() -> None:
    """Hostile pass (issue 39): allowed_token_ids whose every id is a one-token bad word, or
    only EOS / stop ids under min_tokens, left a row of -inf logits, and the engine sampled
    token 0 (outside the allowed ids) until max_tokens. Refused when the request is added."""
    with LLM("tiny") as llm:
        word = llm.engine.tokenizer.encode("Hello", add_special_tokens=False)
        assert len(word) == 1
        eos = llm.engine.eos_ids[0]
        for fields, reason in (
            ({"allowed_token_ids": word, "bad_words": ["Hello"]}, "banned by bad_words"),
            ({"allowed_token_ids": [eos], "min_tokens": 1}, "min_tokens=1 masks"),
            ({"allowed_token_ids": [7], "stop_token_ids": [7], "min_tokens": 2}, "min_tokens=2"),
        ):
            refused = rf"^SamplingParams\.allowed_token_ids: .*{reason}"
            with pytest.raises(ValueError, match=refused):
                llm.generate("Hi", SamplingParams(max_tokens=4, **fields))  # type: ignore[arg-type]
        # one id left is enough, and min_tokens=0 lets EOS alone through
        (out,) = llm.generate(
            "Hi", SamplingParams(max_tokens=3, allowed_token_ids=[*word, 7], bad_words=["Hello"])
        )
        assert out.outputs[0].token_ids and set(out.outputs[0].token_ids) == {7}
        (out,) = llm.generate("Hi", SamplingParams(max_tokens=3, allowed_token_ids=[eos]))
        assert out.outputs[0].token_ids == [eos]


@pytest.mark.parametrize("fields", [{"temperature": "1"}, {"top_p": None}, {"temperature": True}])
def test_a_non_number_temperature_or_top_p_is_a_value_error(fields: dict[str, Any]) -> None:
    """Hostile pass (issue 39): a string temperature raised TypeError from the comparison."""
    name = next(iter(fields))
    with pytest.raises(ValueError, match=rf"^SamplingParams\.{name}: .*allowed: "):
        SamplingParams(**fields)
