"""Penalties, logit_bias and token masks on the logits before temperature, batched.

vLLM's definitions and order (v1 sampler): allowed_token_ids' mask, bad_words' mask,
logit_bias, then the penalties: repetition (HF's: over prompt and output tokens, a positive
logit divided by it and a negative one multiplied) and frequency/presence (OpenAI's: minus
penalty * count and penalty * [count > 0] over the output tokens). Only the rows that ask are
touched; a step where none asks builds nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from engines.builtin.sequence import Sequence
from engines.sampling_params import SamplingParams


def bad_words_token_ids(
    words: Seq[str], encode: Callable[[str], Seq[int]], vocab_size: int
) -> list[list[int]]:
    """Each bad word's token sequences as vLLM builds them: the word without leading spaces,
    and with one leading space where that tokenizes differently into as many tokens (a word in
    the middle of a text). ValueError naming bad_words if an id falls outside the vocabulary."""
    found: list[list[int]] = []
    for word in words:
        bare = list(encode(word.lstrip()))
        spaced = list(encode(" " + word.lstrip()))
        found += [ids for ids in (bare,) if ids]
        if spaced and bare and spaced[0] != bare[0] and len(spaced) == len(bare):
            found.append(spaced)
    outside = sorted({t for ids in found for t in ids if not 0 <= t < vocab_size})
    if outside:
        raise ValueError(
            f"SamplingParams.bad_words: token ids {outside[:5]} are outside the vocabulary "
            f"[0, {vocab_size})"
        )
    return found


def banned_by_bad_words(bad_words: Seq[Seq[int]], output: Seq[int]) -> list[int]:
    """The ids a row may not sample next: each bad word's last token where the output ends
    with the rest of the word (a one-token word always)."""
    banned = []
    for word in bad_words:
        prefix = list(word[:-1])
        if not prefix or list(output[len(output) - len(prefix) :]) == prefix:
            banned.append(word[-1])
    return banned


def _padded(rows: Seq[Seq[int]], pad: int, device: torch.device) -> torch.Tensor:
    """[len(rows), longest] int64, short rows filled with `pad` (one host-to-device copy)."""
    width = max(1, max((len(r) for r in rows), default=0))
    table = [list(r) + [pad] * (width - len(r)) for r in rows]
    return torch.tensor(table, dtype=torch.int64).to(device)


#: The largest logit a repetition penalty below 1 may raise a seen token to: far above any
#: model's logits, and 1e8 below float32's maximum, so temperature's division (by as little as
#: 1e-5, sampler.py) stays finite too
MAX_PENALIZED_LOGIT = 1e30

#: stands for "no token" in padded id tables; clamped to the logits' width, one spare column
PAD = 2**62


@dataclass
class LogitsAdjustments:
    """The penalties and masks of the rows that ask for any, as tensors for one step."""

    rows: torch.Tensor  # [R] int64: their rows in the batch
    presence: torch.Tensor | None  # [R] float32; None: no row asks
    frequency: torch.Tensor | None
    repetition: torch.Tensor | None
    output_ids: torch.Tensor  # [R, L] int64, PAD-filled: each row's output tokens so far
    context_ids: torch.Tensor | None  # [R, P + L]: prompt and output, for repetition
    bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # (row, id, value) triples
    allowed: tuple[torch.Tensor, torch.Tensor] | None  # (row, id) pairs
    allowed_rows: torch.Tensor | None  # [R] bool: which rows restrict their tokens
    banned: tuple[torch.Tensor, torch.Tensor] | None  # (row, id) pairs

    @classmethod
    def build(
        cls,
        seqs: Seq[Sequence],
        drafts: Seq[Seq[int]] | None,
        device: torch.device,
    ) -> LogitsAdjustments | None:
        """None when no row asks. `drafts[row]`: tokens the row comes after beyond its
        sequence's own (speculative decoding's drafts before its position): they count as
        output."""
        rows = [i for i, s in enumerate(seqs) if s.sampling.adjusts_logits]
        if not rows:
            return None
        params = [seqs[i].sampling for i in rows]
        outputs = [
            seqs[i].output_token_ids + ([] if drafts is None else list(drafts[i])) for i in rows
        ]
        table = torch.tensor(
            [[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
            dtype=torch.float32,
        ).to(device)
        any_repetition = any(p.repetition_penalty != 1.0 for p in params)
        return cls(
            rows=torch.tensor(rows, dtype=torch.int64).to(device),
            presence=table[:, 0] if any(p.presence_penalty for p in params) else None,
            frequency=table[:, 1] if any(p.frequency_penalty for p in params) else None,
            repetition=table[:, 2] if any_repetition else None,
            output_ids=_padded(outputs, PAD, device),
            context_ids=(
                _padded(
                    [seqs[i].prompt_token_ids + o for i, o in zip(rows, outputs, strict=True)],
                    PAD,
                    device,
                )
                if any_repetition
                else None
            ),
            bias=_bias_triples(params, device),
            allowed=_pairs(
                [(r, t) for r, p in enumerate(params) for t in p.allowed_token_ids or ()], device
            ),
            allowed_rows=torch.tensor([p.allowed_token_ids is not None for p in params]).to(device),
            banned=_pairs(
                [
                    (r, t)
                    for r, i in enumerate(rows)
                    for t in banned_by_bad_words(seqs[i].bad_words_token_ids, outputs[r])
                ],
                device,
            ),
        )

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """float32 logits [B, V] -> the same with these rows adjusted (in place)."""
        sub = logits[self.rows]
        vocab = sub.shape[-1]
        if self.allowed is not None and self.allowed_rows is not None:
            keep = self._marked(self.allowed, vocab) | ~self.allowed_rows.unsqueeze(-1)
            sub = sub.masked_fill(~keep, float("-inf"))
        if self.banned is not None:
            sub = sub.masked_fill(self._marked(self.banned, vocab), float("-inf"))
        if self.bias is not None:
            row, ids, values = self.bias
            added = torch.zeros(sub.shape[0], vocab + 1, device=sub.device)
            added.index_put_((row, ids.clamp(max=vocab)), values, accumulate=True)
            sub = sub + added[:, :vocab]
        if self.repetition is not None and self.context_ids is not None:
            seen = self._seen(self.context_ids, vocab)
            # A penalty past float32's range (1e-40 is 0 there, 1e39 is inf) and a quotient
            # that overflows (10 / 1e-38) would give 0 * inf = NaN or a +inf logit, whose
            # softmax is NaN: the sampler then draws token 0 over and over. Clamped, a tiny
            # penalty makes a seen token all but certain and a huge one all but impossible,
            # its meaning; -inf (a masked token) stays -inf.
            finfo = torch.finfo(sub.dtype)
            rep = self.repetition.clamp(min=finfo.tiny, max=finfo.max).unsqueeze(-1)
            divided = (sub / rep).clamp(max=MAX_PENALIZED_LOGIT)
            sub = torch.where(seen, torch.where(sub > 0, divided, sub * rep), sub)
        if self.presence is not None or self.frequency is not None:
            counts = torch.zeros(sub.shape[0], vocab + 1, device=sub.device)
            ids = self.output_ids.clamp(max=vocab)
            counts.scatter_add_(-1, ids, torch.ones_like(ids, dtype=counts.dtype))
            counts = counts[:, :vocab]
            if self.frequency is not None:
                sub = sub - self.frequency.unsqueeze(-1) * counts
            if self.presence is not None:
                sub = sub - self.presence.unsqueeze(-1) * (counts > 0).float()
        logits[self.rows] = sub
        return logits

    def _marked(self, pairs: tuple[torch.Tensor, torch.Tensor], vocab: int) -> torch.Tensor:
        """[R, V] bool, True at each (row, id) pair; ids past the logits' width go to a spare
        column that is dropped (they are never sampled)."""
        row, ids = pairs
        marked = torch.zeros(self.rows.shape[0], vocab + 1, dtype=torch.bool, device=row.device)
        marked[row, ids.clamp(max=vocab)] = True
        return marked[:, :vocab]

    def _seen(self, ids: torch.Tensor, vocab: int) -> torch.Tensor:
        """[R, V] bool: which ids each row's padded id table holds."""
        seen = torch.zeros(ids.shape[0], vocab + 1, dtype=torch.bool, device=ids.device)
        return seen.scatter_(-1, ids.clamp(max=vocab), True)[:, :vocab]


def _pairs(
    pairs: list[tuple[int, int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rows, ids) as two int64 tensors (one copy), or None when there are none."""
    if not pairs:
        return None
    table = torch.tensor(pairs, dtype=torch.int64).T.to(device)
    return table[0], table[1]


def _bias_triples(
    params: Seq[SamplingParams], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Every row's logit_bias as (row, id, value) tensors, or None when no row has one."""
    triples = [
        (r, token, value)
        for r, p in enumerate(params)
        for token, value in (p.logit_bias or {}).items()
    ]
    if not triples:
        return None
    row_ids = torch.tensor([(r, t) for r, t, _ in triples], dtype=torch.int64).T.to(device)
    values = torch.tensor([v for _, _, v in triples], dtype=torch.float32).to(device)
    return row_ids[0], row_ids[1], values
