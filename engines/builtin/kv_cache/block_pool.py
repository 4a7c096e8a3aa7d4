"""The physical blocks of a paged KV cache: reference counts, the free list, and the prefix
cache (full blocks whose content is known, kept after their last owner lets go).

Every block other than the NULL block 0 is in exactly one state:
  * in use: ref count > 0 (owned by one or more block tables);
  * evictable: ref count 0 but cached (full, content registered); it can be adopted again by a
    prefix hit, or evicted (least recently freed first) when the free list runs dry;
  * free: ref count 0, content unknown.
Block 0 is never handed out: tables point at it for positions nothing will read unmasked.

The pool knows nothing about sequences or hashing policy; `PagedKVCacheManager` does.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

NULL_BLOCK = 0


@dataclass(slots=True)
class CachedBlock:
    """What a full block holds, so that a prefix hit can be verified exactly.

    `parent` is the content id of the previous block of the prefix (None for a first block):
    checking it, as well as the block's own tokens, makes a hit depend on the whole prefix and
    not only on a (collidable) hash of it.
    """

    block_hash: int
    token_ids: tuple[int, ...]
    parent: int | None
    content_id: int


class BlockPool:
    """Blocks 1..num_blocks-1. Attributes are public for inspection; mutate through methods.

    `fill[b]` is how many tokens block b holds: the most any owner has written (a shared block
    is counted once). `tokens_in_use` is the sum of `fill` over in-use blocks.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError("a paged KV cache needs at least the NULL block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.fill = [0] * num_blocks
        self.tokens_in_use = 0
        self.num_shared = 0  # in-use blocks held by more than one table (forks, prefix hits)
        self.free: deque[int] = deque(range(1, num_blocks))
        # Insertion order is eviction order: the first entry was freed longest ago.
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, CachedBlock] = {}  # block id -> content (in use or evictable)
        self._by_hash: dict[int, list[int]] = {}  # hash -> cached block ids (collisions kept)
        self._next_content_id = 0
        #: called with (block, content) when a cached block is evicted for reuse, before its
        #: slots can be written (a tiered cache saves its bytes: tiers.py)
        self.on_evict: Callable[[int, CachedBlock], None] | None = None

    # ---- counts -----------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now: free plus evictable."""
        return len(self.free) + len(self.evictable)

    @property
    def num_in_use(self) -> int:
        return self.num_blocks - 1 - self.num_free

    # ---- ownership --------------------------------------------------------------------------

    def allocate(self) -> int:
        """A fresh block with ref count 1 and no content. Uncached free blocks go first, so
        cached content survives as long as possible; then the least recently freed cached."""
        if self.free:
            block = self.free.popleft()
        elif self.evictable:
            block, _ = self.evictable.popitem(last=False)
            meta = self._uncache(block)
            if self.on_evict is not None:
                self.on_evict(block, meta)
            self.fill[block] = 0
        else:
            raise RuntimeError("KV cache out of blocks")
        self.ref_counts[block] = 1
        return block

    def incref(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            # Only a cached block is adopted from ref 0 (a prefix hit); it is in use again.
            del self.evictable[block]
            self.tokens_in_use += self.fill[block]
        self.ref_counts[block] += 1
        if self.ref_counts[block] == 2:
            self.num_shared += 1

    def decref(self, block: int) -> bool:
        """Drop one reference; True when it was the last. A cached block then becomes the
        most recently freed evictable one; any other goes back to the free list."""
        if self.ref_counts[block] <= 0:
            raise RuntimeError(f"block {block} freed more often than allocated")
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 1:
            self.num_shared -= 1
        if self.ref_counts[block]:
            return False
        self.tokens_in_use -= self.fill[block]
        if block in self.cached:
            self.evictable[block] = None
        else:
            self.fill[block] = 0
            self.free.append(block)
        return True

    def record_fill(self, block: int, num_tokens: int) -> None:
        """An owner has written the block's first `num_tokens` slots (in-use blocks only)."""
        if num_tokens > self.fill[block]:
            self.tokens_in_use += num_tokens - self.fill[block]
            self.fill[block] = num_tokens

    # ---- prefix cache -----------------------------------------------------------------------

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: int | None) -> int | None:
        """A cached block with this hash, these exact tokens and this parent content, if any."""
        for block in self._by_hash.get(block_hash, ()):
            meta = self.cached[block]
            if meta.token_ids == token_ids and meta.parent == parent:
                return block
        return None

    def register(
        self, block: int, block_hash: int, token_ids: tuple[int, ...], parent: int | None
    ) -> int:
        """Record the content of a block that just became full; return its content id.

        A block already registered (shared through a fork or a hit) keeps its id. If another
        block already caches the same content, that one stays the cached copy and its id is
        returned, so the caller's chain continues through it; this block stays uncached."""
        meta = self.cached.get(block)
        if meta is not None:
            if meta.token_ids != token_ids:
                raise ValueError(f"block {block} is cached with other token ids")
            return meta.content_id
        twin = self.lookup(block_hash, token_ids, parent)
        if twin is not None:
            return self.cached[twin].content_id
        content_id = self._next_content_id
        self._next_content_id += 1
        self.cached[block] = CachedBlock(block_hash, token_ids, parent, content_id)
        self._by_hash.setdefault(block_hash, []).append(block)
        return content_id

    def adopt(self, block: int, meta: CachedBlock) -> None:
        """Register a fresh block as holding content cached before under `meta` (a tier's
        copy being loaded back), with its old content id, so that blocks registered after it
        still name it as their parent."""
        if block in self.cached:
            raise ValueError(f"block {block} is cached already")
        self.cached[block] = meta
        self._by_hash.setdefault(meta.block_hash, []).append(block)

    def forget(self, block: int) -> None:
        """Uncache a block whose bytes cannot be trusted (a load that did not run)."""
        if block in self.cached:
            self._uncache(block)
            if block in self.evictable:
                del self.evictable[block]
                self.fill[block] = 0
                self.free.append(block)

    def content_id(self, block: int) -> int:
        return self.cached[block].content_id

    def _uncache(self, block: int) -> CachedBlock:
        # Content ids are never reused, so children that named this block as their parent can
        # no longer match: an evicted head makes the rest of its chain unreachable, not wrong
        # (unless a KV tier keeps it: loaded back, it is adopted under the same id).
        meta = self.cached.pop(block)
        same_hash = self._by_hash[meta.block_hash]
        same_hash.remove(block)
        if not same_hash:
            del self._by_hash[meta.block_hash]
        return meta
