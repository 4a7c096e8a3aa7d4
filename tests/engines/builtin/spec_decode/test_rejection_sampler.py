"""The rejection sampler against the distribution it must reproduce: with temperature 1 on a
small vocabulary, the tokens that come out of verification are distributed as the target's,
whatever the proposer drew (a draft model's q, or a deterministic n-gram guess); a wrong
acceptance rule is caught by the same test."""

from __future__ import annotations

import pytest
import torch

from engines.builtin.sampler import Sampler
from engines.builtin.sequence import Sequence
from engines.builtin.spec_decode import rejection_sampler
from engines.builtin.spec_decode.proposer import Proposal
from engines.builtin.spec_decode.rejection_sampler import verify
from engines.sampling_params import SamplingParams

VOCAB = 6
SAMPLES = 30_000
# chi-square critical value for 5 degrees of freedom at p = 1e-4: a correct sampler fails
# once in 10,000 runs (fixed seeds: never); a 2% shift of one cell's probability (0.2 -> 0.22,
# 600 draws in 30,000) adds ~60 to the statistic
CRITICAL = 25.7

TARGET = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5], [0.0, 2.0, 1.0, 1.0, -0.5, 0.5]])
DRAFT = torch.tensor([0.05, 0.4, 0.3, 0.1, 0.1, 0.05])  # unlike the target on purpose


def sequences(count: int, temperature: float = 1.0) -> list[Sequence]:
    params = SamplingParams(temperature=temperature, max_tokens=8)
    return [Sequence(f"r{i}", [1, 2, 3], params, 0) for i in range(count)]


def chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=VOCAB).double()
    expected = probs.double() * len(tokens)
    return float(((observed - expected) ** 2 / expected).sum())


def first_and_second(proposals: list[Proposal], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify each proposal against TARGET (rows: after the last token, after draft 1, ...);
    return every first token, and the second tokens of the outputs that have one."""
    sampler = Sampler(seed, torch.device("cpu"))
    k = len(proposals[0].token_ids)
    rows = torch.cat([TARGET, TARGET[-1:].expand(k - 1, VOCAB)])  # k + 1 rows
    logits = rows.repeat(len(proposals), 1)
    out = verify(logits, sequences(len(proposals)), proposals, sampler, eos_ids=[])
    assert all(1 <= len(tokens) <= k + 1 for tokens in out)
    first = torch.tensor([tokens[0] for tokens in out])
    second = torch.tensor([tokens[1] for tokens in out if len(tokens) > 1])
    return first, second


def draft_proposals(k: int, seed: int) -> list[Proposal]:
    gen = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(DRAFT, SAMPLES * k, replacement=True, generator=gen)
    probs = DRAFT.expand(k, VOCAB)
    return [Proposal(drafts[i * k : (i + 1) * k].tolist(), probs) for i in range(SAMPLES)]


@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_tokens_follow_the_target(k: int) -> None:
    first, second = first_and_second(draft_proposals(k, seed=k), seed=10 + k)
    assert chi_square(first, TARGET[0].softmax(-1)) < CRITICAL
    # the next token (a kept draft, a replacement or the bonus) follows the next position's
    assert len(second) > SAMPLES // 4
    assert chi_square(second, TARGET[1].softmax(-1)) < CRITICAL


def test_ngram_guesses_keep_the_target_distribution() -> None:
    """A deterministic proposer (q one-hot at its guess): the guess is kept with the
    target's probability of it, and a rejection draws from the target without it."""
    proposals = [Proposal([1, 3]) for _ in range(SAMPLES)]
    first, second = first_and_second(proposals, seed=3)
    assert chi_square(first, TARGET[0].softmax(-1)) < CRITICAL
    assert chi_square(second, TARGET[1].softmax(-1)) < CRITICAL


@pytest.mark.parametrize(
    "wrong_rule",
    [
        lambda p, q: min(1.0, 1.25 * p / q),  # accepts too often
        lambda p, q: min(1.0, (p / q) ** 0.5),  # the wrong curve
    ],
    ids=["too-generous", "square-root"],
)
def test_a_wrong_acceptance_rule_fails_the_test(monkeypatch, wrong_rule) -> None:
    monkeypatch.setattr(rejection_sampler, "acceptance", wrong_rule)
    first, _ = first_and_second(draft_proposals(1, seed=1), seed=11)
    assert chi_square(first, TARGET[0].softmax(-1)) > CRITICAL


def test_greedy_keeps_exactly_the_drafts_the_target_would_produce() -> None:
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.full((7, VOCAB), -5.0)
    targets = [2, 4, 1, 0, 3, 3, 5]
    logits[range(7), targets] = 5.0
    proposals = [Proposal([2, 4]), Proposal([1, 5]), Proposal([])]  # rows 0-2, 3-5, 6
    out = verify(logits, sequences(3, 0.0), proposals, sampler, eos_ids=[])
    assert out == [[2, 4, 1], [0], [5]]  # all kept + bonus; first rejected; no drafts


def test_seeded_requests_verify_reproducibly() -> None:
    proposals = draft_proposals(2, seed=0)[:200]
    runs = []
    for sampler_seed in (1, 2):  # the engine's own generator differs; the request's does not
        seqs = sequences(200)
        for i, seq in enumerate(seqs):
            seq.generator = torch.Generator().manual_seed(i)
        logits = torch.cat([TARGET, TARGET[-1:]]).repeat(200, 1)
        runs.append(verify(logits, seqs, proposals, Sampler(sampler_seed, torch.device("cpu")), []))
    assert runs[0] == runs[1]
