"""The KV cache manager: which cache memory each sequence owns, and what it holds.

The manager lives on the host. The scheduler asks it whether a sequence's next tokens fit and
to reserve them; the model runner asks it for block tables. It accounts two numbers that the
seeds' argument is about: bytes reserved (set aside for sequences) and bytes holding tokens.
`bytes_per_token` includes any per-token scale planes a quantized cache keeps.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engines.builtin.kv_cache.tiers import BlockTransfer, KVTierStore


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
    #: Whether K/V live in blocks handed out from one pool as sequences grow (kv_cache=paged):
    #: blocks can be shared (prefix caching), and the pool's size bounds one request.
    pages_blocks: bool = False

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self.block_tables: dict[int, list[int]] = {}
        self.tokens_held: dict[int, int] = {}
        #: where evicted cached blocks go (tiers.py; paged KV with prefix caching only)
        self.tiers: KVTierStore | None = None
        #: the last match_prefix's tokens loaded from each KV tier (empty: no tiers)
        self.last_match_tiers: dict[str, int] = {}

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @abstractmethod
    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        """Could the sequence hold `num_tokens` tokens in total after its next step?"""

    @abstractmethod
    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Reserve room for `num_tokens` tokens in total; return newly allocated block ids."""

    def blocks_to_hold(self, num_tokens: int, step_tokens: int | None = None) -> int:
        """The most blocks one sequence of `num_tokens` tokens holds at once, when no step
        writes more than `step_tokens` of them (None: one step may write them all, a prompt
        prefilled whole or recomputed after a preemption)."""
        return -(-num_tokens // self.block_size)

    @abstractmethod
    def free(self, seq_id: int) -> list[int]:
        """Release the sequence's memory; return the freed block ids."""

    @abstractmethod
    def bytes_reserved(self) -> int:
        """Bytes set aside for live sequences."""

    def commit(
        self,
        seq_id: int,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        namespace: str | None = None,
    ) -> None:
        """Record that the sequence's cache now holds its first `num_tokens` tokens
        (`token_ids`: all of its tokens, for managers that hash full blocks; `namespace`: what
        else its K/V depend on, a LoRA adapter, so that no other namespace reuses them)."""
        self.tokens_held[seq_id] = num_tokens

    def truncate(self, seq_id: int, num_tokens: int) -> list[int]:
        """Keep room for the sequence's first `num_tokens` tokens only (speculative decoding's
        rejected drafts); return the freed block ids. Slots past them need no reset: the
        sequence's count stops before them, and its next tokens overwrite them."""
        return []

    def match_prefix(
        self, seq_id: int, token_ids: Sequence[int], namespace: str | None = None
    ) -> int:
        """Adopt cached blocks holding a prefix of `token_ids` computed in the same
        `namespace` (see commit); return the tokens covered."""
        return 0

    def prefetch_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> int:
        """Start reading ahead the tier blocks a later match_prefix of `token_ids` would load
        from disk; return the reads started."""
        return 0

    def take_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write block copies (src, dst) to perform before the next forward."""
        return []

    def take_transfers(self) -> list[BlockTransfer]:
        """Block saves to and loads from KV tiers (tiers.py) to run, in order, before the
        next forward and its copies."""
        return []

    def abandon_transfers(self, transfers: list[BlockTransfer]) -> None:
        """Transfers from take_transfers that did not run (the step failed first)."""
        raise NotImplementedError(f"{type(self).__name__} keeps no KV tiers")

    def load_blocks(self, seq_id: int, first_block: int, payloads: torch.Tensor) -> None:
        """Plan loads of K/V computed elsewhere into the sequence's blocks (paged KV only)."""
        raise NotImplementedError(f"{type(self).__name__} has no block table to load into")

    def can_fork(self, parent_id: int, child_id: int) -> bool:
        """Can the child start from the parent's KV now (parallel sampling)?"""
        return False

    def fork(self, parent_id: int, child_id: int) -> None:
        """Give the child the parent's KV: shared blocks, or a copy."""
        raise NotImplementedError(f"{type(self).__name__} cannot fork sequences")

    def bytes_used(self) -> int:
        return sum(self.tokens_held.values()) * self.layout.bytes_per_token

    def block_table(self, seq_id: int) -> list[int]:
        return self.block_tables.get(seq_id, [])

    def group_block_table(self, group: int, seq_id: int) -> list[int]:
        """The table of KV group `group` (kv_cache/groups.py; only a hybrid manager has more
        than group 0)."""
        if group:
            raise ValueError(f"{type(self).__name__} keeps one KV group; asked for group {group}")
        return self.block_table(seq_id)

    @property
    def num_live(self) -> int:
        return len(self.block_tables)

    @property
    def num_blocks_in_use(self) -> int:
        return sum(len(table) for table in self.block_tables.values())

    @property
    def num_shared_blocks(self) -> int:
        """Blocks that more than one sequence's table holds (only paged blocks are shared)."""
        return 0
