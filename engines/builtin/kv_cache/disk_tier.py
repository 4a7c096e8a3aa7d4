"""The disk tier of a tiered KV cache: one checksummed file per block in a folder of its own,
written by a background thread so that no step waits for the disk.

Only the writer thread touches files it has been asked to write or delete, in the order asked
(a delete queued after a write of the same block runs after it). Reads are asked only of blocks
whose write was reported done: on the caller's thread (`read`), or ahead of need on the reader
thread (`read_async`, in the order asked; one not started yet can be called off), whose file
the writer may delete meanwhile (the read then fails or returns the complete file: writes land
by rename). Results come back through `take_done()` and `take_reads()`, so the index
(tiers.py) is only ever changed on the engine's thread. Each write and each read ahead carries
a number of its own, so the outcome of an older one for a block is never taken for a newer
one's.

File layout: MAGIC, then little-endian (key, payload bytes, crc32 of the payload), then the
payload. A read checks all four; a file that fails any check is reported corrupt, never used.

The tier's folder (`inferlab-kv-<pid>-<id>`) goes at `close()`, when the tier is
garbage-collected, or at a normal exit of the process that made it (not of a forked child). A
killed process leaves it behind: the next disk tier made in the same parent folder removes the
folders of processes that no longer exist.
"""

from __future__ import annotations

import contextlib
import os
import queue
import re
import shutil
import struct
import tempfile
import threading
import time
import uuid
import weakref
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

MAGIC = b"IFLKVB01"
_HEADER = struct.Struct("<qqI")
_FOLDER = re.compile(r"inferlab-kv-(\d+)-[0-9a-f]{8}")


class CorruptBlockError(Exception):
    """A tier file that does not hold what its header and checksum say."""


@dataclass(frozen=True, slots=True)
class WriteDone:
    """The writer thread's answer for one write: `error` is None when the file is complete."""

    key: int
    write_id: int
    error: str | None


@dataclass
class WriterStats:
    """Written by the writer thread, read as counters."""

    bytes_written: int = 0
    write_ns: int = 0


@dataclass(frozen=True, slots=True)
class ReadDone:
    """The reader thread's answer for one read ahead: the checked payload, or why there is
    none (also when it was called off); `read_ns`: the time the read took, off the step
    loop."""

    read_id: int
    key: int
    payload: torch.Tensor | None
    error: str | None
    read_ns: int


# A job: (kind, key, write id, payload or flush event); None ends the thread.
Job = tuple[str, int, int, Any] | None
# A read ahead: (read id, key, payload bytes); None ends the thread.
ReadJob = tuple[int, int, int] | None


class _Reads:
    """What the engine's thread and the reader thread share: the reads ahead queued, the one
    under way, and those called off before they started (a claim that finds its block still
    queued reads it itself rather than wait for every read queued before it)."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[ReadJob] = queue.SimpleQueue()
        self.done: queue.SimpleQueue[ReadDone] = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.under_way: int | None = None  # its read id
        self.called_off: set[int] = set()

    def start(self, read_id: int) -> bool:
        """On the reader thread: True when `read_id` may go ahead (it is then under way)."""
        with self.lock:
            go = read_id not in self.called_off
            # ids come in order: any called off below this one are answered already
            self.called_off = {i for i in self.called_off if i > read_id}
            self.under_way = read_id if go else None
            return go

    def call_off(self, read_id: int) -> bool:
        """On the engine's thread: False when the read is under way (wait for it)."""
        with self.lock:
            if self.under_way == read_id:
                return False
            self.called_off.add(read_id)
            return True


def _block_file(folder: Path, key: int) -> Path:
    return folder / f"{key:016x}.kv"


def _stale_folders(base: Path) -> list[Path]:
    """Folders a disk tier of a process that no longer exists left in `base`."""
    stale = []
    for child in base.iterdir():
        match = _FOLDER.fullmatch(child.name)
        if match is None or not child.is_dir():
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            stale.append(child)
        except (PermissionError, OverflowError):
            pass  # alive (another user's), or not a pid
    return stale


def _shut_down(
    jobs: queue.SimpleQueue[Job],
    writer: threading.Thread,
    reads: _Reads,
    reader: threading.Thread,
    path: Path,
    pid: int,
) -> None:
    """Stop the threads (the reads ahead still queued are dropped, not read), then remove
    the folder; only in the process that made it (a forked child's exit must not take its
    parent's files)."""
    if os.getpid() != pid:
        return
    with contextlib.suppress(queue.Empty):
        while True:
            reads.jobs.get_nowait()
    for thread, queued in ((writer, jobs), (reader, reads.jobs)):
        if thread.is_alive():
            queued.put(None)
            thread.join()
    shutil.rmtree(path, ignore_errors=True)


def _write_all(out: Any, data: bytes | memoryview) -> None:
    """Every byte, or OSError: an unbuffered write may take fewer bytes than it was given."""
    view = memoryview(data).cast("B")
    while view:
        written = out.write(view)
        if not written:
            raise OSError(f"the disk took 0 of the last {view.nbytes} bytes")
        view = view[written:]


def _write_file(path: Path, key: int, payload: torch.Tensor, stats: WriterStats) -> str | None:
    # Little Python between the system calls, which let go of the GIL: this thread shares it
    # with the engine's step loop.
    start = time.perf_counter_ns()
    body = memoryview(payload.numpy().data)
    header = MAGIC + _HEADER.pack(key, body.nbytes, zlib.crc32(body))
    target = _block_file(path, key)
    partial = f"{target}.partial"
    try:
        with open(partial, "wb", buffering=0) as out:
            _write_all(out, header)
            _write_all(out, body)
        os.replace(partial, target)  # a reader never sees half a file under the real name
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(partial)
        return f"{type(exc).__name__}: {exc}"
    stats.bytes_written += body.nbytes
    stats.write_ns += time.perf_counter_ns() - start
    return None


def _write_loop(
    jobs: queue.SimpleQueue[Job], done: queue.SimpleQueue[WriteDone], path: Path, stats: WriterStats
) -> None:
    # A function, not a method: a thread holding the tier would keep it from being collected.
    while True:
        job = jobs.get()
        if job is None:
            return
        kind, key, write_id, payload = job
        if kind == "flush":
            payload.set()
        elif kind == "delete":
            with contextlib.suppress(OSError):
                _block_file(path, key).unlink()
        else:
            done.put(WriteDone(key, write_id, _write_file(path, key, payload, stats)))


def _read_file(path: Path, key: int, nbytes: int) -> torch.Tensor:
    """The block's payload as written, checked; CorruptBlockError otherwise (a missing or
    short file, another block's header, a wrong checksum)."""
    file = _block_file(path, key)
    try:
        raw = file.read_bytes()
    except OSError as exc:
        raise CorruptBlockError(f"{file.name}: {exc.strerror}") from exc
    start = len(MAGIC) + _HEADER.size
    if len(raw) != start + nbytes or raw[: len(MAGIC)] != MAGIC:
        raise CorruptBlockError(f"{file.name}: not a {nbytes}-byte block file")
    stored_key, stored_len, crc = _HEADER.unpack_from(raw, len(MAGIC))
    body = memoryview(raw)[start:]
    if stored_key != key or stored_len != nbytes or zlib.crc32(body) != crc:
        raise CorruptBlockError(f"{file.name}: header or checksum mismatch")
    return torch.frombuffer(bytearray(body), dtype=torch.uint8)


def _read_loop(reads: _Reads, path: Path) -> None:
    while True:
        job = reads.jobs.get()
        if job is None:
            return
        read_id, key, nbytes = job
        if not reads.start(read_id):
            reads.done.put(ReadDone(read_id, key, None, "called off", 0))
            continue
        start = time.perf_counter_ns()
        try:
            payload, error = _read_file(path, key, nbytes), None
        except Exception as exc:  # answered, whatever it is: a claim may be waiting for it
            payload, error = None, str(exc)
        with reads.lock:
            reads.under_way = None
        reads.done.put(ReadDone(read_id, key, payload, error, time.perf_counter_ns() - start))


class DiskTier:
    """Block files under a fresh folder made inside `parent` (None: the system's temporary
    folder), which must exist; no file but the tier's own is touched."""

    def __init__(self, parent: str | None) -> None:
        base = Path(parent if parent is not None else tempfile.gettempdir()).expanduser()
        if not base.is_dir():
            raise NotADirectoryError(f"{base} is not an existing folder")
        for stale in _stale_folders(base):
            shutil.rmtree(stale, ignore_errors=True)
        self.path = base / f"inferlab-kv-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        try:
            probe = self.path / "probe"
            probe.write_bytes(b"0")  # fails now, at start, on a folder that cannot be written
            probe.unlink()
        except OSError:
            shutil.rmtree(self.path, ignore_errors=True)
            raise
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        self._done: queue.SimpleQueue[WriteDone] = queue.SimpleQueue()
        self.stats = WriterStats()
        self._writer = threading.Thread(
            target=_write_loop,
            args=(self._jobs, self._done, self.path, self.stats),
            name="kv-disk-tier",
            daemon=True,
        )
        self._writer.start()
        self._reads = _Reads()
        self._next_read_id = 0
        self._pid = os.getpid()
        self._reader = threading.Thread(
            target=_read_loop,
            args=(self._reads, self.path),
            name="kv-disk-tier-reader",
            daemon=True,
        )
        self._reader.start()
        self._shutdown = weakref.finalize(
            self,
            _shut_down,
            self._jobs,
            self._writer,
            self._reads,
            self._reader,
            self.path,
            os.getpid(),
        )
        self._next_write_id = 0

    def file(self, key: int) -> Path:
        return _block_file(self.path, key)

    def write_async(self, key: int, payload: torch.Tensor) -> int:
        """Queue the block's file; returns the write's number, which its outcome in
        take_done() carries."""
        self._next_write_id += 1
        self._jobs.put(("write", key, self._next_write_id, payload))
        return self._next_write_id

    def delete_async(self, key: int) -> None:
        self._jobs.put(("delete", key, 0, None))

    def take_done(self) -> list[WriteDone]:
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                return done

    def read(self, key: int, nbytes: int) -> torch.Tensor:
        """The block's payload as written, checked; CorruptBlockError otherwise."""
        return _read_file(self.path, key, nbytes)

    @property
    def reads_ahead(self) -> bool:
        """Whether the reader thread answers (not in a forked child, where it is gone)."""
        return os.getpid() == self._pid and self._reader.is_alive()

    def read_async(self, key: int, nbytes: int) -> int:
        """Queue a read ahead of the block for the reader thread; returns its number, which
        its ReadDone in take_reads() carries."""
        self._next_read_id += 1
        self._reads.jobs.put((self._next_read_id, key, nbytes))
        return self._next_read_id

    def call_off(self, read_id: int) -> bool:
        """Call off a read ahead that has not started (its ReadDone still comes, empty);
        False when it is under way."""
        return self._reads.call_off(read_id)

    def take_reads(self, wait: bool = False) -> list[ReadDone]:
        """The reads ahead answered since the last call; with `wait`, at least one (the
        caller knows one is under way), unless the reader no longer answers."""
        done: list[ReadDone] = []
        while wait and not done and self.reads_ahead:
            with contextlib.suppress(queue.Empty):
                done.append(self._reads.done.get(timeout=0.5))
        while True:
            try:
                done.append(self._reads.done.get_nowait())
            except queue.Empty:
                return done

    def flush(self) -> None:
        """Wait until every queued job has run (tests; close)."""
        if not self._writer.is_alive():
            return
        marker = threading.Event()
        self._jobs.put(("flush", 0, 0, marker))
        marker.wait()

    def close(self) -> None:
        self._shutdown()
