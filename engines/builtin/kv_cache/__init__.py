"""KV cache managers (host-side accounting) and storage (the tensors)."""

from __future__ import annotations

from engines.builtin.kv_cache.base import KVCacheManager, KVLayout
from engines.builtin.kv_cache.contiguous import ContiguousKVCacheManager
from engines.builtin.kv_cache.none import NoKVCacheManager
from engines.builtin.kv_cache.storage import LayerKVCache

__all__ = [
    "ContiguousKVCacheManager",
    "KVCacheManager",
    "KVLayout",
    "LayerKVCache",
    "NoKVCacheManager",
]

from engines.builtin.kv_cache.block_pool import BlockPool
from engines.builtin.kv_cache.paged import PagedKVCacheManager

__all__ += ["BlockPool", "PagedKVCacheManager"]
