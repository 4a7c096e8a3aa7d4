"""The KV cache manager: which cache memory each sequence owns, and what it holds.

The manager lives on the host. The scheduler asks it whether a sequence's next tokens fit and
to reserve them; the model runner asks it for block tables. It accounts two numbers that the
seeds' argument is about: bytes reserved (set aside for sequences) and bytes holding tokens.
`bytes_per_token` includes any per-token scale planes a quantized cache keeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    num_blocks: int
    block_size: int
    bytes_per_token: int  # over all layers, K and V, scales included

    @property
    def pool_bytes(self) -> int:
        return self.num_blocks * self.block_size * self.bytes_per_token


class KVCacheManager(ABC):
    #: Whether computed K/V survive the step. False only for kv_cache=none, where every step
    #: recomputes the whole context (the seeds' baseline).
    retains_kv: bool = True

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.block_tables: dict[int, list[int]] = {}
        self.tokens_held: dict[int, int] = {}

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @abstractmethod
    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Could the sequence hold `num_tokens` tokens in total after its next step?"""

    @abstractmethod
    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Reserve room for `num_tokens` tokens in total; return newly allocated block ids."""

    @abstractmethod
    def free(self, seq_id: int) -> list[int]:
        """Release the sequence's memory; return the freed block ids."""

    @abstractmethod
    def bytes_reserved(self) -> int:
        """Bytes set aside for live sequences."""

    def commit(self, seq_id: int, num_tokens: int) -> None:
        """Record that the sequence's cache now holds `num_tokens` tokens."""
        self.tokens_held[seq_id] = num_tokens

    def bytes_used(self) -> int:
        return sum(self.tokens_held.values()) * self.layout.bytes_per_token

    def block_table(self, seq_id: int) -> list[int]:
        return self.block_tables.get(seq_id, [])

    @property
    def num_live(self) -> int:
        return len(self.block_tables)
