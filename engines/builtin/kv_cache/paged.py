"""Paged KV (PagedAttention): a sequence's cache is a table of fixed-size blocks taken from a
shared pool on demand, so it reserves at most one partly filled block beyond what it holds.

On top of the pool: prefix caching (full blocks are identified by a hash chained over the
prompt and shared between sequences), copy-on-write for shared blocks a sequence writes into,
and sliding-window release of blocks no future query can see.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch

from engines.builtin.kv_cache.base import KVCacheManager, KVLayout
from engines.builtin.kv_cache.block_pool import NULL_BLOCK, BlockPool, CachedBlock
from engines.builtin.kv_cache.tiers import TIERS, BlockTransfer, KVTierStore
from models.config import ceil_div

#: The parent hash of a prompt's first block. A constant rather than None: hash(None) depends
#: on the process before Python 3.12, and block hashes should not.
ROOT_HASH = 0

#: Content ids of blocks whose content is unknown (released before they could be hashed).
#: Blocks chained after one are never registered, so a lookup never reaches them.
_DEAD = -1


def hash_block_tokens(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    """The chained hash of a full block: it covers every token of the prefix up to and
    including this block, through the parent's hash. Python's tuple-of-int hash is
    deterministic across processes. It only narrows the lookup: a hit is confirmed by the
    block's token ids and its parent's content id (see `BlockPool.lookup`), so a collision
    costs a comparison, never a wrong hit."""
    return hash((parent_hash, token_ids))


class PooledKVCacheManager(KVCacheManager):
    """A manager whose blocks come from one `BlockPool` (`pool`): what it reserves and holds
    is the pool's (a shared block counted once)."""

    pages_blocks = True
    pool: BlockPool

    def bytes_reserved(self) -> int:
        return self.pool.num_in_use * self.block_size * self.layout.bytes_per_token

    def bytes_used(self) -> int:
        """Tokens held in in-use blocks, a shared block counted once."""
        return self.pool.tokens_in_use * self.layout.bytes_per_token

    @property
    def num_blocks_in_use(self) -> int:
        return self.pool.num_in_use

    @property
    def num_shared_blocks(self) -> int:
        return self.pool.num_shared

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.pool.evictable)

    def can_fork(self, parent_id: int, child_id: int) -> bool:
        return True  # the child shares the parent's blocks; copies come later, on write


class PagedKVCacheManager(PooledKVCacheManager):
    """Block tables over a `BlockPool`; block 0 is the NULL block.

    Contract (seq ids are ints, token counts are totals for the sequence):
      * ``block_tables[seq]``: the table (NULL entries where the window released a block);
        ``tokens_held[seq]``: tokens committed (written) so far.
      * ``can_allocate`` / ``allocate(seq, n)``: grow the table to ceil(n / block_size) entries;
        a shared block that this sequence's next tokens land in is first replaced by a private
        one (copy-on-write), recorded for ``take_copies`` when it holds committed tokens.
      * ``commit(seq, n, token_ids)``: the first n tokens are written; registers the hashes of
        newly full blocks (prefix caching) and releases blocks out of the sliding window.
      * ``match_prefix(seq, token_ids)``: adopt cached full blocks for a new sequence; returns
        the cached token count.
      * ``fork(parent, child)``: the child shares all of the parent's blocks.
      * ``free(seq)``: releases the table; returns blocks whose ref count reached 0.
    Extra accounting: ``num_blocks_in_use``, ``num_free_blocks`` (free + evictable),
    ``num_cached_blocks`` (evictable cached), ``prefix_hit_tokens``, ``prefix_queries_tokens``.
    ``pool`` is the `BlockPool` (for inspection).

    Callers: allocate before every step that writes (copy-on-write happens there); copy the
    K/V of each ``take_copies()`` pair before that step; pass the token ids to ``commit`` or
    nothing gets cached; ``free`` a sequence whose admission fails after ``match_prefix`` (its
    hits return to the cache). Blocks the window releases in ``commit`` are not reported.
    """

    def __init__(
        self,
        layout: KVLayout,
        enable_prefix_caching: bool = False,
        sliding_window: int | None = None,
        pool: BlockPool | None = None,
        namespaces: dict[str, int] | None = None,
    ) -> None:
        """`pool` and `namespaces`: shared with the other groups of a hybrid cache
        (hybrid.py), so that block ids and adapter roots are unique across them."""
        super().__init__(layout)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
        self.pool = BlockPool(layout.num_blocks) if pool is None else pool
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.prefix_hit_tokens = 0
        self.prefix_queries_tokens = 0
        self._copies: list[tuple[int, int]] = []
        # Per sequence, per full block already hashed: its chained hash and content id (kept
        # even after the window releases the block, since the chain continues through it).
        self._hashes: dict[int, list[int]] = {}
        self._content_ids: dict[int, list[int]] = {}
        self._released: dict[int, int] = {}  # seq -> table entries released by the window
        # adapter name -> its root's parent id
        self._namespaces: dict[str, int] = {} if namespaces is None else namespaces
        self._transfers: list[BlockTransfer] = []

    def attach_tiers(self, tiers: KVTierStore) -> None:
        """Keep evicted cached blocks in `tiers` and load them back on a prefix match."""
        if not self.enable_prefix_caching:
            raise ValueError("KV tiers hold prefix-cached blocks: enable prefix caching")
        self.tiers = tiers
        self.pool.on_evict = self._offload

    # ---- allocation -------------------------------------------------------------------------

    def _shared_to_write(self, seq_id: int, num_tokens: int) -> list[int]:
        """Table indices of shared blocks that the tokens held..num_tokens will be written to.
        Usually at most the partly filled last block; more only when a fork shared blocks
        allocated ahead of what the parent had written."""
        table = self.block_tables.get(seq_id, [])
        held = self.tokens_held.get(seq_id, 0)
        if num_tokens <= held:
            return []
        end = min(len(table), ceil_div(num_tokens, self.block_size))
        return [
            i
            for i in range(held // self.block_size, end)
            if table[i] != NULL_BLOCK and self.pool.ref_counts[table[i]] > 1
        ]

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        table = self.block_tables.get(seq_id, [])
        grow = max(0, ceil_div(num_tokens, self.block_size) - len(table))
        return grow + len(self._shared_to_write(seq_id, num_tokens))

    def can_allocate(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks_needed(seq_id, num_tokens) <= self.pool.num_free

    def blocks_to_hold(self, num_tokens: int, step_tokens: int | None = None) -> int:
        longest = num_tokens
        if self.sliding_window is not None:
            # released blocks come back while it runs, but a step's tokens are all allocated
            # before the window moves past the oldest of them
            step = num_tokens if step_tokens is None else step_tokens
            longest = min(longest, self.sliding_window + step + 2 * self.block_size)
        return ceil_div(longest, self.block_size)

    def allocate(self, seq_id: int, num_tokens: int) -> list[int]:
        if not self.can_allocate(seq_id, num_tokens):
            raise RuntimeError(
                f"cannot fit {num_tokens} tokens of sequence {seq_id} in the "
                f"{self.pool.num_free} free KV blocks"
            )
        table = self.block_tables.setdefault(seq_id, [])
        held = self.tokens_held.setdefault(seq_id, 0)
        new_blocks = []
        for index in self._shared_to_write(seq_id, num_tokens):
            src = table[index]
            dst = self.pool.allocate()
            written = held - index * self.block_size  # this sequence's tokens in src
            if written > 0:
                self._copies.append((src, dst))
                self.pool.record_fill(dst, min(written, self.block_size))
            self.pool.decref(src)  # still owned by the others: it was shared
            table[index] = dst
            new_blocks.append(dst)
        while len(table) < ceil_div(num_tokens, self.block_size):
            block = self.pool.allocate()
            table.append(block)
            new_blocks.append(block)
        return new_blocks

    def take_copies(self) -> list[tuple[int, int]]:
        """(src, dst) block pairs whose K/V the runner must copy before the next step."""
        copies, self._copies = self._copies, []
        return copies

    def take_transfers(self) -> list[BlockTransfer]:
        """Saves of evicted blocks and loads of tier hits, in the order they were decided:
        the runner must run them in this order, before the step's copies and forward (a
        block saved and then reused for a load is read before it is written)."""
        transfers, self._transfers = self._transfers, []
        return transfers

    def load_blocks(self, seq_id: int, first_block: int, payloads: torch.Tensor) -> None:
        """Plan loads of `payloads` (a row per block, K/V computed elsewhere: a prefill
        instance's) into the sequence's table from index `first_block` on; the runner writes
        them before the step's forward (`take_transfers`)."""
        table = self.block_tables[seq_id]
        for offset, payload in enumerate(payloads):
            block = table[first_block + offset]
            self._transfers.append(BlockTransfer("load", block, -1, payload))

    def abandon_transfers(self, transfers: list[BlockTransfer]) -> None:
        """Transfers that did not run: their blocks' content is not what the cache says (a
        carried payload's blocks are not cached yet: their step fails their sequences)."""
        for transfer in transfers:
            if transfer.payload is not None:
                continue
            assert self.tiers is not None
            if transfer.kind == "save":
                self.tiers.drop(transfer.key)
            else:
                self.tiers.release(transfer.key)
                self.pool.forget(transfer.block)

    def _offload(self, block: int, meta: CachedBlock) -> None:
        assert self.tiers is not None
        if self.tiers.reserve(meta):
            self._transfers.append(BlockTransfer("save", block, meta.content_id))

    def free(self, seq_id: int) -> list[int]:
        table = self.block_tables.pop(seq_id, [])
        self.tokens_held.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._content_ids.pop(seq_id, None)
        self._released.pop(seq_id, None)
        # Tail first: the end of a prefix becomes evictable before its head, so eviction eats
        # prefixes from the end and the shared heads survive longest.
        return [b for b in reversed(table) if b != NULL_BLOCK and self.pool.decref(b)]

    def truncate(self, seq_id: int, num_tokens: int) -> list[int]:
        table = self.block_tables.get(seq_id, [])
        keep = ceil_div(num_tokens, self.block_size)
        if self.tokens_held.get(seq_id, 0) > num_tokens:
            raise ValueError(
                f"sequence {seq_id}: cannot truncate to {num_tokens} tokens below the "
                f"{self.tokens_held[seq_id]} committed"
            )
        dropped, table[keep:] = table[keep:], []
        return [b for b in reversed(dropped) if b != NULL_BLOCK and self.pool.decref(b)]

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (copy-on-write on its next writes)."""
        if child_id in self.block_tables:
            raise ValueError(f"sequence {child_id} already has a block table")
        table = list(self.block_tables.get(parent_id, []))
        for block in table:
            if block != NULL_BLOCK:
                self.pool.incref(block)
        self.block_tables[child_id] = table
        self.tokens_held[child_id] = self.tokens_held.get(parent_id, 0)
        self._hashes[child_id] = list(self._hashes.get(parent_id, []))
        self._content_ids[child_id] = list(self._content_ids.get(parent_id, []))
        self._released[child_id] = self._released.get(parent_id, 0)

    # ---- writes -----------------------------------------------------------------------------

    def commit(
        self,
        seq_id: int,
        num_tokens: int,
        token_ids: Sequence[int] | None = None,
        namespace: str | None = None,
    ) -> None:
        """The cache holds the sequence's first `num_tokens` tokens; `token_ids` (the
        sequence's tokens, at least that many) lets prefix caching hash the full blocks, in
        `namespace` (the LoRA adapter the K/V were computed under; None: the base model)."""
        table = self.block_tables.get(seq_id, [])
        if num_tokens > len(table) * self.block_size:
            raise ValueError(
                f"sequence {seq_id}: {num_tokens} tokens committed beyond its {len(table)} blocks"
            )
        held = self.tokens_held.get(seq_id, 0)
        bs = self.block_size
        for index in range(held // bs, ceil_div(num_tokens, bs)):
            if table[index] != NULL_BLOCK:
                self.pool.record_fill(table[index], min(bs, num_tokens - index * bs))
        self.tokens_held[seq_id] = num_tokens
        if self.enable_prefix_caching and token_ids is not None:
            if len(token_ids) < num_tokens:
                raise ValueError(
                    f"sequence {seq_id}: {len(token_ids)} token ids for "
                    f"{num_tokens} committed tokens"
                )
            self._register_full_blocks(seq_id, num_tokens, token_ids, namespace)
        if self.sliding_window is not None:
            self._release_outside_window(seq_id, num_tokens)

    def _register_full_blocks(
        self, seq_id: int, num_tokens: int, token_ids: Sequence[int], namespace: str | None
    ) -> None:
        table = self.block_tables[seq_id]
        hashes = self._hashes.setdefault(seq_id, [])
        content_ids = self._content_ids.setdefault(seq_id, [])
        bs = self.block_size
        for index in range(len(hashes), num_tokens // bs):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            parent_hash = hashes[-1] if hashes else self._root_hash(namespace)
            parent = content_ids[-1] if content_ids else self._root(namespace)
            block_hash = hash_block_tokens(parent_hash, tokens)
            if table[index] == NULL_BLOCK or parent == _DEAD:
                # Released before it was hashed (commits without token ids): its content, and
                # so every later block's prefix, cannot be vouched for.
                content_id = _DEAD
            else:
                content_id = self.pool.register(table[index], block_hash, tokens, parent)
            hashes.append(block_hash)
            content_ids.append(content_id)

    def _release_outside_window(self, seq_id: int, num_tokens: int) -> None:
        """Queries from position `num_tokens` on see keys > position - window, so block b is
        dead once (b + 1) * block_size <= num_tokens - window + 1."""
        assert self.sliding_window is not None
        table = self.block_tables[seq_id]
        dead = min(len(table), (num_tokens - self.sliding_window + 1) // self.block_size)
        for index in range(self._released.get(seq_id, 0), dead):
            if table[index] != NULL_BLOCK:
                self.pool.decref(table[index])
                table[index] = NULL_BLOCK
        self._released[seq_id] = max(dead, self._released.get(seq_id, 0))

    # ---- prefix cache -----------------------------------------------------------------------

    def match_prefix(
        self, seq_id: int, token_ids: Sequence[int], namespace: str | None = None
    ) -> int:
        """Adopt the cached full blocks that start `token_ids` (a new sequence's prompt) and
        were computed in `namespace` (see commit), up to the first miss and never the last
        prompt token, which must be computed to sample.
        Returns the cached token count, which becomes the sequence's committed count. Every
        call counts toward the hit rate (prefix_hit_tokens / prefix_queries_tokens)."""
        if not self.enable_prefix_caching:
            return 0
        if self.block_tables.get(seq_id):
            raise ValueError(
                f"sequence {seq_id} already has blocks; match_prefix is for new sequences"
            )
        bs = self.block_size
        table = self.block_tables.setdefault(seq_id, [])
        hashes = self._hashes.setdefault(seq_id, [])
        content_ids = self._content_ids.setdefault(seq_id, [])
        if self.tiers is not None:
            self.last_match_tiers = dict.fromkeys(TIERS, 0)
        for index in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            parent_hash = hashes[-1] if hashes else self._root_hash(namespace)
            parent = content_ids[-1] if content_ids else self._root(namespace)
            block_hash = hash_block_tokens(parent_hash, tokens)
            block = self.pool.lookup(block_hash, tokens, parent)
            if block is not None:
                self.pool.incref(block)
            elif self.tiers is not None:
                block = self._load_from_tiers(block_hash, tokens, parent)
            if block is None:
                break
            table.append(block)
            hashes.append(block_hash)
            content_ids.append(self.pool.content_id(block))
        cached = len(table) * bs
        if cached:
            self.tokens_held[seq_id] = cached
        else:  # leave no trace of a sequence that holds nothing (num_live counts tables)
            del self.block_tables[seq_id], self._hashes[seq_id], self._content_ids[seq_id]
        self.prefix_queries_tokens += len(token_ids)
        self.prefix_hit_tokens += cached
        if cached and self.sliding_window is not None:
            # Next queries start at `cached`: a long hit's head is already out of the window.
            self._release_outside_window(seq_id, cached)
        return cached

    def prefetch_prefix(self, token_ids: Sequence[int], namespace: str | None = None) -> int:
        """match_prefix's walk without adopting anything: the blocks of the prefix that only
        the disk tier holds are read ahead, up to the first block held nowhere."""
        if self.tiers is None or self.tiers.disk is None or not self.tiers.prefetch_enabled:
            return 0  # nothing to read ahead: skip hashing the prompt on every arrival
        bs = self.block_size
        parent_hash, parent = self._root_hash(namespace), self._root(namespace)
        on_tiers = []
        for index in range((len(token_ids) - 1) // bs):
            tokens = tuple(token_ids[index * bs : (index + 1) * bs])
            parent_hash = hash_block_tokens(parent_hash, tokens)
            block = self.pool.lookup(parent_hash, tokens, parent)
            if block is not None:
                parent = self.pool.content_id(block)
                continue
            key = self.tiers.lookup(parent_hash, tokens, parent)
            if key is None:
                break
            on_tiers.append(key)
            parent = key  # a block loaded back keeps its content id
        return self.tiers.prefetch(on_tiers)

    def _load_from_tiers(
        self, block_hash: int, tokens: tuple[int, ...], parent: int | None
    ) -> int | None:
        """A fresh block (ref count 1) that a planned load fills with a tier's copy of this
        content; None on a miss, a corrupt copy, or no block to put it in."""
        assert self.tiers is not None
        key = self.tiers.lookup(block_hash, tokens, parent)
        if key is None or not self.pool.num_free:
            return None
        tier = self.tiers.claim(key)
        if tier is None:
            return None
        block = self.pool.allocate()  # may evict, and so save, another block first
        self.pool.adopt(block, self.tiers.meta(key))
        self.pool.record_fill(block, self.block_size)
        self._transfers.append(BlockTransfer("load", block, key))
        self.last_match_tiers[tier] += self.block_size
        return block

    @property
    def tier_loaded_tokens(self) -> dict[str, int]:
        """Tokens loaded back from each tier since load: every planned load, an admission's
        that was given back too (the scheduler counts hits at admission)."""
        loaded = {} if self.tiers is None else self.tiers.counters.loaded_blocks
        return {tier: loaded.get(tier, 0) * self.block_size for tier in TIERS}

    def _root(self, namespace: str | None) -> int | None:
        """The parent content id a namespace's first block names: None for the base model, a
        negative id of its own for each adapter (content ids are >= 0 and _DEAD is -1), so a
        lookup, which compares parents, never crosses namespaces even on a hash collision."""
        if namespace is None:
            return None
        return self._namespaces.setdefault(namespace, _DEAD - 1 - len(self._namespaces))

    @staticmethod
    def _root_hash(namespace: str | None) -> int:
        # crc32, not hash(): a str's hash differs between processes
        return ROOT_HASH if namespace is None else zlib.crc32(namespace.encode())
