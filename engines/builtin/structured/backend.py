"""The grammar backend's interface. A backend compiles a request's
constraint against the tokenizer's vocabulary once, then gives each sequence a matcher: which
tokens may come next (a bitmask row), and its state advanced token by token."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Protocol

import torch

from engines.structured_outputs import StructuredOutputsParams


class Matcher(Protocol):
    """One sequence's place in its grammar."""

    def accept(self, token: int) -> bool:
        """Advance past `token`; False if the grammar does not allow it (state unchanged)."""

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of the bitmask."""

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens (speculative drafts looked ahead)."""

    def fork(self) -> Matcher:
        """An independent copy at the same place (parallel sampling's samples)."""

    def is_terminated(self) -> bool:
        """Has the grammar ended (a stop token accepted after a complete match)?"""

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces next, without accepting them (jump-forward decoding;
        their tokenization may differ from the model tokenizer's)."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer; thread-safe `compile` (a frontend compiles
    outside the engine's step loop)."""

    name: str

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> object:
        """The compiled constraint; ValueError (the backend's own message) if it cannot be."""

    @abstractmethod
    def matcher(self, compiled: object) -> Matcher: ...

    @abstractmethod
    def allocate_bitmask(self, rows: int) -> torch.Tensor: ...

    @abstractmethod
    def apply_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
        """Set the logits of the tokens each row's mask forbids to -inf, in place, on `rows`."""
