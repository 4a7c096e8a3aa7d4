"""Verification: which drafts a sequence keeps, by the speculative-sampling rule (Leviathan et
al. 2023; Chen et al. 2023), so that the tokens come out distributed exactly as the target's.

For draft d_i drawn from q_i, with the target's p_i at the same position: accept it with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw the replacement from the
residual max(0, p_i - q_i) (normalized) and stop; when all k are accepted draw a bonus token
from p_k. A deterministic proposer (n-gram lookup) has q_i one-hot at d_i: d_i is kept with
probability p_i(d_i) and a rejection draws from p_i without d_i. A greedy request's p_i is
one-hot at the target's argmax, so it keeps exactly the drafts the target would have produced.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from engines.builtin.sampler import Sampler, SamplingBatch
from engines.builtin.sequence import Sequence
from engines.builtin.spec_decode.proposer import Proposal


def acceptance(p: float, q: float) -> float:
    """The probability of keeping a draft the target gives p and the proposer gave q."""
    return 1.0 if p >= q else p / q


def verify(
    logits: torch.Tensor,
    seqs: Seq[Sequence],
    proposals: Seq[Proposal],
    sampler: Sampler,
    eos_ids: Seq[int],
) -> list[list[int]]:
    """logits [sum(len(drafts) + 1), V]: the target's at each sequence's last token and at each
    of its drafts, sequence after sequence. Returns each sequence's new tokens: the drafts it
    keeps, then one more (the replacement of the first rejected draft, or the bonus)."""
    counts = [len(p.token_ids) + 1 for p in proposals]
    row_seqs = [seq for seq, count in zip(seqs, counts, strict=True) for _ in range(count)]
    offsets = [i for count in counts for i in range(count)]
    # the drafts before each position count as output for the penalties and bad_words
    drafts = [
        p.token_ids[:i] for p, count in zip(proposals, counts, strict=True) for i in range(count)
    ]
    batch = SamplingBatch.from_sequences(row_seqs, eos_ids, logits.device, offsets, drafts)
    if batch.all_greedy:
        return _verify_greedy(sampler.masked(logits, batch).argmax(-1).tolist(), proposals)
    probs = sampler.distributions(logits, batch)
    out: list[list[int]] = []
    row = 0
    for seq, proposal, count in zip(seqs, proposals, counts, strict=True):
        out.append(_verify_one(probs[row : row + count], proposal, seq.generator, sampler))
        row += count
    return out


def _verify_greedy(targets: list[int], proposals: Seq[Proposal]) -> list[list[int]]:
    """targets: the target's argmax at every row. The drafts that match it, then its token at
    the first mismatch (or the bonus): kept drafts equal the target's tokens."""
    out, row = [], 0
    for proposal in proposals:
        drafts = proposal.token_ids
        mine = targets[row : row + len(drafts) + 1]
        kept = 0
        while kept < len(drafts) and drafts[kept] == mine[kept]:
            kept += 1
        out.append(mine[: kept + 1])
        row += len(drafts) + 1
    return out


def _verify_one(
    p: torch.Tensor, proposal: Proposal, generator: torch.Generator | None, sampler: Sampler
) -> list[int]:
    """p [k + 1, V]: the target's distributions; the proposal's k drafts."""
    gen = generator if generator is not None else sampler.generator
    tokens: list[int] = []
    for i, draft in enumerate(proposal.token_ids):
        q = None if proposal.probs is None else proposal.probs[i]
        q_draft = 1.0 if q is None else float(q[draft])
        u = float(torch.rand((), generator=gen, device=p.device))
        if u < acceptance(float(p[i, draft]), q_draft):
            tokens.append(draft)
            continue
        if q is None:
            residual = p[i].clone()
            residual[draft] = 0.0
        else:
            residual = (p[i] - q).clamp_(min=0.0)
        if not float(residual.sum()) > 0.0:  # p == q to rounding: nothing left to favour
            residual = p[i]
        tokens.append(int(sampler.race(residual.unsqueeze(0), [generator])[0]))
        return tokens
    tokens.append(int(sampler.race(p[-1:], [generator])[0]))  # all kept: the bonus
    return tokens
