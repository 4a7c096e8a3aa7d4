"""Vectorized sampling over the batch: greedy, temperature, top-k, top-p, min_p, min_tokens,
and the penalties / logit_bias / token masks of engines/builtin/penalties.py.

vLLM's order: min_tokens' masks, then the penalties and masks on the raw logits (so they
change a greedy row's argmax too), then temperature, then min_p, top-k and top-p.

One sort of the logits serves top-k and top-p together. Sampling is the exponential race
(argmax of p / q with q ~ Exp(1)), which equals drawing from p; seeded requests draw their q
from their own generator, so their outputs do not depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engines.builtin.penalties import LogitsAdjustments
from engines.builtin.sequence import Sequence

TOP_K_CAP = 2**31  # past any vocabulary: the same as top-k off


class NonFiniteLogitsError(RuntimeError):
    """The logits a step samples from hold NaN or infinity: whatever it sampled would be
    noise (argmax over NaN is token 0), so the step fails with this instead."""


def non_finite_logits(logits: torch.Tensor, step: int) -> NonFiniteLogitsError:
    """The error for logits found non-finite (the caller's one reduction found them; this
    looks closer, only on that path)."""
    kind = "NaN" if bool(logits.isnan().any()) else "inf"
    return NonFiniteLogitsError(
        f"non-finite logits ({kind}) at step {step}: the model's weights or config produce {kind}"
    )


@dataclass
class SamplingBatch:
    """Per-row sampling parameters as tensors, built once per step."""

    temperature: torch.Tensor  # [B] float; rows with 0 are greedy
    top_k: torch.Tensor  # [B] int64; 0 = off
    top_p: torch.Tensor  # [B] float
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    # rows whose EOS / stop ids are masked because min_tokens is not reached yet
    suppress_rows: list[int]
    suppress_ids: list[list[int]]
    generators: list[torch.Generator | None]
    # penalties, logit_bias, allowed_token_ids, bad_words of the rows that ask; None: none asks
    adjustments: LogitsAdjustments | None = None
    min_p: torch.Tensor | None = None  # [B] float, 0 = off; None: no row asks

    @classmethod
    def from_sequences(
        cls,
        seqs: Seq[Sequence],
        eos_ids: Seq[int],
        device: torch.device,
        offsets: Seq[int] | None = None,
        drafts: Seq[Seq[int]] | None = None,
    ) -> SamplingBatch:
        """One row per sequence; `offsets[row]`: output tokens the row's token comes after
        beyond the sequence's own (speculative decoding scores positions past drafts);
        `drafts[row]`: those tokens, where known (the penalties count them as output)."""
        params = [s.sampling for s in seqs]
        suppress_rows, suppress_ids = [], []
        for row, seq in enumerate(seqs):
            p = seq.sampling
            ahead = 0 if offsets is None else offsets[row]
            # a grammar decides where a constrained output ends: min_tokens holding its stop
            # tokens back would leave the row nothing to sample
            if (
                p.min_tokens
                and seq.grammar is None
                and seq.num_output_tokens + ahead < p.min_tokens
            ):
                suppress_rows.append(row)
                suppress_ids.append(list(eos_ids) + list(p.stop_token_ids))
        # One host-to-device copy for the four per-row parameters; float64 holds the
        # float32 values and the integer top_k exactly (capped: a top_k past the vocabulary
        # keeps every token, and 10**400 would not even convert to a float).
        table = torch.tensor(
            [
                [p.temperature for p in params],
                [float(min(max(p.top_k, 0), TOP_K_CAP)) for p in params],
                [p.top_p for p in params],
                [p.min_p for p in params],
            ],
            dtype=torch.float64,
        ).to(device)
        return cls(
            temperature=table[0].float(),
            top_k=table[1].long(),
            top_p=table[2].float(),
            all_greedy=all(p.temperature == 0.0 for p in params),
            any_top_k=any(p.top_k > 0 for p in params),
            any_top_p=any(p.top_p < 1.0 for p in params),
            suppress_rows=suppress_rows,
            suppress_ids=suppress_ids,
            generators=[s.generator for s in seqs],
            adjustments=LogitsAdjustments.build(seqs, drafts, device),
            min_p=table[3].float() if any(p.min_p > 0.0 for p in params) else None,
        )


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p * the row's top probability (vLLM's and
    HF's MinPLogitsWarper; the top token always stays; min_p 0 keeps every token)."""
    probs = logits.softmax(dim=-1)
    floor = min_p.unsqueeze(-1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < floor, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Mask logits outside each row's top-k and top-p support with -inf."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(-1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # Drop the low tail whose mass is at most 1 - p; the top token always stays.
        drop = cumulative <= (1 - top_p).unsqueeze(-1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [B, V] -> token ids [B]."""
        logits = self.masked(logits, batch)
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            return greedy_tokens
        sampled = self.race(self._processed(logits, batch), batch.generators)
        return torch.where(batch.temperature == 0.0, greedy_tokens, sampled)

    def distributions(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """logits [B, V] -> the distribution each row samples from [B, V]: min_tokens' masks,
        penalties and token masks, temperature, min_p, top-k, top-p; a greedy row's is one-hot
        at its argmax (speculative decoding's rejection sampler verifies drafts against
        these)."""
        logits = self.masked(logits, batch)
        greedy = torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        if batch.all_greedy:
            return greedy
        probs = self._processed(logits, batch)
        return torch.where((batch.temperature == 0.0).unsqueeze(-1), greedy, probs)

    def masked(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """float32 logits with EOS / stop ids masked on rows short of min_tokens, and the
        penalties, logit_bias and token masks of the rows that ask for them."""
        raw = logits
        logits = logits.float()
        # every (row, id) to mask in one indexed write (ids past the sampled vocabulary are
        # never drawn anyway)
        pairs = [
            (row, i)
            for row, ids in zip(batch.suppress_rows, batch.suppress_ids, strict=True)
            for i in ids
            if i < logits.shape[-1]
        ]
        if (pairs or batch.adjustments is not None) and logits is raw:
            logits = logits.clone()  # the caller's logits stay raw (logprobs read them)
        if pairs:
            index = torch.tensor(pairs, dtype=torch.int64).T.to(logits.device)
            logits[index[0], index[1]] = float("-inf")
        if batch.adjustments is not None:
            logits = batch.adjustments.apply(logits)
        return logits

    def _processed(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        temperature = batch.temperature.clamp(min=1e-5).unsqueeze(-1)
        logits = logits / temperature
        if batch.min_p is not None:
            logits = apply_min_p(logits, batch.min_p)
        if batch.any_top_k or batch.any_top_p:
            logits = apply_top_k_top_p(
                logits,
                batch.top_k if batch.any_top_k else None,
                batch.top_p if batch.any_top_p else None,
            )
        return logits.softmax(dim=-1)

    def race(self, weights: torch.Tensor, generators: Seq[torch.Generator | None]) -> torch.Tensor:
        """A draw per row in proportion to `weights` [B, V] (non-negative, unnormalized):
        the argmax of weights / q with q ~ Exp(1), each row's q from its own generator when it
        has one."""
        race = torch.empty_like(weights).exponential_(generator=self.generator)
        for i, gen in enumerate(generators):
            if gen is not None:
                race[i].exponential_(generator=gen)
        race.clamp_(min=torch.finfo(race.dtype).tiny)  # Exp(1) can draw an exact 0
        return (weights / race).argmax(dim=-1)
