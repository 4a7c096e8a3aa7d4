"""A tiered KV cache: full blocks evicted from the KV pool move to host memory and then to disk
(each tier with a size limit, least recently used first out), so that a later prompt with the
same prefix loads them back instead of recomputing them (vLLM's CPU offloading, LMCache's
local CPU and disk backends).

Blocks are known by the content the pool gave them (`CachedBlock`: chained hash, tokens,
parent content id, content id), so a block loaded back is adopted under its old content id and
the blocks cached after it on the device still chain onto it.

The store keeps the index and the host copies; the bytes move in the model runner
(`BlockTransfer`, executed in order before the step's forward): a *save* copies an evicted
block's K/V out before anything overwrites it, a *load* copies a tier's copy into a fresh
block. Until its save has run, an entry has no payload and cannot leave the host; until its
load has run, it is pinned. A request's disk blocks are read ahead on the disk tier's reader
thread when it arrives (`prefetch`), so that its admission finds them in memory; what was not
read ahead by then is read when the prefix is matched. Either way a corrupt file is found
before anything trusts it: the match stops there and the rest is recomputed. Disk writes
happen on the disk tier's writer thread. Tiers are inclusive: a block read back from disk
keeps its file, and one evicted from host that is already on disk costs nothing.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import psutil
import torch

from engines.base import ConfigError
from engines.builtin.kv_cache.block_pool import CachedBlock
from engines.builtin.kv_cache.disk_tier import CorruptBlockError, DiskTier

TIERS = ("host", "disk")
#: the least host memory the disk tier may fill with blocks waiting for their writes
WRITE_BUFFER_BYTES = 256 << 20


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """One block's bytes between the KV pool and the store: `save` (pool block -> store entry
    `key`) or `load` (entry `key` -> pool block). A load with a `payload` takes its bytes from
    it instead of the store: K/V a prefill instance computed (disaggregation, key -1)."""

    kind: str
    block: int
    key: int
    payload: torch.Tensor | None = None


@dataclass(slots=True)
class TierEntry:
    meta: CachedBlock
    payload: torch.Tensor | None = None  # host copy (host tier, or waiting for its disk write)
    saved: bool = False  # the runner has copied the bytes in
    in_host: bool = True
    on_disk: bool = False  # its file is written and confirmed
    writing: bool = False
    write_id: int = 0  # the disk tier's number for the write in flight
    pins: int = 0  # loads planned and not run yet
    prefetching: bool = False  # a read ahead of need is queued or under way
    read_id: int = 0  # the disk tier's number for it


@dataclass
class TierCounters:
    """Since the store was made. Blocks are the pool's blocks (block_size tokens each)."""

    saved_blocks: int = 0  # evicted device blocks copied to the host tier
    loaded_blocks: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    disk_written_blocks: int = 0
    disk_read_bytes: int = 0  # read on the step loop
    disk_read_ns: int = 0  # reading, or waiting for a read ahead under way, on the step loop
    prefetched_blocks: int = 0  # read ahead of need, off the step loop
    prefetch_read_ns: int = 0
    prefetch_unused: int = 0  # read ahead, then let go before any load used them
    dropped_blocks: int = 0  # left the last tier (or never fit one)
    disk_write_errors: int = 0
    corrupt_blocks: int = 0  # failed their checks when read: recomputed instead
    last_error: str = ""


class KVTierStore:
    """Host and disk tiers for blocks of `block_bytes` (a block's K/V over every layer, scales
    included). `host_bytes`, `disk_bytes`: each tier's limit (0: no such tier);
    `disk_path`: where the disk tier makes its folder (None: the system's temporary folder);
    `prefetch`: read a request's disk blocks ahead of need when it arrives.

    Blocks on their way to disk keep their host copy until the write is done: the disk's
    write buffer, at most `max_pending_writes` blocks (as many as the host tier holds, or
    WRITE_BUFFER_BYTES' worth if that is more), beyond which the host tier drops what it lets
    go; so host memory stays within its limit plus the buffer however slow the disk. Blocks
    read ahead and not loaded yet take at most WRITE_BUFFER_BYTES more (the oldest are let go
    first)."""

    def __init__(
        self,
        block_bytes: int,
        host_bytes: int,
        disk_bytes: int,
        disk_path: str | None = None,
        prefetch: bool = True,
    ) -> None:
        self.block_bytes = block_bytes
        self.host_capacity = host_bytes // block_bytes  # in blocks
        self.disk_capacity = disk_bytes // block_bytes
        self.disk = DiskTier(disk_path) if self.disk_capacity else None
        self.max_pending_writes = max(WRITE_BUFFER_BYTES // block_bytes, self.host_capacity, 1)
        self._pending_writes = 0
        self.prefetch_enabled = prefetch
        self.max_prefetched = max(WRITE_BUFFER_BYTES // block_bytes, 1)
        self._reads_in_flight = 0
        # blocks read ahead whose payload is held outside the host tier, oldest first
        self._prefetched: OrderedDict[int, None] = OrderedDict()
        self.entries: dict[int, TierEntry] = {}
        self._by_hash: dict[int, list[int]] = {}
        # insertion order is eviction order: the first key was used longest ago
        self._host: OrderedDict[int, None] = OrderedDict()
        self._disk: OrderedDict[int, None] = OrderedDict()
        self.counters = TierCounters()
        self._reads_reported = (0, 0)

    # ---- what is where ----------------------------------------------------------------------

    @property
    def host_blocks(self) -> int:
        return len(self._host)

    @property
    def disk_blocks(self) -> int:
        return len(self._disk)

    def lookup(self, block_hash: int, token_ids: tuple[int, ...], parent: int | None) -> int | None:
        """The key of a stored block with this hash, these tokens and this parent (as
        `BlockPool.lookup`), whose bytes are saved or will be before any load of them."""
        self._collect()
        for key in self._by_hash.get(block_hash, ()):
            meta = self.entries[key].meta
            if meta.token_ids == token_ids and meta.parent == parent:
                return key
        return None

    def tier_of(self, key: int) -> str:
        """Where a load of `key` would come from now (a block evicted and matched again in one
        step, its save still to run, counts for the tier it is headed to)."""
        return "host" if self.entries[key].in_host and self.host_capacity else "disk"

    def take_step_reads(self) -> tuple[int, int]:
        """Disk bytes read and the time it took since the last call (per step)."""
        now = (self.counters.disk_read_bytes, self.counters.disk_read_ns)
        before, self._reads_reported = self._reads_reported, now
        return now[0] - before[0], now[1] - before[1]

    def meta(self, key: int) -> CachedBlock:
        return self.entries[key].meta

    # ---- the pool's side --------------------------------------------------------------------

    def reserve(self, meta: CachedBlock) -> bool:
        """A cached block is leaving the pool; True when the runner must save its bytes
        (False: the store holds them already)."""
        self._collect()
        key = meta.content_id
        entry = self.entries.get(key)
        if entry is not None:
            if entry.in_host:
                self._host.move_to_end(key)
            return False
        if not self.host_capacity and not self.disk_capacity:
            return False
        self.entries[key] = TierEntry(meta)
        self._by_hash.setdefault(meta.block_hash, []).append(key)
        self._host[key] = None
        return True

    def prefetch(self, keys: list[int]) -> int:
        """Start reading the blocks among `keys` (a waiting request's prefix) that are on disk
        only, so that claiming them waits less or not at all; returns the reads started."""
        if self.disk is None or not self.prefetch_enabled or not self.disk.reads_ahead:
            return 0
        self._collect()
        started = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is None or entry.payload is not None or entry.prefetching:
                continue
            if not (entry.saved and entry.on_disk):
                continue
            while self._prefetched and self._reads_in_flight + len(self._prefetched) >= (
                self.max_prefetched
            ):
                self._let_go_oldest_read_ahead()
            if self._reads_in_flight >= self.max_prefetched:
                break
            entry.prefetching = True
            self._reads_in_flight += 1
            entry.read_id = self.disk.read_async(key, self.block_bytes)
            started += 1
        return started

    def claim(self, key: int) -> str | None:
        """Plan a load of `key`: the tier it comes from, after reading a disk copy into host
        memory (or taking the copy read ahead, waiting for it if its read is under way) and
        checking it; None when that copy is corrupt or unreadable (the entry is dropped and
        counted; the caller recomputes the block)."""
        entry = self.entries[key]
        tier = self.tier_of(key)
        if entry.prefetching:
            self._take_reads()  # it may have come
        if entry.prefetching:
            assert self.disk is not None
            # no reader (a forked child: its lock may be held by a thread that is gone), or
            # still queued: read below, not after the queue
            if not self.disk.reads_ahead or self.disk.call_off(entry.read_id):
                entry.prefetching = False
            else:  # under way: wait for it rather than read it twice
                start = time.perf_counter_ns()
                while entry.prefetching and self._take_reads(wait=True):
                    pass
                entry.prefetching = False  # answered, or the reader no longer answers
                self.counters.disk_read_ns += time.perf_counter_ns() - start
        self._prefetched.pop(key, None)
        if entry.saved and entry.payload is None:  # on disk only
            assert self.disk is not None
            start = time.perf_counter_ns()
            try:
                entry.payload = self.disk.read(key, self.block_bytes)
            except CorruptBlockError as exc:
                self.counters.corrupt_blocks += 1
                self.counters.last_error = str(exc)
                self._remove(key)
                return None
            self.counters.disk_read_ns += time.perf_counter_ns() - start
            self.counters.disk_read_bytes += self.block_bytes
        if entry.in_host:
            self._host.move_to_end(key)
        else:
            entry.in_host = True
            self._host[key] = None
        if key in self._disk:
            self._disk.move_to_end(key)
        entry.pins += 1
        self.counters.loaded_blocks[tier] += 1
        return tier

    # ---- the runner's side ------------------------------------------------------------------

    def fill(self, key: int, payload: torch.Tensor) -> None:
        """The bytes of a reserved block, saved before the pool reused it."""
        entry = self.entries[key]
        entry.payload, entry.saved = payload, True
        self.counters.saved_blocks += 1
        self._shrink_host()

    def payload(self, key: int) -> torch.Tensor:
        payload = self.entries[key].payload
        if payload is None:
            raise RuntimeError(f"KV tier block {key} has no bytes to load")
        return payload

    def release(self, key: int) -> None:
        """A planned load has run (or will not)."""
        entry = self.entries.get(key)
        if entry is not None:
            entry.pins -= 1
            self._shrink_host()

    def drop(self, key: int) -> None:
        """Forget a block whose save did not run: nothing may load bytes that were never
        saved."""
        if key in self.entries:
            self._remove(key)

    def sync(self) -> None:
        """Wait for the disk writes queued so far, and take in their outcomes."""
        if self.disk is not None:
            self.disk.flush()
            self._collect()

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()

    # ---- limits -----------------------------------------------------------------------------

    def _shrink_host(self) -> None:
        """Least recently used first, the host tier's saved, unpinned blocks go to disk (or
        are dropped) until it is within its limit; blocks waiting for their save or load
        stay, so it may be over for a step."""
        excess = len(self._host) - self.host_capacity
        if excess <= 0:
            return
        leaving = []
        for key in self._host:  # from the least recently used; few are skipped
            entry = self.entries[key]
            if entry.saved and not entry.pins:
                leaving.append(key)
                if len(leaving) == excess:
                    break
        for key in leaving:
            entry = self.entries[key]
            del self._host[key]
            entry.in_host = False
            if entry.on_disk:
                entry.payload = None
            elif entry.writing:
                pass  # the payload goes once the write is confirmed
            elif self.disk is not None and self._pending_writes < self.max_pending_writes:
                entry.writing = True
                self._pending_writes += 1
                self._disk[key] = None
                assert entry.payload is not None
                entry.write_id = self.disk.write_async(key, entry.payload)
                self._shrink_disk()
            else:
                self._remove(key)

    def _shrink_disk(self) -> None:
        assert self.disk is not None
        while len(self._disk) > self.disk_capacity:
            key, _ = self._disk.popitem(last=False)
            entry = self.entries[key]
            if entry.writing:
                self._pending_writes -= 1
            entry.on_disk = entry.writing = False
            self.disk.delete_async(key)  # after its write, if one is queued
            if not entry.in_host:
                self._remove(key, on_disk=False)

    def _take_reads(self, wait: bool = False) -> int:
        """Take in the reads ahead finished since the last call (with `wait`, at least one
        unless the reader has ended); returns how many. A read that failed leaves the block
        to be read, and its fault counted, when it is claimed."""
        assert self.disk is not None
        reads = self.disk.take_reads(wait)
        for done in reads:
            self._reads_in_flight -= 1
            entry = self.entries.get(done.key)
            if entry is None or not entry.prefetching or entry.read_id != done.read_id:
                continue  # dropped, or claimed and read, while its read was queued
            entry.prefetching = False
            self.counters.prefetch_read_ns += done.read_ns
            if done.payload is None or entry.payload is not None or not entry.on_disk:
                continue
            entry.payload = done.payload
            self._prefetched[done.key] = None
            self.counters.prefetched_blocks += 1
        return len(reads)

    def _let_go_oldest_read_ahead(self) -> None:
        """Make room for another read ahead: the one read longest ago and still unused goes
        (its file stays; a claim reads it on the loop)."""
        key, _ = self._prefetched.popitem(last=False)
        entry = self.entries[key]
        if not entry.in_host and entry.on_disk and not entry.pins:
            entry.payload = None
            self.counters.prefetch_unused += 1

    def _collect(self) -> None:
        """Take in the disk writes and reads ahead finished since the last call."""
        if self.disk is None:
            return
        self._take_reads()
        for done in self.disk.take_done():
            entry = self.entries.get(done.key)
            if entry is None or not entry.writing or entry.write_id != done.write_id:
                continue  # evicted from disk while its write was queued (its file deleted)
            entry.writing = False
            self._pending_writes -= 1
            if done.error is None:
                entry.on_disk = True
                self.counters.disk_written_blocks += 1
                if not entry.in_host:
                    entry.payload = None
                continue
            self.counters.disk_write_errors += 1
            self.counters.last_error = done.error
            del self._disk[done.key]
            if not entry.in_host:
                self._remove(done.key, on_disk=False)

    def _remove(self, key: int, on_disk: bool | None = None) -> None:
        entry = self.entries.pop(key)
        same_hash = self._by_hash[entry.meta.block_hash]
        same_hash.remove(key)
        if not same_hash:
            del self._by_hash[entry.meta.block_hash]
        self._host.pop(key, None)
        self._prefetched.pop(key, None)
        if entry.writing:
            self._pending_writes -= 1
        if key in self._disk or on_disk:
            self._disk.pop(key, None)
            assert self.disk is not None
            self.disk.delete_async(key)
        self.counters.dropped_blocks += 1


def build_tier_store(
    block_bytes: int,
    host_bytes: int,
    disk_bytes: int,
    disk_path: str | None,
    prefetch: bool = True,
) -> KVTierStore:
    """The store for engine.kv_host_tier_bytes / kv_disk_tier_bytes / kv_disk_tier_path, once
    each tier holds a block at least, the host tier fits this machine's memory and the disk
    tier the free space where it goes (ConfigError naming the key otherwise)."""
    parent = disk_path or tempfile.gettempdir()
    free = shutil.disk_usage(parent).free if os.path.isdir(parent) else None
    for key, size, most, where in (
        ("kv_host_tier_bytes", host_bytes, psutil.virtual_memory().total, "this machine's memory"),
        ("kv_disk_tier_bytes", disk_bytes, free, f"the free space in {parent}"),
    ):
        if size and size < block_bytes:
            raise ConfigError(
                f"engine.{key}={size} holds no KV block ({block_bytes} bytes each); allowed: 0 "
                f"or at least {block_bytes}"
            )
        if size and most is not None and size > most:
            raise ConfigError(
                f"engine.{key}={size} is more than {where} ({most} bytes); allowed: at most {most}"
            )
    try:
        return KVTierStore(block_bytes, host_bytes, disk_bytes, disk_path, prefetch)
    except OSError as exc:
        raise ConfigError(
            f"engine.kv_disk_tier_path={disk_path!r}: the disk tier cannot make its folder there "
            f"({exc.strerror or exc}); allowed: an existing, writable folder"
        ) from exc
