"""The paged KV block manager: property tests over random operation sequences, then cases by
hand for LRU eviction, prefix hits, copy-on-write and the sliding window.

The state machine simulates the K/V memory too: writing position p of a sequence stores the
token prefix that position's K/V depends on, so any wrong sharing (a false prefix hit, a missed
copy-on-write, a block reused while still owned) shows up as a sequence reading wrong content.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engines.builtin.kv_cache import KVLayout, PagedKVCacheManager
from engines.builtin.kv_cache import paged as paged_module

BPT = 3  # bytes per token: any constant, so bytes are tokens scaled
NULL = 0


def make(
    num_blocks: int, block_size: int, caching: bool = False, window: int | None = None
) -> PagedKVCacheManager:
    return PagedKVCacheManager(KVLayout(num_blocks, block_size, BPT), caching, window)


def run_step(kv: PagedKVCacheManager, seq_id: int, tokens: Sequence[int], total: int) -> None:
    """What the scheduler does for one step: reserve, then commit what the step computed."""
    kv.allocate(seq_id, total)
    kv.commit(seq_id, total, tokens)


def _colliding_hash(parent_hash: int, token_ids: tuple[int, ...]) -> int:
    return 7  # every block collides with every other


# ---- property tests ---------------------------------------------------------------------------


class PagedMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 20),
        block_size=st.integers(1, 4),
        caching=st.booleans(),
        window=st.none() | st.integers(1, 10),
        collide=st.booleans(),
    )
    def setup(
        self, num_blocks: int, block_size: int, caching: bool, window: int | None, collide: bool
    ) -> None:
        self.original_hash = paged_module.hash_block_tokens
        if collide:
            paged_module.hash_block_tokens = _colliding_hash
        self.kv = make(num_blocks, block_size, caching, window)
        self.bs = block_size
        self.window = window
        self.tokens: dict[int, list[int]] = {}  # each live sequence's token ids
        self.memory: dict[int, list[tuple[int, ...] | None]] = {}  # block -> slot contents
        self.next_id = 0

    def teardown(self) -> None:
        paged_module.hash_block_tokens = self.original_hash
        if not hasattr(self, "kv"):
            return
        for seq_id in list(self.tokens):
            self.kv.free(seq_id)
        pool = self.kv.pool
        assert all(count == 0 for count in pool.ref_counts)
        assert len(pool.free) + len(pool.evictable) == pool.num_blocks - 1
        assert self.kv.bytes_reserved() == self.kv.bytes_used() == 0
        assert self.kv.num_live == 0

    # ---- helpers --------------------------------------------------------------------------

    def _grow(self, seq_id: int, total: int, write: bool, with_ids: bool = True) -> bool:
        """allocate (checking that can_allocate is exact), then optionally write and commit."""
        kv = self.kv
        if not kv.can_allocate(seq_id, total):
            before = (list(kv.block_table(seq_id)), kv.num_free_blocks)
            with pytest.raises(RuntimeError):
                kv.allocate(seq_id, total)
            assert (list(kv.block_table(seq_id)), kv.num_free_blocks) == before
            return False
        new = kv.allocate(seq_id, total)
        assert NULL not in new and len(set(new)) == len(new)
        for src, dst in kv.take_copies():  # the runner copies before the step
            assert dst in new
            self.memory[dst] = list(self.memory[src])
        assert kv.take_copies() == []
        if write:
            self._write(seq_id, total)
            kv.commit(seq_id, total, self.tokens[seq_id] if with_ids else None)
        return True

    def _write(self, seq_id: int, total: int) -> None:
        """The K/V of the sequence's tokens from its committed count up to `total`."""
        tokens = self.tokens[seq_id]
        table = self.kv.block_table(seq_id)
        for pos in range(self.kv.tokens_held[seq_id], total):
            block = table[pos // self.bs]
            assert block != NULL
            self.memory.setdefault(block, [None] * self.bs)[pos % self.bs] = tuple(
                tokens[: pos + 1]
            )

    def _new_id(self) -> int:
        self.next_id += 1
        return self.next_id

    # ---- rules ----------------------------------------------------------------------------

    @rule(prompt=st.lists(st.integers(0, 1), min_size=1, max_size=12), chunk=st.integers(1, 12))
    def add(self, prompt: list[int], chunk: int) -> None:
        seq_id = self._new_id()
        cached = self.kv.match_prefix(seq_id, prompt)
        assert cached % self.bs == 0 and cached <= len(prompt) - 1
        if not self.kv.enable_prefix_caching:
            assert cached == 0
        self.tokens[seq_id] = list(prompt)
        total = min(len(prompt), cached + chunk)
        if not self._grow(seq_id, total, write=True):
            self.kv.free(seq_id)  # not admitted: give the hits back
            del self.tokens[seq_id]

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), new_tokens=st.integers(1, 5), with_ids=st.booleans())
    def step(self, data: st.DataObject, new_tokens: int, with_ids: bool) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        total = self.kv.tokens_held[seq_id] + new_tokens
        tokens = self.tokens[seq_id]
        if len(tokens) < total:  # decoding: sampled tokens join the sequence
            tokens += data.draw(
                st.lists(
                    st.integers(0, 1), min_size=total - len(tokens), max_size=total - len(tokens)
                )
            )
        if not self._grow(seq_id, total, write=True, with_ids=with_ids) and data.draw(
            st.booleans()
        ):
            self.kv.free(seq_id)  # preempted
            del self.tokens[seq_id]

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), ahead=st.integers(1, 12))
    def reserve(self, data: st.DataObject, ahead: int) -> None:
        """Allocate ahead without writing (static batching reserves a final length)."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        self._grow(seq_id, self.kv.tokens_held[seq_id] + ahead, write=False)

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data(), drafts=st.integers(1, 6), kept=st.integers(0, 6))
    def speculate(self, data: st.DataObject, drafts: int, kept: int) -> None:
        """Speculative decoding: write a token and its drafts, keep `kept` of the drafts, give
        back the blocks only rejected drafts occupied."""
        seq_id = data.draw(st.sampled_from(sorted(self.tokens)))
        kept = min(kept, drafts)
        held = self.kv.tokens_held[seq_id]
        new = data.draw(st.lists(st.integers(0, 1), min_size=1 + drafts, max_size=1 + drafts))
        self.tokens[seq_id] = self.tokens[seq_id][:held] + new
        if not self._grow(seq_id, held + 1 + drafts, write=False):
            return
        self._write(seq_id, held + 1 + drafts)
        self.tokens[seq_id] = self.tokens[seq_id][: held + 1 + kept]
        self.kv.commit(seq_id, held + 1 + kept, self.tokens[seq_id])
        table = list(self.kv.block_table(seq_id))
        freed = self.kv.truncate(seq_id, held + 1 + kept)
        assert len(self.kv.block_table(seq_id)) == -(-(held + 1 + kept) // self.bs)
        assert all(self.kv.pool.ref_counts[b] == 0 for b in freed)
        assert set(freed) <= set(table) - {NULL}

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def fork(self, data: st.DataObject) -> None:
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child = self._new_id()
        self.kv.fork(parent, child)
        # Only the committed tokens are common; the rest is each one's own future.
        self.tokens[child] = self.tokens[parent][: self.kv.tokens_held[parent]]

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def beam_move(self, data: st.DataObject) -> None:
        """One move of a beam search (engines/builtin/beam_search.py): each beam of a group is
        chosen 0 to 3 times; an unchosen beam is freed (pruned), a beam chosen k times forks
        k - 1 children; then every new beam writes its one new token (a beam that cannot is
        preempted, as the scheduler would)."""
        beams = data.draw(
            st.lists(st.sampled_from(sorted(self.tokens)), min_size=1, max_size=4, unique=True)
        )
        counts = data.draw(st.lists(st.integers(0, 3), min_size=len(beams), max_size=len(beams)))
        counts[0] = max(counts[0], 1)  # a move keeps at least one beam
        for beam, count in zip(beams, counts, strict=True):
            self.tokens[beam] = self.tokens[beam][: self.kv.tokens_held[beam]]
            if count == 0:
                self.free_one(beam)
        moved = []
        for beam, count in zip(beams, counts, strict=True):
            moved += [beam] if count else []
            for _ in range(count - 1):
                child = self._new_id()
                self.kv.fork(beam, child)
                self.tokens[child] = list(self.tokens[beam])
                moved.append(child)
        for beam in moved:
            self.tokens[beam].append(data.draw(st.integers(0, 1)))
            if not self._grow(beam, len(self.tokens[beam]), write=True):
                self.free_one(beam)

    def free_one(self, seq_id: int) -> None:
        table = list(self.kv.block_table(seq_id))
        freed = self.kv.free(seq_id)
        del self.tokens[seq_id]
        assert all(self.kv.pool.ref_counts[b] == 0 for b in freed)
        assert set(freed) <= set(table) - {NULL}

    @precondition(lambda self: bool(self.tokens))
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        self.free_one(data.draw(st.sampled_from(sorted(self.tokens))))

    # ---- invariants -----------------------------------------------------------------------

    @invariant()
    def blocks_partitioned(self) -> None:
        pool = self.kv.pool
        free, evictable = list(pool.free), list(pool.evictable)
        in_use = [b for b in range(1, pool.num_blocks) if pool.ref_counts[b] > 0]
        assert len(free) + len(evictable) + len(in_use) == pool.num_blocks - 1
        assert set(free) | set(evictable) | set(in_use) == set(range(1, pool.num_blocks))
        assert pool.ref_counts[NULL] == 0
        assert set(evictable) <= set(pool.cached)  # evictable = cached with no owner
        assert not set(free) & set(pool.cached)
        assert all(pool.fill[b] == 0 for b in free)
        assert all(pool.fill[b] == self.bs for b in pool.cached)  # only full blocks cached
        assert self.kv.num_blocks_in_use == len(in_use)
        assert self.kv.num_free_blocks == len(free) + len(evictable)
        assert self.kv.num_cached_blocks == len(evictable)

    @invariant()
    def ref_counts_match_tables(self) -> None:
        kv = self.kv
        owners = Counter(b for t in kv.block_tables.values() for b in t if b != NULL)
        assert all(kv.pool.ref_counts[b] == owners[b] for b in range(kv.pool.num_blocks))
        assert set(kv.block_tables) == set(self.tokens) and kv.num_live == len(self.tokens)
        assert kv.num_shared_blocks == sum(1 for count in owners.values() if count > 1)

    @invariant()
    def bytes_accounted(self) -> None:
        kv, pool = self.kv, self.kv.pool
        in_use = [b for b in range(1, pool.num_blocks) if pool.ref_counts[b] > 0]
        assert kv.bytes_reserved() == len(in_use) * self.bs * BPT
        assert kv.bytes_used() == sum(pool.fill[b] for b in in_use) * BPT
        assert kv.bytes_used() <= kv.bytes_reserved()
        assert kv.prefix_hit_tokens <= kv.prefix_queries_tokens
        for seq_id, table in kv.block_tables.items():
            held = kv.tokens_held[seq_id]
            for index, block in enumerate(table):
                if block != NULL:  # each owner's tokens fit in the recorded fill
                    assert pool.fill[block] >= min(self.bs, max(0, held - index * self.bs))

    @invariant()
    def every_sequence_reads_its_own_kv(self) -> None:
        for seq_id, table in self.kv.block_tables.items():
            held = self.kv.tokens_held[seq_id]
            tokens = self.tokens[seq_id]
            assert len(table) * self.bs >= held
            for pos in range(held):
                block = table[pos // self.bs]
                if block == NULL:  # released: only allowed wholly outside the window
                    assert self.window is not None
                    assert (pos // self.bs + 1) * self.bs <= held - self.window + 1
                    continue
                assert self.memory[block][pos % self.bs] == tuple(tokens[: pos + 1])

    @invariant()
    def window_released(self) -> None:
        if self.window is None:
            return
        for seq_id, table in self.kv.block_tables.items():
            limit = self.kv.tokens_held[seq_id] - self.window + 1
            assert all(table[b] == NULL for b in range(min(len(table), limit // self.bs)))


PagedMachine.TestCase.settings = settings(
    max_examples=250,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestPagedMachine = PagedMachine.TestCase


# ---- LRU eviction -----------------------------------------------------------------------------


def test_eviction_is_lru_tail_first() -> None:
    kv = make(num_blocks=6, block_size=2, caching=True)  # blocks 1..5
    a = [1, 2, 3, 4, 5]
    run_step(kv, 1, a, 5)  # a0, a1 full and cached; a2 holds one token
    a0, a1, a2 = kv.block_table(1)
    assert kv.free(1) == [a2, a1, a0]
    # The partial block is not cached; the full ones are evictable, tail before head.
    assert list(kv.pool.evictable) == [a1, a0] and a2 in kv.pool.free
    assert kv.num_cached_blocks == 2 and kv.num_free_blocks == 5 and kv.num_blocks_in_use == 0

    b = [9] * 8
    run_step(kv, 2, b, 6)  # three blocks: the uncached free ones go first
    assert set(kv.block_table(2)).isdisjoint({a0, a1})
    kv.allocate(2, 8)  # the free list is empty now: evicts a1 (the tail), keeps a0
    assert kv.block_table(2)[3] == a1 and list(kv.pool.evictable) == [a0]
    assert kv.match_prefix(3, a) == 2  # the head still hits
    assert kv.block_table(3) == [a0]


def test_eviction_order_follows_free_time_and_hits() -> None:
    kv = make(num_blocks=5, block_size=2, caching=True)  # blocks 1..4
    run_step(kv, 1, [1, 1, 0], 3)
    run_step(kv, 2, [2, 2, 0], 3)
    x, y = kv.block_table(1)[0], kv.block_table(2)[0]
    kv.free(1)
    kv.free(2)
    assert list(kv.pool.evictable) == [x, y]  # x freed first, evicted first
    assert kv.match_prefix(3, [1, 1, 5]) == 2  # a hit touches x ...
    kv.free(3)
    assert list(kv.pool.evictable) == [y, x]  # ... so y is now the least recently freed
    kv.allocate(4, 6)  # the two free blocks, then one eviction
    assert y in kv.block_table(4) and list(kv.pool.evictable) == [x]


# ---- prefix hits ------------------------------------------------------------------------------


def test_shared_prefix_shares_exactly_its_full_blocks() -> None:
    kv = make(num_blocks=12, block_size=4, caching=True)
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    b = [1, 2, 3, 4, 5, 6, 7, 8, 9, 99, 98]  # common prefix: 9 tokens, 2 full blocks
    run_step(kv, 1, a, len(a))
    assert kv.match_prefix(2, b) == 8
    assert kv.block_table(2) == kv.block_table(1)[:2]
    assert [kv.pool.ref_counts[x] for x in kv.block_table(1)] == [2, 2, 1]
    assert kv.tokens_held[2] == 8
    run_step(kv, 2, b, len(b))
    assert kv.block_table(2)[2] != kv.block_table(1)[2]
    assert (kv.prefix_hit_tokens, kv.prefix_queries_tokens) == (8, 11)


def test_prefix_hit_never_covers_the_last_prompt_token() -> None:
    kv = make(num_blocks=12, block_size=4, caching=True)
    prompt = list(range(8))
    run_step(kv, 1, prompt, 8)
    assert kv.match_prefix(2, prompt) == 4  # two full blocks cached, one adopted
    assert kv.match_prefix(3, [*prompt, 8]) == 8
    assert kv.match_prefix(4, prompt[:1]) == 0 and kv.num_live == 3  # no trace on a miss


def test_prefix_caching_off_matches_nothing() -> None:
    kv = make(num_blocks=12, block_size=4)
    run_step(kv, 1, list(range(9)), 9)
    assert kv.match_prefix(2, list(range(9))) == 0
    assert (kv.prefix_hit_tokens, kv.prefix_queries_tokens) == (0, 0)
    kv.free(1)
    assert kv.num_cached_blocks == 0 and len(kv.pool.free) == 11


def test_hash_collision_is_never_a_hit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paged_module, "hash_block_tokens", _colliding_hash)
    kv = make(num_blocks=12, block_size=2, caching=True)
    run_step(kv, 1, [1, 2, 3, 4, 0], 5)  # blocks [1 2] [3 4]
    assert kv.match_prefix(2, [5, 6, 3, 4, 0]) == 0  # same hash, other tokens
    # Same hash and same tokens, but another prefix: [3 4] after [5 6] is not [3 4] after
    # [1 2] (its K/V saw other tokens), so only [5 6] may hit once it is cached.
    run_step(kv, 3, [5, 6, 0], 3)
    assert kv.match_prefix(4, [5, 6, 3, 4, 0]) == 2
    assert kv.block_table(4) == kv.block_table(3)[:1]
    assert kv.match_prefix(5, [1, 2, 3, 4, 0]) == 4  # the true prefix still hits
    assert kv.block_table(5) == kv.block_table(1)[:2]


# ---- copy-on-write ----------------------------------------------------------------------------


def test_fork_copies_a_partly_filled_last_block_on_write() -> None:
    kv = make(num_blocks=8, block_size=4)
    run_step(kv, 1, list(range(6)), 6)  # one full block, one holding 2 tokens
    full, partial = kv.block_table(1)
    kv.fork(1, 2)
    assert kv.block_table(2) == [full, partial] and kv.tokens_held[2] == 6
    assert kv.pool.ref_counts[full] == kv.pool.ref_counts[partial] == 2
    assert kv.bytes_used() == 6 * BPT  # shared blocks counted once

    assert kv.can_allocate(2, 7)
    (dst,) = kv.allocate(2, 7)
    assert kv.take_copies() == [(partial, dst)] and kv.take_copies() == []
    assert kv.block_table(1) == [full, partial]  # the parent is untouched
    assert kv.block_table(2) == [full, dst]
    assert [kv.pool.ref_counts[b] for b in (full, partial, dst)] == [2, 1, 1]
    assert kv.bytes_used() == (4 + 2 + 2) * BPT  # the copy holds the 2 tokens too

    assert kv.allocate(1, 7) == [] and kv.take_copies() == []  # the parent owns it alone


def test_full_shared_block_is_not_copied() -> None:
    kv = make(num_blocks=8, block_size=4)
    run_step(kv, 1, list(range(8)), 8)
    kv.fork(1, 2)
    new = kv.allocate(2, 9)
    assert len(new) == 1 and kv.take_copies() == []
    assert kv.block_table(2)[:2] == kv.block_table(1)


def test_can_allocate_counts_the_copy() -> None:
    kv = make(num_blocks=4, block_size=4)  # blocks 1..3
    run_step(kv, 1, list(range(6)), 6)
    kv.fork(1, 2)
    # The child's 9th token needs a private copy of block 1 and a new block 2: 2 > 1 free.
    assert kv.num_free_blocks == 1
    assert kv.can_allocate(2, 7) and not kv.can_allocate(2, 9)
    with pytest.raises(RuntimeError):
        kv.allocate(2, 9)


def test_fork_of_blocks_reserved_ahead_privatizes_them() -> None:
    kv = make(num_blocks=10, block_size=2)
    run_step(kv, 1, [1, 2, 3], 3)
    kv.allocate(1, 8)  # reserved ahead, not written
    kv.fork(1, 2)
    new = kv.allocate(2, 8)
    assert len(new) == 3  # the partial block (copied) and two empty ones (not copied)
    assert kv.take_copies() == [(kv.block_table(1)[1], kv.block_table(2)[1])]
    assert kv.block_table(2)[0] == kv.block_table(1)[0]
    assert set(kv.block_table(2)[1:]).isdisjoint(kv.block_table(1))


# ---- sliding window ---------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 2, 3, 4])
@pytest.mark.parametrize("window", [1, 2, 3, 5, 8, 13])
def test_window_bounds_memory_per_sequence(block_size: int, window: int) -> None:
    kv = make(num_blocks=64, block_size=block_size, window=window)
    bound = -(-(window + block_size) // block_size) + 1
    tokens = list(range(100))
    run_step(kv, 1, tokens, 5)
    for total in range(6, 100):
        kv.allocate(1, total)
        assert kv.num_blocks_in_use <= bound
        kv.commit(1, total, tokens)
        table = kv.block_table(1)
        # Exactly the blocks wholly before the window are released.
        for b, block in enumerate(table):
            assert (block == NULL) == ((b + 1) * block_size <= total - window + 1)
    assert kv.bytes_reserved() <= bound * block_size * BPT
    kv.free(1)
    assert kv.num_free_blocks == 63


def test_window_release_respects_sharing() -> None:
    kv = make(num_blocks=16, block_size=2, window=2)
    run_step(kv, 1, list(range(4)), 4)
    kv.fork(1, 2)
    assert kv.block_table(2)[0] == NULL  # already out of the window when forked
    assert kv.pool.ref_counts[kv.block_table(1)[1]] == 2
    run_step(kv, 1, list(range(8)), 6)  # the parent moves on and lets go of block 1
    assert kv.block_table(1)[1] == NULL and kv.block_table(2)[1] != NULL
    assert kv.pool.ref_counts[kv.block_table(2)[1]] == 1  # still the child's


def test_window_with_prefix_cache_keeps_released_full_blocks_cached() -> None:
    kv = make(num_blocks=16, block_size=2, caching=True, window=2)
    prompt = [1, 2, 3, 4, 5, 6, 7]
    run_step(kv, 1, prompt, 7)
    assert kv.block_table(1)[:3] == [NULL, NULL, NULL]
    assert kv.num_cached_blocks == 3  # released by the window, but their content is cached
    assert kv.match_prefix(2, prompt) == 6
    # The hit's head is already outside the new sequence's window too.
    assert kv.block_table(2)[:2] == [NULL, NULL] and kv.block_table(2)[2] != NULL


# ---- misuse -----------------------------------------------------------------------------------


def test_misuse_is_rejected() -> None:
    kv = make(num_blocks=3, block_size=2)
    assert not kv.can_allocate(1, 5)
    with pytest.raises(RuntimeError):
        kv.allocate(1, 5)
    kv.allocate(1, 4)
    assert NULL not in kv.block_table(1)
    with pytest.raises(ValueError):
        kv.commit(1, 5)
    with pytest.raises(ValueError):
        kv.fork(1, 1)
    assert kv.free(99) == []
