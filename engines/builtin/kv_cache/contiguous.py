"""Contiguous KV: every running sequence owns one max_model_len region, reserved up front.

This is the pre-PagedAttention layout the seeds criticise: a short sequence still reserves the
whole maximum length, so most reserved bytes hold nothing (internal fragmentation) and the
budget admits few sequences.
"""

from __future__ import annotations

from engines.builtin.kv_cache.base import KVCacheManager, KVLayout


class ContiguousKVCacheManager(KVCacheManager):
    def __init__(self, layout: KVLayout) -> None:
        super().__init__(layout)
        self.free_slots = list(range(layout.num_blocks - 1, -1, -1))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        if num_tokens > self.layout.block_size:
            return False
        return seq_id in self.block_tables or bool(self.free_slots)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        if num_tokens > self.layout.block_size:
            raise ValueError(f"{num_tokens} tokens exceed the {self.layout.block_size}-token "
                             "region of a contiguous KV slot")
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

    def bytes_reserved(self) -> int:
        return len(self.block_tables) * self.layout.block_size * self.layout.bytes_per_token
