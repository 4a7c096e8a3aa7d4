"""A tensor-parallel rank other than 0: it builds the engine's model shard that rank 0 names and
runs each step rank 0 packs, until told to stop.

    ("engine", EngineMessage)  build the runner (load this rank's shard) in a new compute group
    ("kv", layout, ring, limits, groups)  allocate this rank's KV pool (same blocks as rank 0's)
    ("step", PackedStep)       run the step's forward on this rank's shard
    ("close",)                 drop the engine; wait for the next (torchrun: one per engine)
    ("exit",)                  end the process

A worker that fails prints why and exits at once: its closed connections end rank 0's
collective with an error instead of leaving it waiting for the deadline.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from engines.base import ConfigError
from engines.builtin.distributed.environment import launched
from engines.builtin.distributed.group import ControlChannel, TensorParallelError, TPGroup
from engines.builtin.distributed.launch import (
    CODE_ROOT,
    compute_backend,
    control_group,
    init_world,
    new_compute_group,
    processes_per_host,
    rank_device,
    store_client,
)
from engines.builtin.distributed.rendezvous import join


class WrongCodeError(RuntimeError):
    """A spawned worker imported inferlab from another folder than its rank 0."""


@dataclass(frozen=True)
class EngineMessage:
    """What a worker needs to build its runner as rank 0 built its own."""

    config: dict[str, Any]  # EngineConfig.to_dict(), validated on rank 0
    dtype: str
    max_model_len: int
    sample_vocab_size: int


def spawned_main(argv: list[str]) -> None:
    """The entry point of a worker rank 0 spawned: argv is CODE_ROOT RANK SIZE PORT PARENT_PID
    (launch.WORKER_COMMAND), CODE_ROOT the folder rank 0 imports inferlab from. Ctrl-C reaches
    the whole process group: rank 0 alone decides what it means, and ends the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    root, rank, size, port, parent_pid = argv[0], *map(int, argv[1:5])
    _exit_with_parent(parent_pid)
    try:
        check_same_code(root)
        store = store_client(port)
        join(store, rank, size, f"127.0.0.1:{port}")
        init_world(rank, size, store)
        serve(rank, size)
    except BaseException:
        _die()
    os._exit(0)  # skip interpreter teardown: nothing is left to flush


def check_same_code(root: str) -> None:
    """Raise WrongCodeError unless this process imported inferlab from `root`, rank 0's
    folder: ranks running different copies of the engine would split and run the model
    differently, and fail (or worse, agree) in ways nobody could read."""
    if os.path.realpath(root) != os.path.realpath(CODE_ROOT):
        raise WrongCodeError(
            f"this worker imported inferlab's engines from {CODE_ROOT}, but rank 0 runs the "
            f"copy in {root}; every rank must run the same code (is another copy of inferlab "
            "installed, or first on PYTHONPATH?)"
        )


#: How often a spawned worker checks that rank 0 is still there.
PARENT_POLL_S = 0.5


def _exit_with_parent(parent_pid: int) -> None:
    """End this worker once rank 0's process is gone (this process is then re-parented).
    Rank 0's closed connections end a collective or a wait for its next message at once, but
    not the store client's connection attempts while starting (STARTUP_TIMEOUT_S) nor the
    load of a shard: a rank 0 killed then (SIGKILL, the OOM killer) left its worker running
    for minutes."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_POLL_S)
        print(
            f"inferlab tensor-parallel worker (pid {os.getpid()}): rank 0 (pid {parent_pid}) "
            "is gone; exiting",
            file=sys.stderr,
            flush=True,
        )
        os._exit(1)

    threading.Thread(target=watch, name="inferlab-rank0-watch", daemon=True).start()


def serve_if_worker_rank() -> bool:
    """In a process torchrun started as a rank other than 0: serve as a tensor-parallel worker
    until rank 0 ends (then return True: the caller exits). Elsewhere return False at once."""
    me = launched()
    if me is None:
        return False
    rank, world = me.rank, me.world_size
    if rank == 0 or world < 2:
        return False
    # it waits for rank 0, possibly long (it may not have started yet): say why
    print(
        f"inferlab: RANK={rank} of WORLD_SIZE={world} (torchrun's environment): a "
        f"tensor-parallel worker of rank 0 at {me.master_addr}:{me.master_port}",
        file=sys.stderr,
        flush=True,
    )
    serve(rank, world)
    return True


def serve(rank: int, size: int) -> None:
    """Serve engines until rank 0 says exit (torchrun's ranks come here from the CLI). Joining
    the world may raise (a ConfigError: the ranks' WORLD_SIZEs differ; TensorParallelError:
    rank 0 never came); once in it, a failure ends the process."""
    init_world(rank, size)
    try:
        channel = ControlChannel(rank, control_group())
        while True:
            message = channel.receive()
            if message[0] == "exit":
                dist.destroy_process_group()  # before teardown, which would abort gloo's threads
                return
            if message[0] == "engine":
                _serve_engine(rank, size, channel, message[1])
    except BaseException:
        _die()


def _serve_engine(rank: int, size: int, channel: ControlChannel, spec: EngineMessage) -> None:
    # imported here: the engine's modules import this package
    from engines.builtin.config import EngineConfig
    from engines.builtin.model_runner import ModelRunner
    from engines.builtin.platform import Platform
    from models.dtypes import TORCH_DTYPES
    from models.location import resolve_model

    config = EngineConfig(**spec.config)
    platform = Platform.create(
        rank_device(config.device, rank, size), config.num_threads, processes_per_host(size)
    )
    group = new_compute_group(compute_backend(platform.device), config.tensor_parallel_timeout_s)
    try:
        runner = ModelRunner(
            resolve_model(config.model, config.model_overrides),
            config,
            platform,
            TORCH_DTYPES[spec.dtype],
            spec.max_model_len,
            spec.sample_vocab_size,
            [],
            tp=TPGroup(rank, size, group, measure=False),
        )
        while True:
            message = channel.receive()
            kind = message[0]
            if kind == "step":
                runner.execute_packed(message[1])
            elif kind == "kv":
                runner.allocate_kv_cache(*message[1:])
            elif kind == "close":
                return
            elif kind == "exit":
                raise SystemExit(0)
            else:
                raise ValueError(f"unknown message {kind!r} from rank 0")
    finally:
        if dist.is_initialized():
            dist.destroy_process_group(group)


def _die() -> None:
    exc = sys.exc_info()[1]
    if isinstance(exc, SystemExit) and not exc.code:
        os._exit(0)
    said = f"inferlab tensor-parallel worker (pid {os.getpid()}) failed:"
    if isinstance(exc, (ConfigError, TensorParallelError, WrongCodeError)):
        print(f"{said} {exc}", file=sys.stderr)  # the reason is the message
    else:
        print(said, file=sys.stderr)
        traceback.print_exc()
    sys.stderr.flush()
    os._exit(1)
