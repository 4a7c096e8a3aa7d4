"""Speculative decoding: proposers (n-gram lookup, a draft model) suggest a few tokens per
sequence, the target model scores them all in one pass, and the rejection sampler keeps the
longest prefix the target's distribution allows (docs/engine_options.md, issue 19)."""

from engines.builtin.spec_decode import ngram  # noqa: F401  (registers the proposer)
from engines.builtin.spec_decode.config import SpeculativeConfig
from engines.builtin.spec_decode.proposer import PROPOSERS, Proposal, Proposer

__all__ = ["PROPOSERS", "Proposal", "Proposer", "SpeculativeConfig"]
