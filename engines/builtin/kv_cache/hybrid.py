"""Paged KV for a model whose layers keep different windows: one block table per KV cache
group (groups.py), all drawing on one `BlockPool`, so that a windowed group's blocks go back to
the pool once no query can see them while the global groups keep theirs.

Each group is a `PagedKVCacheManager` over the shared pool: its own tables, prefix-cache
hashes (in a namespace of its own, so that two groups' blocks of the same tokens, which hold
different layers, never stand in for each other) and window. This manager keeps them in step:
a sequence's tokens fit only when every group's new blocks fit together; a prefix hit counts
only as far as every group has it cached.
"""

from __future__ import annotations

from collections.abc import Sequence

from engines.builtin.kv_cache.base import KVLayout
from engines.builtin.kv_cache.block_pool import BlockPool
from engines.builtin.kv_cache.groups import KVGroups
from engines.builtin.kv_cache.paged import PagedKVCacheManager, PooledKVCacheManager


class HybridKVCacheManager(PooledKVCacheManager):
    """`layout.bytes_per_token` is one block id's bytes per token: `group_size` layers'.
    `block_tables` and `tokens_held` are the first group's (a global one where there is one);
    `group_block_table(g, seq)` gives any group's."""

    def __init__(
        self, layout: KVLayout, groups: KVGroups, enable_prefix_caching: bool = False
    ) -> None:
        super().__init__(layout)
        self.groups = groups
        self.pool = BlockPool(layout.num_blocks)
        namespaces: dict[str, int] = {}
        self.managers = [
            PagedKVCacheManager(layout, enable_prefix_caching, window, self.pool, namespaces)
            for window in groups.windows
        ]
        self.block_tables = self.managers[0].block_tables
        self.tokens_held = self.managers[0].tokens_held
        self.enable_prefix_caching = enable_prefix_caching
        self.prefix_hit_tokens = 0
        self.prefix_queries_tokens = 0

    def group_block_table(self, group: int, seq_id: int) -> list[int]:
        return self.managers[group].block_table(seq_id)

    @staticmethod
    def _namespace(group: int, namespace: str | None) -> str | None:
        """Group 0 keeps the caller's namespace; every other group one of its own."""
        return namespace if group == 0 else f"{namespace or ''}\x1fkv-group-{group}"

    # ---- allocation -------------------------------------------------------------------------

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        needed = sum(m.blocks_needed(seq_id, num_tokens) for m in self.managers)
        return needed <= self.pool.num_free

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        if not self.can_allocate(seq_id, num_tokens):
            raise RuntimeError(
                f"cannot fit {num_tokens} tokens of sequence {seq_id} in the "
                f"{self.pool.num_free} free KV blocks"
            )
        return [block for m in self.managers for block in m.allocate(seq_id, num_tokens)]

    def blocks_to_hold(self, num_tokens: int, step_tokens: int | None = None) -> int:
        return sum(m.blocks_to_hold(num_tokens, step_tokens) for m in self.managers)

    def free(self, seq_id: int) -> list[int]:
        return [block for m in self.managers for block in m.free(seq_id)]

    def truncate(self, seq_id: int, num_tokens: int) -> list[int]:
        return [block for m in self.managers for block in m.truncate(seq_id, num_tokens)]

    def take_copies(self) -> list[tuple[int, int]]:
        return [pair for m in self.managers for pair in m.take_copies()]

    def fork(self, parent_id: int, child_id: int) -> None:
        for m in self.managers:
            m.fork(parent_id, child_id)

    # ---- writes and the prefix cache --------------------------------------------------------

    def commit(
        self,
        seq_id: int,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        namespace: str | None = None,
    ) -> None:
        for group, m in enumerate(self.managers):
            m.commit(seq_id, num_tokens, token_ids, self._namespace(group, namespace))

    def match_prefix(
        self, seq_id: int, token_ids: Sequence[int], namespace: str | None = None
    ) -> int:
        """The longest prefix every group holds: when one group holds less than another, all
        give their blocks back (to the cache, still cached) and match again up to it."""
        if not self.enable_prefix_caching:
            return 0
        cached = len(token_ids) - 1  # match_prefix never adopts the last prompt token
        while True:
            held = [
                m.match_prefix(seq_id, token_ids[: cached + 1], self._namespace(group, namespace))
                for group, m in enumerate(self.managers)
            ]
            if min(held) == max(held):
                break
            self.free(seq_id)  # every block stays cached: the next round finds them again
            cached = min(held)
        cached = held[0]
        self.prefix_queries_tokens += len(token_ids)
        self.prefix_hit_tokens += cached
        return cached
