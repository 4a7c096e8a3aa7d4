"""Contiguous KV: every running sequence owns one max_model_len region, reserved up front.

This is the pre-PagedAttention layout the seeds criticise: a short sequence still reserves the
whole maximum length, so most reserved bytes hold nothing (internal fragmentation) and the
budget admits few sequences.
"""

from __future__ import annotations

from engines.builtin.kv_cache.base import KVCacheManager, KVLayout


class ContiguousKVCacheManager(KVCacheManager):
    """`ring=True` (a sliding-window model): each region holds only the window, written
    round-robin, so KV memory per sequence stops growing at the window."""

    def __init__(self, layout: KVLayout, ring: bool = False) -> None:
        super().__init__(layout)
        self.ring = ring
        self.free_slots = list(range(layout.num_blocks - 1, -1, -1))
        self._copies: list[tuple[int, int]] = []

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        if num_tokens > self.layout.block_size and not self.ring:
            return False
        return seq_id in self.block_tables or bool(self.free_slots)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        if num_tokens > self.layout.block_size and not self.ring:
            raise ValueError(
                f"{num_tokens} tokens exceed the {self.layout.block_size}-token "
                "region of a contiguous KV slot"
            )
        if seq_id in self.block_tables:
            return []
        if not self.free_slots:
            raise RuntimeError("no free contiguous KV slot")
        slot = self.free_slots.pop()
        self.block_tables[seq_id] = [slot]
        return [slot]

    def free(self, seq_id: int) -> list[int]:
        blocks = self.block_tables.pop(seq_id, [])
        self.tokens_held.pop(seq_id, None)
        self.free_slots.extend(reversed(blocks))
        return blocks

    def can_fork(self, parent_id: int, child_id: int) -> bool:
        return bool(self.free_slots)

    def fork(self, parent_id: int, child_id: int) -> None:
        """A contiguous slot cannot be shared: the child gets its own slot and a full copy of
        the parent's (the copy is the cost paged KV's block sharing avoids)."""
        slot = self.free_slots.pop()
        self.block_tables[child_id] = [slot]
        self.tokens_held[child_id] = self.tokens_held.get(parent_id, 0)
        self._copies.append((self.block_tables[parent_id][0], slot))

    def take_copies(self) -> list[tuple[int, int]]:
        copies, self._copies = self._copies, []
        return copies

    def bytes_used(self) -> int:
        if not self.ring:
            return super().bytes_used()
        window = self.layout.block_size
        return sum(min(n, window) for n in self.tokens_held.values()) * self.layout.bytes_per_token

    def bytes_reserved(self) -> int:
        return len(self.block_tables) * self.layout.block_size * self.layout.bytes_per_token
