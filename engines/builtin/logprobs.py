"""Log-probabilities of chosen tokens and of the most likely ones, from a step's logits.

One log-softmax over the rows that ask (float32), then a gather for the chosen tokens, their
rank (1 + how many tokens are strictly more likely) and a top-k; one device-to-host copy. The
logits are the model's raw output, as vLLM v1 reports by default (`raw_logprobs`): temperature,
top-k/top-p and min_tokens' masks shape what is sampled, not what is reported.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engines.base import TokenLogprob


def token_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, tops: Sequence[int]
) -> list[TokenLogprob]:
    """logits [R, V], the token at each row [R] and how many of the most likely to report per
    row -> one TokenLogprob per row."""
    if not len(tops):
        return []
    logprobs = logits.float().log_softmax(dim=-1)
    chosen = logprobs.gather(-1, tokens.view(-1, 1).long()).view(-1)
    ranks = (logprobs > chosen.unsqueeze(-1)).sum(dim=-1) + 1
    most = max(tops)
    top_values, top_ids = logprobs.topk(most, dim=-1) if most else (logprobs[:, :0], None)
    host_values = top_values.tolist()
    host_ids = top_ids.tolist() if top_ids is not None else [[] for _ in tops]
    return [
        TokenLogprob(
            token,
            logprob,
            rank,
            tuple(zip(host_ids[row][:k], host_values[row][:k], strict=True)),
        )
        for row, (token, logprob, rank, k) in enumerate(
            zip(tokens.tolist(), chosen.tolist(), ranks.tolist(), tops, strict=True)
        )
    ]
