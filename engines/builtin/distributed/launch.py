"""Rank 0's side of tensor parallelism: start the other ranks (or join those torchrun started),
and end them.

Two ways to get ranks:
- spawn (the default): rank 0 starts N-1 worker processes itself (WORKER_COMMAND: a fresh
  interpreter, so scripts need no `__main__` guard, importing inferlab from rank 0's folder),
  on this host, over loopback;
- torchrun (or any launcher that sets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT): every
  process runs the same command; rank 0 goes on as the engine, the others become workers as
  soon as they build an engine (`LLMEngine` or `inferlab run` call
  `worker.serve_if_worker_rank`).
  This is the multi-node path: the ranks may be on several machines.

Either way the ranks check in at rank 0's store before the world forms (rendezvous.py).

Three process groups: the world (gloo; start-up only), the control group (gloo, no deadline:
rank 0's messages, `ControlChannel`) and the compute group (gloo on CPU, NCCL on CUDA; the
model's collectives, with `engine.tensor_parallel_timeout_s` as their deadline, so a hung rank
fails the step instead of hanging it).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import engines
from engines.base import ConfigError
from engines.builtin.distributed.environment import LaunchedRank, launched
from engines.builtin.distributed.group import ControlChannel, TensorParallelError, TPGroup
from engines.builtin.distributed.rendezvous import (
    STARTUP_TIMEOUT_S,
    check_known_host,
    connect,
    gather,
    host_store,
    is_own_address,
    join,
)

#: The control group's deadline: a worker waits this long for rank 0's next message (an idle
#: engine sends none). Rank 0 dying ends the wait at once (its connections close).
CONTROL_TIMEOUT = timedelta(days=365)
#: The folder this process imports inferlab's packages from (it holds engines/): a spawned
#: worker imports them from there too, whatever its sys.path would find first.
CODE_ROOT = str(Path(engines.__file__).resolve().parent.parent)
#: A spawned worker: this Python, then CODE_ROOT RANK SIZE PORT PARENT_PID. `-c` and not `-m`:
#: `-m` would look in the current folder and PYTHONPATH before CODE_ROOT, where another copy
#: of inferlab (a pip-installed one, another checkout) may be.
WORKER_COMMAND = [
    sys.executable,
    "-c",
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from engines.builtin.distributed.worker import spawned_main; spawned_main(sys.argv[1:])",
]
#: How long a failed collective's message waits for a rank's exit to be known (see
#: Peers.describe_failure); a hung rank costs this much more before the engine fails.
EXIT_GRACE_S = 2.0


def launched_rank() -> tuple[int, int] | None:
    """(rank, world size) set by torchrun (or a launcher like it), None otherwise; a
    ConfigError for a variable with a value it does not allow (environment.launched)."""
    me = launched()
    return None if me is None else (me.rank, me.world_size)


def processes_per_host(size: int) -> int:
    """Ranks sharing this host: all of them when spawned, torchrun's LOCAL_WORLD_SIZE else."""
    me = launched()
    if me is not None and me.local_world_size is not None:
        return me.local_world_size
    return size


def compute_backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(device: str, rank: int, size: int) -> str:
    """The device of `rank`: CPU for every rank, or one CUDA device each (torchrun: the
    process's LOCAL_RANK; spawn: the configured index plus the rank)."""
    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return "cpu"
    if not torch.cuda.is_available():
        return device  # Platform.create refuses it, naming engine.device
    me = launched()
    if me is not None and me.local_rank is not None:
        return f"cuda:{me.local_rank}"
    base = int(device.partition(":")[2] or 0)
    count = torch.cuda.device_count()
    if base >= count:  # the device itself is missing, whatever the ranks
        raise ConfigError(
            f"engine.device: {device!r} is not on this machine ({count} CUDA devices); "
            "allowed: auto|cpu|cuda|" + "|".join(f"cuda:{index}" for index in range(count))
        )
    if base + size > count:
        raise ConfigError(
            f"engine.tensor_parallel_size: {size} ranks need {size} CUDA devices from "
            f"cuda:{base}; this machine has {count}; allowed: 1.."
            f"{max(1, count - base)} (or start the ranks with torchrun on several machines)"
        )
    return f"cuda:{base + rank}"


_CONTROL_GROUP: Any = None


def control_group() -> Any:
    """This process's control group (made once per process: every rank makes it right after
    the world is up, in the same order)."""
    global _CONTROL_GROUP
    if _CONTROL_GROUP is None:
        _CONTROL_GROUP = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return _CONTROL_GROUP


def init_world(rank: int, size: int, store: Any = None) -> None:
    """Join the world: `store` is the spawning rank 0's, on which the ranks have already
    checked in (rendezvous.gather / join); None: torchrun's ranks, which check in at
    MASTER_ADDR:MASTER_PORT first."""
    global _CONTROL_GROUP
    if not dist.is_initialized():
        if store is None:
            store = _torchrun_rendezvous(rank, size)
        dist.init_process_group(
            "gloo",
            store=store,
            rank=rank,
            world_size=size,
            timeout=timedelta(seconds=STARTUP_TIMEOUT_S),
        )
        _CONTROL_GROUP = None
    control_group()


def _torchrun_rendezvous(rank: int, size: int) -> Any:
    """The store of torchrun's ranks, once every rank has checked in on it: rank 0 hosts it
    at MASTER_ADDR:MASTER_PORT (torchrun's agent does, when it says so:
    TORCHELASTIC_USE_AGENT_STORE, as torch's env:// does)."""
    me = launched()
    assert me is not None and (me.rank, me.world_size) == (rank, size)
    if rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        store = _host_master_port(me)
    else:
        store = connect(me.master_addr, me.master_port, me.where)
    # torchrun's agent keeps its store over restarts of the ranks: one attempt's keys apart
    attempt = (
        f"inferlab/{os.environ.get('TORCHELASTIC_RUN_ID', '')}/"
        f"{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    )
    store = dist.PrefixStore(attempt, store)
    if rank == 0:
        gather(store, size, me.where, notice=True)
    else:
        join(store, rank, size, me.where)
    return store


def _host_master_port(me: LaunchedRank) -> Any:
    """Rank 0 serves the store on MASTER_PORT of every address of its machine and connects to
    it over loopback: through MASTER_ADDR, an address other machines reach it by (a NAT, a
    Kubernetes service) may not lead back to it, and a TCPStore's own client waits on it in
    C++ (no Ctrl-C, a stack trace per attempt) for the whole start-up deadline."""
    check_known_host(me.master_addr)
    if not is_own_address(me.master_addr):
        print(
            f"rank 0: MASTER_ADDR {me.master_addr!r} is not an address of this machine; the "
            f"ranks' store is served on port {me.master_port} of every address here, and the "
            f"other ranks must reach it through {me.master_addr}",
            file=sys.stderr,
        )
    try:
        return host_store("127.0.0.1", me.master_port, me.world_size)
    except dist.DistNetworkError as exc:
        if "EADDRINUSE" in str(exc):
            raise ConfigError(
                f"MASTER_PORT={me.master_port}: the port is in use on this host, and rank 0 "
                "(this process) serves the ranks' store on it; allowed: a free port "
                "(torchrun --master-port)"
            ) from None
        raise


def _spawn_world(size: int) -> list[subprocess.Popen[bytes]]:
    """Start ranks 1.. as fresh interpreters and make the world with them. Rank 0 hosts the
    store on a port the OS picks; each worker checks in there before the world forms, so a
    worker that dies while starting (an import error, no memory) is an error at once, with its
    exit code, rather than a wait for the start-up deadline."""
    store = host_store("127.0.0.1", 0, size)
    processes = [
        subprocess.Popen(
            [*WORKER_COMMAND, CODE_ROOT, str(rank), str(size), str(store.port), str(os.getpid())]
        )
        for rank in range(1, size)
    ]

    def watch() -> None:
        for rank, process in enumerate(processes, start=1):
            if process.poll() is not None:
                raise TensorParallelError(
                    f"tensor-parallel worker rank {rank} exited with code "
                    f"{process.returncode} while starting (its output is above)"
                )

    try:
        gather(store, size, f"127.0.0.1:{store.port}", watch)
        init_world(0, size, store)
    except BaseException:
        for process in processes:
            process.kill()
            process.wait()
        raise
    return processes


def store_client(port: int) -> Any:
    """A spawned worker's connection to rank 0's store, on this host."""
    return connect("127.0.0.1", port, f"127.0.0.1:{port}")


def new_compute_group(backend: str, timeout_s: float) -> Any:
    return dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))


@dataclass
class Peers:
    """Rank 0's handle on the other ranks: the group its model calls, the channel its runner
    sends steps on, and the workers it spawned (none under torchrun)."""

    size: int
    launcher: str  # "spawn" | "torchrun"
    backend: str  # the compute group's: gloo | nccl
    channel: ControlChannel
    tp: TPGroup
    processes: list[Any] = field(default_factory=list)
    closed: bool = False

    def describe_failure(self) -> str:
        """What is known about the other ranks, for an error message."""
        if self.launcher == "torchrun":
            return "ranks started by torchrun: see their output for the failure"
        states = []
        # A killed rank's connections close before the kernel lets its exit be collected, so
        # the collective can fail before poll() sees the exit: wait a moment before calling a
        # rank that is still there hung.
        deadline = time.monotonic() + EXIT_GRACE_S
        for rank, process in enumerate(self.processes, start=1):
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.0, deadline - time.monotonic()))
            code = process.poll()
            if code is None:
                states.append(
                    f"rank {rank} still running (hung, or slower than "
                    f"engine.tensor_parallel_timeout_s={self.channel.timeout_s:g})"
                )
            elif code < 0:
                states.append(f"rank {rank} killed by {signal.Signals(-code).name}")
            else:
                states.append(f"rank {rank} exited with code {code}")
        return "workers: " + ", ".join(states)

    def close(self, failed: bool = False) -> None:
        """End the engine on every rank: spawned workers exit (killed if they do not within a
        few seconds, or at once when the ranks have `failed` or cannot listen: rank 0 stopped
        while they load), and the world rank 0 made for them goes; torchrun's go back to
        waiting for the next engine, in torchrun's world. Idempotent."""
        global _open
        if self.closed:
            return
        self.closed = True
        if _open is self:
            _open = None
        if not failed:
            with contextlib.suppress(TensorParallelError):  # a rank is gone: ended below
                message = ("exit",) if self.launcher == "spawn" else ("close",)
                self.channel.send(message, timeout_s=min(self.channel.timeout_s, 5.0))
        if self.launcher == "spawn":
            for process in self.processes:
                try:
                    process.wait(timeout=0 if failed else 5)
                except subprocess.TimeoutExpired:
                    process.kill()
                    process.wait(timeout=5)
            if dist.is_initialized():
                dist.destroy_process_group()
        elif self.tp.group is not None:
            dist.destroy_process_group(self.tp.group)


#: This process's open tensor-parallel engine's ranks: one at a time (a spawned engine's ranks
#: hold the process's torch.distributed world; torchrun's serve one engine at a time).
_open: Peers | None = None


def start_peers(
    size: int, device: torch.device, timeout_s: float, engine: Any, owner: object
) -> Peers:
    """Start (or join) the other `size - 1` ranks, send them `engine` (what they build), and
    make the compute group with them. They end with `owner` (the engine): when it closes them,
    when it is garbage-collected, or when the process exits."""
    _refuse_a_second_engine(size)
    me = launched()
    processes: list[subprocess.Popen[bytes]] = []
    if me is not None:
        if me.world_size != size:
            raise ConfigError(
                f"engine.tensor_parallel_size: {size}, but torchrun started WORLD_SIZE="
                f"{me.world_size} ranks; allowed: {me.world_size} (one engine spans every "
                "rank torchrun started)"
            )
        assert me.rank == 0, "ranks other than 0 serve as workers (serve_if_worker_rank)"
        init_world(0, size)
        launcher = "torchrun"
        _end_torchrun_workers_at_exit()
    else:
        if dist.is_initialized():
            raise ConfigError(
                "engine.tensor_parallel_size > 1: this process already has a torch.distributed "
                "world that torchrun did not start; start the ranks with torchrun, or use "
                "tensor_parallel_size=1"
            )
        processes = _spawn_world(size)
        launcher = "spawn"
    channel = ControlChannel(0, control_group(), timeout_s=timeout_s)
    peers = Peers(size, launcher, compute_backend(device), channel, TPGroup())
    peers.processes = processes
    channel.describe_failure = peers.describe_failure
    try:
        channel.send(("engine", engine), timeout_s=STARTUP_TIMEOUT_S)
        group = new_compute_group(peers.backend, timeout_s)
    except BaseException:
        peers.close(failed=True)
        raise
    peers.tp = TPGroup(0, size, group, peers.describe_failure)
    global _open
    _open = peers
    # finalize runs at the exit of the process too (a killed one's ranks see its connections
    # close, and exit)
    weakref.finalize(owner, peers.close)
    return peers


def _refuse_a_second_engine(size: int) -> None:
    if _open is not None:
        gc.collect()  # an engine dropped in a reference cycle: its finalizer closes it
    if _open is not None:
        raise ConfigError(
            f"engine.tensor_parallel_size: {size}, but another tensor-parallel engine of this "
            "process is still open (its ranks hold the process's torch.distributed world); "
            "close it first: llm.close(), or build it in `with LLM(...) as llm:`; allowed: "
            "one open tensor-parallel engine per process"
        )


_ENDING_TORCHRUN_WORKERS = False


def _end_torchrun_workers_at_exit() -> None:
    """torchrun's other ranks serve one engine after another; they end with rank 0's process."""
    global _ENDING_TORCHRUN_WORKERS
    if not _ENDING_TORCHRUN_WORKERS:
        _ENDING_TORCHRUN_WORKERS = True

        def end() -> None:
            if _open is not None:  # whichever runs first, this or the engine's finalizer
                _open.close()
            with contextlib.suppress(TensorParallelError):
                ControlChannel(0, control_group()).send(("exit",))
            # before the interpreter's teardown, which would destroy gloo's threads running
            if dist.is_initialized():
                dist.destroy_process_group()

        atexit.register(end)
