"""Prompt-lookup n-gram proposals (vLLM's `ngram` method): find the sequence's last n tokens
earlier in the sequence (prompt and output alike), longest n first, and propose the tokens
that followed that occurrence. No model and no state: it costs a byte search per sequence, so
it is nearly free when it finds nothing."""

from __future__ import annotations

from array import array
from collections.abc import Sequence as Seq

from engines.builtin.sequence import Sequence
from engines.builtin.spec_decode.config import SpeculativeConfig
from engines.builtin.spec_decode.proposer import PROPOSERS, Proposal, Proposer, ProposerContext

_ITEM = array("i").itemsize  # token ids as C ints: a match must start on an item boundary


def lookup(tokens: Seq[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest suffix of
    `tokens` of length max_n down to min_n; [] when none recurs."""
    length = len(tokens)
    if k < 1 or length < min_n + 1:
        return []
    data = array("i", tokens).tobytes()
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = data[(length - n) * _ITEM :]
        # an occurrence that ends before the last token, so that a token follows it
        end = (length - 1) * _ITEM
        while True:
            found = data.rfind(pattern, 0, end)
            if found < 0:
                break
            if found % _ITEM == 0:
                start = found // _ITEM + n
                return list(tokens[start : start + k])
            end = found + len(pattern) - 1  # matched across items: look further left
    return []


@PROPOSERS.register("ngram")
class NgramProposer(Proposer):
    name = "ngram"

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        super().__init__(config, context)
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Proposal]:
        return [
            Proposal(lookup(seq.token_ids, self.min_n, self.max_n, min(self.k, limit)))
            for seq, limit in zip(seqs, limits, strict=True)
        ]

    def release(self, seq: Sequence) -> None:
        pass  # nothing is kept per sequence: every lookup reads its tokens afresh

    def describe(self) -> dict[str, object]:
        return {"prompt_lookup_min": self.min_n, "prompt_lookup_max": self.max_n}
