"""Communication arithmetic for tensor parallelism: collective times and per-step volumes.

A ring all-reduce over N ranks moves 2(N-1)/N of the message through each rank's link
(reduce-scatter, then all-gather) in 2(N-1) steps, each paying the link's latency once:

    allreduce_seconds = 2(N-1)/N x nbytes / link_bandwidth + 2(N-1) x link_latency

and a ring gather of `total` bytes (each rank contributing total / N) moves (N-1)/N of it in
N-1 steps:

    gather_seconds = (N-1)/N x total / link_bandwidth + (N-1) x link_latency

`link_bandwidth` is the per-GPU bus bandwidth in one direction, the figure nccl-tests reports as
busbw (busbw = algbw x 2(N-1)/N for an all-reduce), so one number serves every N;
`link_latency` is seconds per ring step (hop). Both are 0 for N == 1: nothing moves.

A decode step of a Megatron-style tensor-parallel model (models/tensor_parallel.py) all-reduces
the hidden states twice per layer (after o_proj and after down_proj) and once after the
vocab-parallel embedding, each batch x hidden x element bytes, and gathers the logits (batch x
padded vocab x element bytes: the engine gathers them in the compute dtype) from the
column-parallel LM head.

Pure functions: no torch, no devices.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import ModelConfig
from models.tensor_parallel import tp_shard


def _check(world_size: int, link_bandwidth: float, link_latency: float, nbytes: float) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: {world_size!r} is invalid; allowed: an integer >= 1")
    if not link_bandwidth > 0:
        raise ValueError(f"link_bandwidth: {link_bandwidth!r} is invalid; allowed: a number > 0")
    if not link_latency >= 0:
        raise ValueError(f"link_latency: {link_latency!r} is invalid; allowed: a number >= 0")
    if not nbytes >= 0:
        raise ValueError(f"nbytes: {nbytes!r} is invalid; allowed: a number >= 0")


def allreduce_seconds(
    nbytes: float, world_size: int, link_bandwidth: float, link_latency: float
) -> float:
    """A ring all-reduce of `nbytes` (the message, as each rank holds it) over `world_size`
    ranks: 2(N-1)/N x nbytes / link_bandwidth + 2(N-1) x link_latency; 0 for N == 1."""
    _check(world_size, link_bandwidth, link_latency, nbytes)
    n = world_size
    return 2 * (n - 1) / n * nbytes / link_bandwidth + 2 * (n - 1) * link_latency


def gather_seconds(
    total_bytes: float, world_size: int, link_bandwidth: float, link_latency: float
) -> float:
    """A ring gather of `total_bytes` (the assembled result; each rank holds 1/N of it):
    (N-1)/N x total_bytes / link_bandwidth + (N-1) x link_latency; 0 for N == 1."""
    _check(world_size, link_bandwidth, link_latency, total_bytes)
    n = world_size
    return (n - 1) / n * total_bytes / link_bandwidth + (n - 1) * link_latency


def allreduce_bus_bandwidth(nbytes: float, seconds: float, world_size: int) -> float:
    """nccl-tests' bus bandwidth of an all-reduce that took `seconds`: 2(N-1)/N x nbytes / t,
    the per-rank link traffic per second (the inverse of allreduce_seconds' bandwidth term)."""
    n = world_size
    return 2 * (n - 1) / n * nbytes / seconds


@dataclass(frozen=True)
class DecodeComm:
    """What one decode step of a tensor-parallel model communicates (all zero for N == 1)."""

    world_size: int
    allreduces: int  # 2 per layer (o_proj, down_proj) + 1 (the embedding)
    allreduce_bytes: int  # each: batch x hidden x element bytes
    gather_bytes: int  # the logits, assembled: batch x padded vocab x element bytes

    @property
    def total_bytes(self) -> int:
        return self.allreduces * self.allreduce_bytes + self.gather_bytes


def tp_decode_comm_bytes(
    model: ModelConfig,
    batch: int,
    element_bytes: int,
    world_size: int,
    expert_parallel: bool = False,
) -> DecodeComm:
    """The collectives of one decode step of `batch` sequences over `world_size` ranks (under
    expert parallelism the all-reduce after an MoE layer adds the ranks' experts' outputs,
    as a dense MLP's adds its shards': the same count and bytes)."""
    if isinstance(batch, bool) or not isinstance(batch, int) or batch < 0:
        raise ValueError(f"batch: {batch!r} is invalid; allowed: an integer >= 0")
    shard = tp_shard(model, world_size, expert_parallel=expert_parallel)
    if world_size == 1:
        return DecodeComm(world_size=1, allreduces=0, allreduce_bytes=0, gather_bytes=0)
    return DecodeComm(
        world_size=world_size,
        allreduces=2 * model.num_layers + 1,
        allreduce_bytes=batch * model.hidden_size * element_bytes,
        gather_bytes=batch * shard.padded_vocab * element_bytes,
    )


def tp_decode_comm_seconds(comm: DecodeComm, link_bandwidth: float, link_latency: float) -> float:
    """The step's collectives one after the other (none overlapped with compute or with each
    other): allreduces x allreduce_seconds(allreduce_bytes) + gather_seconds(gather_bytes);
    0 when nothing moves (N == 1, or an empty batch)."""
    if comm.total_bytes == 0:
        return 0.0
    n = comm.world_size
    return comm.allreduces * allreduce_seconds(
        comm.allreduce_bytes, n, link_bandwidth, link_latency
    ) + gather_seconds(comm.gather_bytes, n, link_bandwidth, link_latency)
