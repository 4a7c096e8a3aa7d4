"""KV connectors: how a prompt's K/V go from a prefill instance to a decode instance
(`engine.kv_connector`). Each instance opens its end (`open`) from what the router set up
(`setup`); a prefill instance calls `send`, on a thread of its own, off its step loop; a decode
instance calls `receive` on a thread of its own and gets hand-offs in the order they complete.

- `shm` (one host): the sender writes the K/V into a file in shared memory (/dev/shm), then
  names it to the decode instance over a local socket; the receiver copies it out and removes
  it (so shared memory holds only hand-offs in flight).
- `gloo`: torch.distributed point-to-point sends over TCP (vLLM's and SGLang's connectors on
  CPU use the same transport; NCCL would take its place on GPUs).
"""

from __future__ import annotations

import itertools
import os
import secrets
import shutil
import socket
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from pathlib import Path
from queue import Queue
from typing import Any

import torch
import torch.distributed as dist

from engines.base import now_ns
from engines.builtin.disaggregation.messages import PREFILL, KVHandoff
from engines.registry import Registry


class ConnectorClosedError(RuntimeError):
    """The connector was closed while a receive waited."""


class KVConnector(ABC):
    """One instance's end of the links between prefill and decode instances."""

    def address(self) -> Any:
        """What prefill instances need to reach this (decode) instance; None: nothing."""
        return None

    def connect(self, addresses: list[Any]) -> None:  # noqa: B027 (most need no addresses)
        """A prefill instance learns every decode instance's `address()`, in index order."""

    @abstractmethod
    def send(self, decode: int, handoff: KVHandoff) -> None:
        """Hand `handoff` to decode instance `decode`; blocks until it is on its way."""

    @abstractmethod
    def receive(self) -> KVHandoff:
        """The next hand-off that arrived (blocks); ConnectorClosedError once closed."""

    @abstractmethod
    def close(self) -> None:
        """Let go of the links (idempotent)."""


@dataclass(frozen=True)
class ConnectorKind:
    #: in the router: (prefill instances, decode instances) -> the links' setup, picklable
    setup: Callable[[int, int], Any]
    #: in an instance: (setup, role, index, prefill instances, decode instances) -> its end
    open: Callable[[Any, str, int, int, int], KVConnector]
    #: in the router, after every instance ended: what the setup left behind
    cleanup: Callable[[Any], None]


KV_CONNECTORS = Registry[ConnectorKind]("engine.kv_connector")


# ---- shared memory ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ShmLinks:
    folder: str  # the hand-offs' files, one per prompt, removed by their receiver
    authkey: bytes


_SHM_PREFIX = "inferlab-pd-"


def _shm_setup(num_prefill: int, num_decode: int) -> ShmLinks:
    parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for stale in Path(parent).glob(f"{_SHM_PREFIX}*-*"):  # a killed router's hand-offs
        pid = stale.name.removeprefix(_SHM_PREFIX).split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"{_SHM_PREFIX}{os.getpid()}-", dir=parent)
    return ShmLinks(folder, secrets.token_bytes(16))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's
    return True


def _shm_cleanup(links: ShmLinks) -> None:
    shutil.rmtree(links.folder, ignore_errors=True)  # hand-offs no decode instance took


class SharedMemoryConnector(KVConnector):
    def __init__(self, links: ShmLinks, role: str, index: int, num_prefill: int) -> None:
        self.links = links
        self.role, self.index = role, index
        self._names = itertools.count()
        self._clients: dict[int, Connection] = {}
        self._addresses: list[Any] = []
        self._arrived: Queue[KVHandoff | None] = Queue()
        self._listener: Listener | None = None
        if role != PREFILL:
            path = os.path.join(links.folder, f"decode-{index}.sock")
            self._listener = Listener(path, "AF_UNIX", authkey=links.authkey)
            for _ in range(num_prefill):  # one connection per prefill instance
                threading.Thread(target=self._accept_one, daemon=True).start()

    def address(self) -> Any:
        return None if self._listener is None else self._listener.address

    def connect(self, addresses: list[Any]) -> None:
        self._addresses = addresses

    def send(self, decode: int, handoff: KVHandoff) -> None:
        path = os.path.join(self.links.folder, f"{self.index}-{next(self._names)}.kv")
        payload = handoff.payload
        try:
            # the space first: a full /dev/shm is an error here, not a SIGBUS in the copy
            descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.posix_fallocate(descriptor, 0, max(1, payload.numel()))
            finally:
                os.close(descriptor)
            shared = torch.from_file(path, shared=True, size=payload.numel(), dtype=torch.uint8)
            shared.copy_(payload.reshape(-1))
            del shared  # unmapped: the file holds the bytes
            client = self._clients.get(decode)
            if client is None:
                client = Client(self._addresses[decode], "AF_UNIX", authkey=self.links.authkey)
                self._clients[decode] = client
            notice = (handoff.request_id, handoff.token_ids, handoff.read_ns, tuple(payload.shape))
            client.send((notice, path))
        except BaseException:
            Path(path).unlink(missing_ok=True)
            raise

    def _accept_one(self) -> None:
        assert self._listener is not None
        try:
            connection = self._listener.accept()
        except OSError:
            return  # closed before every prefill instance connected
        while True:
            try:
                (request_id, token_ids, read_ns, shape), path = connection.recv()
            except (EOFError, OSError):
                return  # that prefill instance ended
            size = shape[0] * shape[1]
            try:  # copied out: the file's shared memory goes now, not when the request ends
                payload = torch.from_file(path, shared=False, size=size, dtype=torch.uint8).clone()
            finally:
                Path(path).unlink(missing_ok=True)
            self._arrived.put(
                KVHandoff(request_id, token_ids, payload.view(shape), read_ns, now_ns())
            )

    def receive(self) -> KVHandoff:
        handoff = self._arrived.get()
        if handoff is None:
            raise ConnectorClosedError("the shared-memory connector is closed")
        return handoff

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
        self._clients = {}
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            self._arrived.put(None)


KV_CONNECTORS.add(
    "shm",
    ConnectorKind(
        _shm_setup,
        lambda links, role, index, num_prefill, _: SharedMemoryConnector(
            links, role, index, num_prefill
        ),
        _shm_cleanup,
    ),
)


# ---- gloo -------------------------------------------------------------------------------------

#: How long the receiving side's wait for the next hand-off may last (an idle engine sends
#: none); a peer that dies ends it at once (its connections close).
_GLOO_IDLE = timedelta(days=365)
_HEADER = 5  # request id bytes, tokens, rows, row bytes, read_ns


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class GlooConnector(KVConnector):
    """A world of every instance (prefill ranks first), made when the instances open it."""

    def __init__(self, port: int, role: str, index: int, num_prefill: int, num_decode: int):
        self.rank = index if role == PREFILL else num_prefill + index
        self.num_prefill = num_prefill
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=self.rank,
            world_size=num_prefill + num_decode,
            timeout=_GLOO_IDLE,
        )

    def send(self, decode: int, handoff: KVHandoff) -> None:
        rank = self.num_prefill + decode
        name = torch.frombuffer(bytearray(handoff.request_id.encode()), dtype=torch.uint8)
        tokens = torch.tensor(handoff.token_ids, dtype=torch.int64)
        rows, row_bytes = handoff.payload.shape
        header = torch.tensor([name.numel(), tokens.numel(), rows, row_bytes, handoff.read_ns])
        for part in (header, name, tokens, handoff.payload.contiguous()):
            dist.send(part, rank)

    def receive(self) -> KVHandoff:
        header = torch.zeros(_HEADER, dtype=torch.int64)
        try:
            source = dist.recv(header)
            name_len, num_tokens, rows, row_bytes, read_ns = header.tolist()
            name = torch.empty(name_len, dtype=torch.uint8)
            tokens = torch.empty(num_tokens, dtype=torch.int64)
            payload = torch.empty(rows, row_bytes, dtype=torch.uint8)
            for part in (name, tokens, payload):
                dist.recv(part, source)
        except RuntimeError as exc:
            if not dist.is_initialized():
                raise ConnectorClosedError("the gloo connector is closed") from exc
            raise
        request_id = bytes(name.tolist()).decode()
        return KVHandoff(request_id, tokens.tolist(), payload, read_ns, now_ns())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


KV_CONNECTORS.add(
    "gloo",
    ConnectorKind(
        lambda num_prefill, num_decode: _free_port(),
        lambda port, role, index, num_prefill, num_decode: GlooConnector(
            port, role, index, num_prefill, num_decode
        ),
        lambda port: None,
    ),
)
