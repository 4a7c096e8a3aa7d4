"""How big each kind of KV cache is made: `engine.kv_cache` picks a `KVKind` from
`KV_MANAGERS`, whose sizing function turns the memory budget into a manager (its layout of
slots or blocks) and the number of sequences that can run at once."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from engines.builtin.kv_cache.base import KVCacheManager, KVLayout
from engines.builtin.kv_cache.contiguous import ContiguousKVCacheManager
from engines.builtin.kv_cache.groups import KVGroups
from engines.builtin.kv_cache.hybrid import HybridKVCacheManager
from engines.builtin.kv_cache.none import NoKVCacheManager
from engines.builtin.kv_cache.paged import PagedKVCacheManager
from engines.registry import Registry
from models.config import ceil_div


@dataclass(frozen=True)
class KVSizing:
    """What sizing a KV cache needs to know."""

    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int  # the most tokens one step writes
    block_size: int
    bytes_per_token: int
    sliding_window: int | None
    enable_chunked_prefill: bool
    enable_prefix_caching: bool
    # None: the platform's default budget (a share of free device or host memory)
    kv_cache_memory_bytes: int | None
    on_cuda: bool
    # bytes one sequence needs -> (the budget in bytes, where it came from)
    budget_for: Callable[[int], tuple[int, str]]
    # the model's layers keep different windows and engine.hybrid_kv_cache is on: paged KV
    # keeps one block table per group (groups.py); None: one table for every layer
    groups: KVGroups | None = None


@dataclass(frozen=True)
class SizedKV:
    manager: KVCacheManager
    max_num_seqs: int  # sequences that can hold KV at once (contiguous: the slots)
    budget_bytes: int
    reason: str  # where the budget came from, for describe()


@dataclass(frozen=True)
class KVKind:
    """One `engine.kv_cache` value: its manager class, which says what the cache keeps
    (`retains_kv`, `pages_blocks`), and the function that sizes it."""

    manager: type[KVCacheManager]
    size: Callable[[KVSizing], SizedKV]


KV_MANAGERS = Registry[KVKind]("engine.kv_cache")


def no_kv_cache(s: KVSizing) -> SizedKV:
    """Recompute the whole context every step: no memory, no limit but max_num_seqs."""
    return SizedKV(
        NoKVCacheManager(s.bytes_per_token), s.max_num_seqs, 0, "kv_cache=none: no KV cache"
    )


def contiguous_kv_cache(s: KVSizing) -> SizedKV:
    """One max_model_len region per sequence slot, as many as the budget holds; a
    sliding-window model needs only a window-sized ring (not with chunked prefill, whose
    chunks would overwrite keys that their own earlier queries still read)."""
    window = s.sliding_window
    ring = window is not None and window < s.max_model_len and not s.enable_chunked_prefill
    region = window if ring and window is not None else s.max_model_len
    per_seq = region * s.bytes_per_token
    budget, reason = s.budget_for(per_seq)
    slots = min(s.max_num_seqs, budget // per_seq)
    if slots < 1:
        raise ValueError(
            f"engine.kv_cache_memory_bytes: a budget of {budget} bytes holds no sequence of "
            f"max_model_len={s.max_model_len} ({per_seq} bytes each; budget: {reason}); "
            "raise the budget or lower engine.max_model_len"
        )
    layout = KVLayout(num_blocks=slots, block_size=region, bytes_per_token=s.bytes_per_token)
    return SizedKV(ContiguousKVCacheManager(layout, ring=ring), slots, budget, reason)


def paged_kv_cache(s: KVSizing) -> SizedKV:
    """Blocks of block_size tokens from one pool, handed out as sequences grow. Block 0 is the
    null block (table entries released by a sliding window point at it). With KV groups a
    block id is one group's layers (group_size of num_layers), and a sequence holds blocks in
    every group."""
    groups, token_bytes = s.groups, s.bytes_per_token
    layout = KVLayout(num_blocks=1, block_size=s.block_size, bytes_per_token=token_bytes)
    longest = ceil_div(s.max_model_len, s.block_size)  # blocks of one sequence at full length
    if groups is not None:
        token_bytes = s.bytes_per_token * groups.group_size // len(groups.layer_group)
        layout = replace(layout, bytes_per_token=token_bytes)
        step = min(s.max_model_len, s.max_num_batched_tokens)
        longest = HybridKVCacheManager(layout, groups).blocks_to_hold(s.max_model_len, step)
    block_bytes = s.block_size * token_bytes
    budget, reason = s.budget_for(longest * block_bytes)
    if s.kv_cache_memory_bytes is None and not s.on_cuda:
        # RAM is shared with everything else (and mapped at load when prefaulted): by default
        # no more blocks than max_num_seqs sequences at full length fill at once, the
        # contiguous layout's bound; blocks beyond it would only keep more freed prefixes
        most = s.max_num_seqs * longest
        if most * block_bytes < budget:
            budget = most * block_bytes
            reason += f"; capped at max_num_seqs={s.max_num_seqs} sequences of max_model_len"
    usable = budget // block_bytes
    needed = 1 if groups is None else groups.num_groups  # a block per table, for one token
    if usable < needed:
        raise ValueError(
            f"engine.kv_cache_memory_bytes: a budget of {budget} bytes holds {usable} KV blocks "
            f"of block_size={s.block_size} ({block_bytes} bytes each; budget: {reason}); one "
            f"token needs {needed}"
        )
    layout = replace(layout, num_blocks=usable + 1)
    manager: KVCacheManager = (
        PagedKVCacheManager(layout, s.enable_prefix_caching, s.sliding_window)
        if groups is None
        else HybridKVCacheManager(layout, groups, s.enable_prefix_caching)
    )
    return SizedKV(manager, s.max_num_seqs, budget, reason)


KV_MANAGERS.add("none", KVKind(NoKVCacheManager, no_kv_cache))
KV_MANAGERS.add("contiguous", KVKind(ContiguousKVCacheManager, contiguous_kv_cache))
KV_MANAGERS.add("paged", KVKind(PagedKVCacheManager, paged_kv_cache))
