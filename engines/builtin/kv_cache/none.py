"""No KV cache: nothing is kept between steps, so every step recomputes the whole context.
The quadratic baseline the seeds measure the KV cache against."""

from __future__ import annotations

from collections.abc import Sequence

from engines.builtin.kv_cache.base import KVCacheManager, KVLayout


class NoKVCacheManager(KVCacheManager):
    retains_kv = False

    def __init__(self, bytes_per_token: int) -> None:
        super().__init__(KVLayout(num_blocks=0, block_size=1, bytes_per_token=bytes_per_token))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return True

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        self.block_tables.setdefault(seq_id, [])
        return []

    def free(self, seq_id: int) -> list[int]:
        self.block_tables.pop(seq_id, None)
        self.tokens_held.pop(seq_id, None)
        return []

    def commit(
        self,
        seq_id: int,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        namespace: str | None = None,
    ) -> None:
        pass  # nothing is held after the step

    def bytes_reserved(self) -> int:
        return 0
