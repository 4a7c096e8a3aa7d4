"""SamplingParams.logprobs: each generated token's log-probability, its rank and the top-k at
its position equal Hugging Face's log-softmax of the same logits (fp32, within 1e-4), in every
KV mode, batch 1 and 8, with chunked prefill, prefix caching, parallel sampling and speculative
decoding; and they are the raw logits' (before temperature), as vLLM v1 reports by default."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import random_hf_llama

from engines.base import PromptLogprobs
from engines.builtin import LLM, SamplingParams
from engines.builtin.llm import RequestOutput

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

transformers = pytest.importorskip("transformers")

VOCAB = 512
TOLERANCE = 1e-4
TOP = 5
PROMPT_LENS = (3, 9, 14, 20, 6, 11, 17, 25)  # 8 prompts of different lengths


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    folder = tmp_path_factory.mktemp("logprobs_llama")
    return random_hf_llama(folder, VOCAB, 7), folder


def prompts(count: int = len(PROMPT_LENS), shared_prefix: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)
    prefix = torch.randint(7, VOCAB, (shared_prefix,), generator=gen).tolist()
    return [
        prefix + torch.randint(7, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS[:count]
    ]


@torch.inference_mode()
def check_against_hf(model: torch.nn.Module, prompt: list[int], out: RequestOutput) -> None:
    """Every sample's logprobs equal HF's log-softmax over the prompt and that sample."""
    for sample in out.outputs:
        assert sample.logprobs is not None and len(sample.logprobs) == len(sample.token_ids)
        sequence = prompt + sample.token_ids
        logits = model(torch.tensor([sequence])).logits[0].float()
        reference = logits.log_softmax(-1)[len(prompt) - 1 : -1]
        for position, (token, found) in enumerate(
            zip(sample.token_ids, sample.logprobs, strict=True)
        ):
            row = reference[position]
            assert found.token_id == token
            assert abs(found.logprob - float(row[token])) < TOLERANCE
            # 1 + how many are more likely, give or take the ones within the tolerance
            above = int((row > row[token] + TOLERANCE).sum())
            close = int(((row - row[token]).abs() <= TOLERANCE).sum()) - 1
            assert above + 1 <= found.rank <= above + 1 + close
            values, ids = row.topk(len(found.top))
            assert [v for _, v in found.top] == pytest.approx(values.tolist(), abs=TOLERANCE)
            gaps = values[:-1] - values[1:]
            for i, (token_id, _) in enumerate(found.top):  # ids agree where no near-tie
                if (i == 0 or gaps[i - 1] > TOLERANCE) and (i >= len(gaps) or gaps[i] > TOLERANCE):
                    assert token_id == int(ids[i])


def generate(
    folder: Path, batch: list[list[int]], params: SamplingParams, **options: object
) -> list[RequestOutput]:
    with LLM(model=str(folder), dtype="float32", max_model_len=128, **options) as llm:
        return llm.generate(batch, params)


def chunked_and_cached(folder: Path) -> LLM:
    """Prompts in 16-token chunks, a prefix cache of 16-token blocks."""
    return LLM(
        model=str(folder),
        dtype="float32",
        max_model_len=128,
        kv_cache="paged",
        block_size=16,
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=16,
    )


GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=TOP)


@pytest.mark.parametrize("kv_cache", ["none", "contiguous", "paged"])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_logprobs_equal_hf_in_every_kv_mode(
    hf_model: tuple[torch.nn.Module, Path], kv_cache: str, batch: int
) -> None:
    model, folder = hf_model
    batch_prompts = prompts(batch)
    outs = generate(folder, batch_prompts, GREEDY, kv_cache=kv_cache)
    for prompt, out in zip(batch_prompts, outs, strict=True):
        check_against_hf(model, prompt, out)
        assert all(found.rank == 1 for found in out.outputs[0].logprobs or [])  # greedy


def test_chunked_prefill_and_prefix_caching_give_the_same_logprobs(
    hf_model: tuple[torch.nn.Module, Path],
) -> None:
    """Prompts split over steps of 16 tokens; then the same prompts again, their shared
    32-token prefix now in the cache: the logprobs still equal HF's."""
    model, folder = hf_model
    batch = prompts(4, shared_prefix=32)
    with chunked_and_cached(folder) as llm:
        first = llm.generate(batch, GREEDY)
        again = llm.generate(batch, GREEDY)
        assert llm.engine.kv.prefix_hit_tokens >= 32  # the second pass read its prefix
    for prompt, out_1, out_2 in zip(batch, first, again, strict=True):
        check_against_hf(model, prompt, out_1)
        check_against_hf(model, prompt, out_2)


def test_sampled_tokens_report_the_raw_logits_logprobs(
    hf_model: tuple[torch.nn.Module, Path],
) -> None:
    """Temperature and top-k shape the draw, not the report (vLLM v1's raw_logprobs): a
    sampled token's logprob is the raw log-softmax's, and it need not be the most likely; n=2
    samples each report their own."""
    model, folder = hf_model
    params = SamplingParams(
        max_tokens=12, temperature=1.5, top_k=50, seed=3, ignore_eos=True, logprobs=2, n=2
    )
    batch = prompts(3)
    outs = generate(folder, batch, params)
    for prompt, out in zip(batch, outs, strict=True):
        check_against_hf(model, prompt, out)
    ranks = [found.rank for out in outs for s in out.outputs for found in s.logprobs or []]
    assert max(ranks) > 1  # at temperature 1.5 some draws are not the argmax


def test_speculative_decoding_reports_the_targets_logprobs_for_every_kept_token(
    hf_model: tuple[torch.nn.Module, Path],
) -> None:
    model, folder = hf_model
    # a repeating prompt, so that the n-gram proposer finds drafts and the target keeps some
    batch = [[11, 12, 13, 14, 15] * 4, [40, 41, 42] * 6]
    outs = generate(
        folder,
        batch,
        GREEDY,
        kv_cache="paged",
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    plain = generate(folder, batch, GREEDY, kv_cache="paged")
    for prompt, out, reference in zip(batch, outs, plain, strict=True):
        assert out.token_ids == reference.token_ids  # greedy: the same tokens
        check_against_hf(model, prompt, out)
    assert sum(o.metrics.spec_accepted_tokens for o in outs) > 0  # drafts were kept


def test_logprobs_zero_reports_the_sampled_token_only_and_none_reports_nothing(
    hf_model: tuple[torch.nn.Module, Path],
) -> None:
    _, folder = hf_model
    params = [
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=0),
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    ]
    with LLM(model=str(folder), dtype="float32", max_model_len=128) as llm:
        zero, none = llm.generate(prompts(2), params)
    assert zero.outputs[0].logprobs is not None
    assert all(found.top == () and found.rank == 1 for found in zero.outputs[0].logprobs)
    assert none.outputs[0].logprobs is None


@pytest.mark.parametrize("value", [-1, 21, 2.5, True, "5"])
def test_a_bad_logprobs_value_names_the_field(value: object) -> None:
    with pytest.raises(
        ValueError, match=r"SamplingParams.logprobs: .* allowed: null or an integer in \[0, 20\]"
    ):
        SamplingParams(logprobs=value)  # type: ignore[arg-type]


def test_tensor_parallel_ranks_report_the_same_logprobs(
    hf_model: tuple[torch.nn.Module, Path],
) -> None:
    """Rank 0 samples from the gathered logits: the logprobs are the whole vocabulary's."""
    model, folder = hf_model
    batch = prompts(4)
    outs = generate(folder, batch, GREEDY, kv_cache="paged", tensor_parallel_size=2, num_threads=1)
    for prompt, out in zip(batch, outs, strict=True):
        check_against_hf(model, prompt, out)


@torch.inference_mode()
def check_prompt_against_hf(model: torch.nn.Module, prompt: list[int], out: RequestOutput) -> None:
    """Prompt token i's logprobs equal HF's log-softmax at position i - 1; the first is None."""
    found = out.prompt_logprobs
    assert found is not None and len(found) == len(prompt) and found[0] is None
    reference = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    for position in range(1, len(prompt)):
        entry, row = found[position], reference[position - 1]
        assert entry is not None and entry.token_id == prompt[position]
        assert abs(entry.logprob - float(row[prompt[position]])) < TOLERANCE
        values = row.topk(len(entry.top)).values.tolist()
        assert [v for _, v in entry.top] == pytest.approx(values, abs=TOLERANCE)


PROMPT = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)


@pytest.mark.parametrize("kv_cache", ["none", "contiguous", "paged"])
def test_prompt_logprobs_equal_hf_in_every_kv_mode(
    hf_model: tuple[torch.nn.Module, Path], kv_cache: str
) -> None:
    model, folder = hf_model
    batch = prompts(8)
    for prompt, out in zip(batch, generate(folder, batch, PROMPT, kv_cache=kv_cache), strict=True):
        check_prompt_against_hf(model, prompt, out)
        assert out.outputs[0].logprobs is None  # not asked


def test_prompt_logprobs_over_chunks_and_past_the_prefix_cache(
    hf_model: tuple[torch.nn.Module, Path],
) -> None:
    """16-token chunks; a second pass whose shared 32-token prefix is cached: the requests that
    ask for prompt logprobs compute their whole prompt (a cached block has no logits), the
    others still read the cache."""
    model, folder = hf_model
    batch = prompts(4, shared_prefix=32)
    with chunked_and_cached(folder) as llm:
        llm.generate(batch, GREEDY)  # fills the cache
        hits_before = llm.engine.kv.prefix_hit_tokens
        asked = llm.generate(batch, PROMPT)
        assert llm.engine.kv.prefix_hit_tokens == hits_before  # none read from the cache
        llm.generate(batch, GREEDY)
        assert llm.engine.kv.prefix_hit_tokens > hits_before  # the others do
    for prompt, out in zip(batch, asked, strict=True):
        check_prompt_against_hf(model, prompt, out)
        assert out.metrics is not None


def test_prompt_and_output_logprobs_together_and_under_tensor_parallelism(
    hf_model: tuple[torch.nn.Module, Path],
) -> None:
    model, folder = hf_model
    both = SamplingParams(
        max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=TOP, prompt_logprobs=0
    )
    batch = prompts(4)
    outs = generate(folder, batch, both, kv_cache="paged", tensor_parallel_size=2, num_threads=1)
    for prompt, out in zip(batch, outs, strict=True):
        check_prompt_against_hf(model, prompt, out)
        check_against_hf(model, prompt, out)
        assert all(e is None or e.top == () for e in out.prompt_logprobs or [])


def test_a_one_token_prompt_reports_its_one_none() -> None:
    with LLM("tiny", dtype="float32") as llm:
        out = llm.generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == [None]


@pytest.mark.parametrize("prompt", [[5], [5, 6, 7, 8, 9, 10, 11]])
def test_parallel_samples_report_their_prompt_once(prompt: list[int]) -> None:
    """n=3 forks share the prompt (or recompute it when the cache cannot hold them): the
    request's PromptLogprobs event comes once, from the parent."""
    with LLM("tiny", dtype="float32") as llm:
        engine = llm.engine
        engine.add_request("r", prompt, SamplingParams(max_tokens=3, n=3, prompt_logprobs=1))
        events = []
        while engine.has_unfinished_requests():
            events += engine.step()
    reported = [e for e in events if isinstance(e, PromptLogprobs)]
    assert len(reported) == 1 and len(reported[0].logprobs) == len(prompt)
