"""Forming the world: every rank checks in at rank 0's store before torch.distributed's world is
made, so the waiting happens here, in Python, rather than inside `init_process_group`.

Inside `init_process_group` a rank waits in C++: it says nothing, Ctrl-C reaches it only when
the wait ends (after the start-up deadline, 300 s), and ranks started with different
WORLD_SIZEs wait for each other until then. Here each wait is a short poll of the store:
Ctrl-C stops it at once, rank 0 says which ranks it waits for (`notice`), and each rank
publishes its WORLD_SIZE, so a rank that disagrees is named at once. Once rank 0 has seen every
rank, with the same WORLD_SIZE, it publishes the verdict and all of them make the world, which
then forms without waiting.

Keys: `inferlab/world_size/<rank>` (each rank's WORLD_SIZE; rank 0's first) and
`inferlab/verdict` ("ok", or the error every rank raises).
"""

from __future__ import annotations

import socket
import sys
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from engines.base import ConfigError
from engines.builtin.distributed.group import TensorParallelError

#: How long every rank waits for the others to check in (spawned workers import torch first;
#: torchrun's ranks may be started by hand, one machine after another).
STARTUP_TIMEOUT_S = 300.0
#: How often a waiting rank looks at the store: what bounds Ctrl-C's delay.
POLL_S = 0.05
#: Rank 0 says what it waits for after this long (then every NOTICE_EVERY_S): torchrun's
#: ranks may be started late, or not at all.
NOTICE_AFTER_S = 3.0
NOTICE_EVERY_S = 30.0
_VERDICT = "inferlab/verdict"
_OK = "ok"


def size_key(rank: int) -> str:
    return f"inferlab/world_size/{rank}"


def host_store(host: str, port: int, size: int) -> Any:
    """Rank 0's store at host:port (port 0: one the OS picks)."""
    return dist.TCPStore(
        host,
        port,
        size,
        True,
        timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        wait_for_workers=False,
    )


def _unknown_host(host: str) -> ConfigError:
    return ConfigError(
        f"MASTER_ADDR: {host!r} is not a known host; allowed: the host name or IP address of "
        "rank 0's machine"
    )


def check_known_host(host: str) -> None:
    """MASTER_ADDR must resolve: the other ranks connect to rank 0's store there."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        raise _unknown_host(host) from None


def is_own_address(host: str) -> bool:
    """Whether `host` names this machine (an address it can bind). Not needed to serve the
    store (a TCPStore listens on every address of its machine), but a MASTER_ADDR that is not
    one is said: a NAT or service address is fine, a typo for another machine is not."""
    for family, kind, _, _, address in socket.getaddrinfo(host, None, type=socket.SOCK_STREAM):
        try:
            with socket.socket(family, kind) as probe:
                probe.bind((address[0], 0, *address[2:]))
            return True
        except OSError:
            continue
    return False


def connect(host: str, port: int, where: str) -> Any:
    """A client of rank 0's store at host:port, which may not be up yet. A TCPStore client
    retries inside C++ (no Ctrl-C) and logs a stack trace per failed attempt: a plain socket
    waits for the store to listen first."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            break
        except socket.gaierror:
            raise _unknown_host(host) from None
        except OSError:
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"rank 0's store at {where} did not answer within {STARTUP_TIMEOUT_S:g} s"
                ) from None
            time.sleep(POLL_S * 4)
    return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=STARTUP_TIMEOUT_S))


def gather(
    store: Any,
    size: int,
    where: str,
    watch: Callable[[], None] = lambda: None,
    notice: bool = False,
) -> None:
    """Rank 0: wait until ranks 1..size-1 have checked in with WORLD_SIZE `size`, then let them
    make the world. `watch` raises if a rank is known to be gone (a spawned worker's exit);
    `notice`: say on stderr what rank 0 waits for, when it waits long."""
    store.set(size_key(0), str(size))
    missing = list(range(1, size))
    began = time.monotonic()
    next_notice = began + NOTICE_AFTER_S
    try:
        while missing:
            for rank in [r for r in missing if store.check([size_key(r)])]:
                _check_sizes(size, int(store.get(size_key(rank))), rank, where)
                missing.remove(rank)
            if not missing:
                break
            watch()
            now = time.monotonic()
            if now - began > STARTUP_TIMEOUT_S:
                raise TensorParallelError(
                    f"tensor-parallel {_ranks(missing)} of WORLD_SIZE={size} did not join rank "
                    f"0 at {where} within {STARTUP_TIMEOUT_S:g} s"
                )
            if notice and now >= next_notice:
                next_notice = now + NOTICE_EVERY_S
                print(
                    f"inferlab: rank 0 waits for {len(missing)} of {size - 1} ranks of "
                    f"WORLD_SIZE={size} at {where} (not joined: {_ranks(missing)}); start every "
                    "rank with the same MASTER_ADDR, MASTER_PORT and WORLD_SIZE, or Ctrl-C "
                    f"(it gives up after {STARTUP_TIMEOUT_S:g} s)",
                    file=sys.stderr,
                    flush=True,
                )
            time.sleep(POLL_S)
    except ConfigError as exc:
        store.set(_VERDICT, str(exc))  # the others fail with the same line
        raise
    store.set(_VERDICT, _OK)


def join(store: Any, rank: int, size: int, where: str) -> None:
    """A rank other than 0: check in with WORLD_SIZE `size`, and wait for rank 0's verdict."""
    store.set(size_key(rank), str(size))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    checked = False
    try:
        while not store.check([_VERDICT]):
            if not checked and store.check([size_key(0)]):
                _check_sizes(int(store.get(size_key(0))), size, rank, where)
                checked = True
            if time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel rank {rank}: rank 0 at {where} did not form the world "
                    f"within {STARTUP_TIMEOUT_S:g} s"
                )
            time.sleep(POLL_S)
        verdict = store.get(_VERDICT).decode()
    except dist.DistNetworkError:
        raise TensorParallelError(
            f"tensor-parallel rank {rank}: rank 0's store at {where} closed while the ranks "
            "were starting (rank 0 failed or was stopped: see its output)"
        ) from None
    if verdict != _OK:
        raise ConfigError(verdict)


def _check_sizes(rank0_size: int, other_size: int, rank: int, where: str) -> None:
    if rank0_size != other_size:
        raise ConfigError(
            f"WORLD_SIZE differs between the ranks at {where}: rank 0 has WORLD_SIZE="
            f"{rank0_size}, rank {rank} WORLD_SIZE={other_size}; allowed: the same WORLD_SIZE "
            "for every rank"
        )


def _ranks(ranks: list[int]) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))
