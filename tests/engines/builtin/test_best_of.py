"""SamplingParams.best_of > n: best_of samples are drawn and the n whose summed raw
log-probabilities are highest come back, best first, at the end; they are exactly the best n of
the same seeded samples drawn as n=best_of, and their sums equal those samples' reported
logprobs."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engines.base import Finished, Tokens
from engines.builtin import LLM, SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time", "A B C"]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    with LLM("tiny", dtype="float32", kv_cache="paged", max_model_len=128) as engine:
        yield engine


def sampled(n: int, best_of: int | None, logprobs: int | None = 0) -> SamplingParams:
    return SamplingParams(
        max_tokens=8, temperature=1.0, seed=7, n=n, best_of=best_of, logprobs=logprobs
    )


def test_best_of_returns_the_most_likely_of_the_same_samples(llm: LLM) -> None:
    every = llm.generate(PROMPTS, sampled(4, None))
    best = llm.generate(PROMPTS, sampled(2, 4, logprobs=None))
    for all_samples, chosen in zip(every, best, strict=True):
        sums = [sum(lp.logprob for lp in s.logprobs or []) for s in all_samples.outputs]
        order = sorted(range(4), key=lambda i: (-sums[i], i))[:2]
        assert [o.token_ids for o in chosen.outputs] == [
            all_samples.outputs[i].token_ids for i in order
        ]
        for output, i in zip(chosen.outputs, order, strict=True):
            assert output.cumulative_logprob == pytest.approx(sums[i], abs=1e-5)
            assert output.logprobs is None  # computed for the rank, not reported
            assert output.text == all_samples.outputs[i].text


def test_logprobs_come_with_the_chosen_samples(llm: LLM) -> None:
    every = llm.generate(PROMPTS[0], sampled(3, None, logprobs=2))[0].outputs
    best = llm.generate(PROMPTS[0], sampled(1, 3, logprobs=2))[0].outputs
    sums = [sum(lp.logprob for lp in s.logprobs or []) for s in every]
    winner = every[max(range(3), key=lambda i: (sums[i], -i))]
    assert best[0].token_ids == winner.token_ids and best[0].logprobs == winner.logprobs


def test_outputs_arrive_together_at_the_end(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("r", PROMPTS[1], sampled(2, 5))
    steps = []
    while engine.has_unfinished_requests():
        steps.append(engine.step())
    assert not any(isinstance(e, Tokens | Finished) for step in steps[:-1] for e in step)
    finished = [e for e in steps[-1] if isinstance(e, Finished)]
    assert [e.index for e in finished] == [0, 1]
    assert finished[0].cumulative_logprob >= finished[1].cumulative_logprob  # type: ignore[operator]
    assert not engine.sequences and not engine.output.final._ranked


def test_abort_reports_n_outputs(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("r", PROMPTS[2], sampled(2, 4))
    for _ in range(3):
        engine.step()
    engine.abort_request("r")
    finished = [e for e in engine._pending_events if isinstance(e, Finished)]
    engine.step()
    assert [(e.index, e.finish_reason) for e in finished] == [(0, "abort"), (1, "abort")]
    assert not engine.sequences and not engine.output.final._ranked
    assert not engine.has_unfinished_requests()


@pytest.mark.parametrize(
    ("kwargs", "allowed"),
    [
        ({"n": 3, "best_of": 2}, "null or an integer >= n=3"),
        ({"best_of": 0}, "null or an integer >= n=1"),
        ({"best_of": True}, "null or an integer >= n=1"),
        ({"use_beam_search": True, "best_of": 2}, "beam_width is the width"),
    ],
)
def test_bad_best_of_names_the_field(kwargs: dict, allowed: str) -> None:
    with pytest.raises(ValueError, match=r"SamplingParams\.best_of") as info:
        SamplingParams(**kwargs)
    assert allowed in str(info.value)


def test_static_batching_refuses_best_of() -> None:
    with (
        LLM("tiny", batching="static") as llm,
        pytest.raises(ValueError, match=r"SamplingParams\.best_of: 2 needs parallel sampling"),
    ):
        llm.generate("x", SamplingParams(best_of=2))
