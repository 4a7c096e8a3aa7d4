"""What a speculative proposer is: given running sequences, a few tokens each is likely to
generate next, for the target model to verify in one pass. Proposers register by the name
`engine.speculative_config.method` takes, like every other plug point."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

import torch

from engines.builtin.kv_cache.base import KVCacheManager
from engines.builtin.sequence import Sequence
from engines.builtin.spec_decode.config import SpeculativeConfig
from engines.registry import Registry


@dataclass
class Proposal:
    """Draft tokens for one sequence. `probs` [len(token_ids), vocab]: the distribution each
    was drawn from (a draft model's, after the request's temperature / top-k / top-p); None
    when the proposer is deterministic (n-gram lookup: each draft's probability is 1)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None


@dataclass(frozen=True)
class ProposerContext:
    """What a proposer may use of the target engine, which it never imports."""

    sample_vocab_size: int  # token ids the target samples: the tokenizer's
    model_vocab_size: int  # rows of the target's LM head (the tokenizer's, or padded)
    encode: Callable[[str], list[int]]  # the target's tokenizer
    kv_cache: str  # the target's KV layout (engine.kv_cache)
    kv_cache_kind: type[KVCacheManager]  # its manager class: what it keeps
    max_model_len: int  # the target's: a draft must serve sequences as long
    # an engine of the same machinery with the target's options and these overrides (a draft
    # model's: its own model, dtype, quantization and KV cache)
    build_engine: Callable[[dict[str, Any]], Any]


class Proposer(ABC):
    name: str = ""

    def __init__(self, config: SpeculativeConfig, context: ProposerContext) -> None:
        self.k = config.num_speculative_tokens

    @abstractmethod
    def propose(self, seqs: Seq[Sequence], limits: Seq[int]) -> list[Proposal]:
        """Up to `limits[i]` draft tokens for `seqs[i]` (each past its last token)."""

    @abstractmethod
    def release(self, seq: Sequence) -> None:
        """Forget what is kept for `seq` (finished, aborted or preempted)."""

    def describe(self) -> dict[str, object]:
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the proposer holds (a draft model's engine); its engine's close()
        calls it."""


PROPOSERS = Registry[type[Proposer]]("engine.speculative_config.method")
