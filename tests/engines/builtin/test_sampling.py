"""Sampling: top-k / top-p supports, the sampled distribution, seeds, lengths and min_tokens."""

from __future__ import annotations

import math

import pytest
import torch

from engines.builtin import LLM, SamplingParams
from engines.builtin.sampler import Sampler, SamplingBatch, apply_top_k_top_p

LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.25])


def batch_of(
    rows: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    suppress: dict[int, list[int]] | None = None,
) -> SamplingBatch:
    suppress = suppress or {}
    return SamplingBatch(
        temperature=torch.full((rows,), temperature),
        top_k=torch.full((rows,), top_k, dtype=torch.int64),
        top_p=torch.full((rows,), top_p),
        all_greedy=temperature == 0.0,
        any_top_k=top_k > 0,
        any_top_p=top_p < 1.0,
        suppress_rows=list(suppress),
        suppress_ids=list(suppress.values()),
        generators=[None] * rows,
    )


def draw(logits: torch.Tensor, n: int, seed: int = 0, **kw) -> torch.Tensor:
    return Sampler(seed, torch.device("cpu"))(logits.expand(n, -1).clone(), batch_of(n, **kw))


def assert_matches(samples: torch.Tensor, probs: torch.Tensor) -> None:
    """Every category's count within 5 binomial standard errors of n * p (zero where p = 0)."""
    n = samples.numel()
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    for i, p in enumerate(probs.double().tolist()):
        if p == 0.0:
            assert counts[i] == 0, f"token {i} has probability 0 but was drawn {counts[i]} times"
            continue
        sigma = math.sqrt(n * p * (1 - p))
        assert abs(counts[i] - n * p) <= 5 * sigma, (
            f"token {i}: {int(counts[i])} draws, expected {n * p:.0f} ± {5 * sigma:.0f}"
        )


# ---- top-k / top-p masks ------------------------------------------------------------------


def test_top_k_keeps_the_k_largest() -> None:
    for k in (1, 3, 5, 8):
        masked = apply_top_k_top_p(LOGITS.unsqueeze(0), torch.tensor([k]), None)[0]
        kept = set(torch.nonzero(masked.isfinite()).flatten().tolist())
        assert kept == set(LOGITS.topk(k).indices.tolist())
        assert torch.equal(masked[masked.isfinite()], LOGITS[masked.isfinite()])
    off = apply_top_k_top_p(LOGITS.unsqueeze(0), torch.tensor([0]), None)[0]
    assert torch.equal(off, LOGITS)


def test_top_k_restricts_sampled_support() -> None:
    samples = draw(LOGITS, 20_000, top_k=3)
    top3 = LOGITS.topk(3).indices
    assert set(samples.unique().tolist()) == set(top3.tolist())
    probs = torch.zeros_like(LOGITS)
    probs[top3] = LOGITS[top3].softmax(-1)
    assert_matches(samples, probs)


# probabilities [0.5, 0.3, 0.15, 0.05] (order shuffled below): the smallest set of top tokens
# whose mass reaches p, computed by hand.
NUCLEUS = [
    (0.45, {0}),
    (0.75, {0, 1}),
    (0.79, {0, 1}),
    (0.81, {0, 1, 2}),
    (0.9, {0, 1, 2}),
    (0.97, {0, 1, 2, 3}),
    (1.0, {0, 1, 2, 3}),
]


@pytest.mark.parametrize(("top_p", "expected"), NUCLEUS)
def test_top_p_keeps_the_minimal_nucleus(top_p: float, expected: set[int]) -> None:
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # rank of each: 2, 0, 3, 1
    rank = {1: 0, 3: 1, 0: 2, 2: 3}
    masked = apply_top_k_top_p(probs.log().unsqueeze(0), None, torch.tensor([top_p]))[0]
    kept = {rank[i] for i in torch.nonzero(masked.isfinite()).flatten().tolist()}
    assert kept == expected


def test_top_k_then_top_p_per_row() -> None:
    """Rows carry their own k and p; top-p applies to the distribution renormalized after top-k
    (vLLM's order): after k=2, [0.5, 0.3] becomes [0.625, 0.375]."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(4, -1)
    masked = apply_top_k_top_p(
        logits, torch.tensor([2, 2, 0, 3]), torch.tensor([0.6, 0.7, 0.6, 1.0])
    )
    kept = [set(torch.nonzero(r.isfinite()).flatten().tolist()) for r in masked]
    assert kept == [{0}, {0, 1}, {0, 1}, {0, 1, 2}]


def test_top_p_restricts_sampled_support() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    samples = draw(probs.log(), 20_000, top_p=0.75)
    assert set(samples.unique().tolist()) == {0, 1}
    assert_matches(samples, torch.tensor([0.625, 0.375, 0.0, 0.0]))


# ---- the sampled distribution ---------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_frequencies_match_softmax(temperature: float) -> None:
    samples = draw(LOGITS, 200_000, seed=7, temperature=temperature)
    assert_matches(samples, (LOGITS / temperature).softmax(-1))


def test_greedy_rows_and_sampled_rows_in_one_batch() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    batch = batch_of(3)
    batch.temperature = torch.tensor([0.0, 1.0, 0.0])
    for seed in range(20):
        tokens = Sampler(seed, torch.device("cpu"))(logits.clone(), batch)
        assert tokens[0] == tokens[2] == LOGITS.argmax()


def test_suppressed_ids_are_never_drawn() -> None:
    best = int(LOGITS.argmax())
    n = 5000
    samples = Sampler(0, torch.device("cpu"))(
        LOGITS.expand(n, -1).clone(), batch_of(n, suppress={r: [best, 6] for r in range(n)})
    )
    assert best not in samples.tolist() and 6 not in samples.tolist()
    greedy = Sampler(0, torch.device("cpu"))(
        LOGITS.unsqueeze(0).clone(), batch_of(1, temperature=0.0, suppress={0: [best]})
    )
    assert int(greedy[0]) == int(LOGITS.topk(2).indices[1])


def test_sampler_seed_reproduces() -> None:
    a = draw(LOGITS, 1000, seed=3)
    assert torch.equal(a, draw(LOGITS, 1000, seed=3))
    assert not torch.equal(a, draw(LOGITS, 1000, seed=4))


# ---- in the engine --------------------------------------------------------------------------


def sampled(max_tokens: int = 16, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def test_seeded_request_ignores_batch_composition(make_tiny) -> None:
    llm = make_tiny()
    prompt = [700, 701, 702, 703]
    alone = llm.generate(prompt, sampled(seed=1234))[0].token_ids
    assert len(alone) == 16
    others = ["Some other prompt", [50, 51], "and a third one that is a bit longer than that"]
    batch_first = llm.generate(
        [prompt, *others],
        [
            sampled(seed=1234),
            sampled(),
            sampled(seed=9),
            SamplingParams(temperature=0.0, max_tokens=5),
        ],
    )[0].token_ids
    batch_last = llm.generate(
        [*others, prompt], [sampled(top_k=5), sampled(40), sampled(top_p=0.5), sampled(seed=1234)]
    )[-1].token_ids
    # a fresh engine (its shared generator not advanced by the batches above); the engine seed
    # stays the same since it also seeds the preset's dummy weights
    fresh = make_tiny().generate(prompt, sampled(seed=1234))[0].token_ids
    other_kv = make_tiny(kv_cache="none").generate(prompt, sampled(seed=1234))[0].token_ids
    assert alone == batch_first == batch_last == fresh == other_kv


def test_a_top_k_beyond_any_vocabulary_is_top_k_off(tiny_llm: LLM) -> None:
    """top_k=10**400 is a valid integer: it keeps every token, as top_k=0 does, rather than
    failing the step when it is converted for the batch (OverflowError)."""

    def sample(top_k: int) -> list[int]:
        params = SamplingParams(max_tokens=5, temperature=1.0, top_k=top_k, seed=7)
        return tiny_llm.generate([[3, 4, 5]], params)[0].outputs[0].token_ids

    assert sample(10**400) == sample(0) == sample(2**63)


def test_different_seeds_differ(tiny_llm: LLM) -> None:
    outs = tiny_llm.generate([[700, 701, 702, 703]] * 4, [sampled(seed=s) for s in (1, 2, 3, 1)])
    tokens = [tuple(o.token_ids) for o in outs]
    assert tokens[0] == tokens[3]
    assert len(set(tokens)) == 3


def test_unseeded_requests_follow_the_engine_seed(make_tiny) -> None:
    prompts = [[700, 701], [800, 801, 802]]
    a = [o.token_ids for o in make_tiny(seed=5).generate(prompts, sampled())]
    b = [o.token_ids for o in make_tiny(seed=5).generate(prompts, sampled())]
    c = [o.token_ids for o in make_tiny(seed=6).generate(prompts, sampled())]
    assert a == b
    assert a != c
    assert a[0] != a[1]  # two requests in one batch get different draws


@pytest.mark.parametrize("max_tokens", [1, 7, 33])
def test_ignore_eos_gives_exact_lengths(tiny_llm: LLM, max_tokens: int) -> None:
    outs = tiny_llm.generate(
        ["one", [900, 901], "three three three"],
        [
            sampled(max_tokens, top_k=50),
            sampled(max_tokens),
            SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        ],
    )
    for out in outs:
        assert len(out.token_ids) == max_tokens
        assert out.finish_reason == "length"


def test_ignore_eos_continues_past_eos(make_tiny) -> None:
    llm = make_tiny()
    full = llm.generate(
        [910, 911], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    )[0].token_ids
    llm = make_tiny(model_overrides={"eos_token_ids": [full[0]]})
    out = llm.generate([910, 911], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[
        0
    ]
    assert out.token_ids == full and out.finish_reason == "length"


@pytest.mark.parametrize("min_tokens", [1, 5, 12])
def test_min_tokens_defers_stop_token(tiny_llm: LLM, min_tokens: int) -> None:
    prompt = [920, 921, 922]
    first = tiny_llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=12))[0]
    stop_id = first.token_ids[0]  # the greedy next token
    stopped = tiny_llm.generate(
        prompt, SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_id])
    )[0]
    assert stopped.token_ids == [stop_id] and stopped.finish_reason == "stop"
    out = tiny_llm.generate(
        prompt,
        SamplingParams(
            temperature=0.0, max_tokens=12, stop_token_ids=[stop_id], min_tokens=min_tokens
        ),
    )[0]
    assert len(out.token_ids) >= min_tokens
    assert stop_id not in out.token_ids[:min_tokens]
    if stop_id in out.token_ids:  # once allowed again, it stops the request
        assert out.token_ids.index(stop_id) == len(out.token_ids) - 1
        assert out.finish_reason == "stop"
    else:
        assert out.finish_reason == "length"


def test_min_tokens_defers_eos(make_tiny) -> None:
    prompt = [930, 931]
    greedy = make_tiny().generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0]
    eos = greedy.token_ids[0]
    llm = make_tiny(model_overrides={"eos_token_ids": [eos]})
    assert llm.generate(prompt, SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids == [eos]
    for params in (
        SamplingParams(temperature=0.0, max_tokens=8, min_tokens=5),
        SamplingParams(temperature=1.0, max_tokens=8, min_tokens=5, seed=0),
    ):
        out = llm.generate(prompt, params)[0]
        assert len(out.token_ids) >= 5
        assert eos not in out.token_ids[:5]


@pytest.mark.parametrize(
    ("field", "kwargs", "allowed"),
    [
        ("max_tokens", {"max_tokens": 0}, "an integer >= 1"),
        ("temperature", {"temperature": float("nan")}, "a number >= 0"),
        ("top_p", {"top_p": 0.0}, "a number in (0, 1]"),
        ("top_k", {"top_k": -2}, "-1 or 0 (disabled)"),
        ("min_tokens", {"max_tokens": 4, "min_tokens": 5}, "an integer in [0, max_tokens=4]"),
        ("n", {"n": 0}, "an integer >= 1"),
        # sample i of n is seeded seed + i: the last one must still be a valid generator seed
        ("seed", {"seed": 2**64 - 1, "n": 2}, "[-2^63, 2^64 - 2] (one per sample)"),
        ("seed", {"seed": 2**64 - 3, "n": 2, "best_of": 4}, "[-2^63, 2^64 - 4]"),
        ("seed", {"seed": -(2**63) - 1}, "[-2^63, 2^64 - 1]"),
        ("stop", {"stop": [""]}, "a list of non-empty strings"),
        ("best_of", {"n": 3, "best_of": 2}, "null or an integer >= n=3"),
    ],
)
def test_invalid_sampling_params_name_the_field(field: str, kwargs: dict, allowed: str) -> None:
    with pytest.raises(ValueError, match=rf"SamplingParams\.{field}: .* allowed: ") as info:
        SamplingParams(**kwargs)
    assert allowed in str(info.value)


def test_largest_seed_for_n_samples_is_accepted() -> None:
    assert SamplingParams(seed=2**64 - 2, n=2).seed == 2**64 - 2
