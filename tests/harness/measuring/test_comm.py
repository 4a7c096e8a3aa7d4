"""The communication arithmetic of tensor parallelism: ring all-reduce and gather times, and
what a decode step communicates."""

from __future__ import annotations

import pytest

from harness.measuring.comm import (
    DecodeComm,
    allreduce_bus_bandwidth,
    allreduce_seconds,
    gather_seconds,
    tp_decode_comm_bytes,
    tp_decode_comm_seconds,
)
from models.config import PRESETS


def test_ring_allreduce_and_gather_times() -> None:
    # 8 ranks, 1 MB, 100 GB/s, 2 us per hop: 2*7/8 of the bytes and 14 hops
    assert allreduce_seconds(1e6, 8, 100e9, 2e-6) == pytest.approx(1.75e6 / 100e9 + 14 * 2e-6)
    assert allreduce_seconds(1e6, 2, 100e9, 0.0) == pytest.approx(1e6 / 100e9)
    # a gather moves (N-1)/N of the assembled bytes in N-1 hops
    assert gather_seconds(8e6, 4, 1e9, 1e-6) == pytest.approx(0.75 * 8e6 / 1e9 + 3e-6)


def test_one_rank_communicates_nothing() -> None:
    assert allreduce_seconds(1e9, 1, 1e9, 1e-3) == 0.0
    assert gather_seconds(1e9, 1, 1e9, 1e-3) == 0.0
    comm = tp_decode_comm_bytes(PRESETS["llama3-8b"], 64, 2, 1)
    assert comm == DecodeComm(world_size=1, allreduces=0, allreduce_bytes=0, gather_bytes=0)
    assert tp_decode_comm_seconds(comm, 1e9, 1e-3) == 0.0


def test_bus_bandwidth_inverts_the_allreduce_time() -> None:
    seconds = allreduce_seconds(4 << 20, 4, 200e9, 0.0)
    assert allreduce_bus_bandwidth(4 << 20, seconds, 4) == pytest.approx(200e9)


def test_a_decode_step_all_reduces_twice_per_layer_plus_the_embedding() -> None:
    cfg = PRESETS["llama3-70b"]  # 80 layers, hidden 8192, vocab 128256
    comm = tp_decode_comm_bytes(cfg, 32, 2, 8)
    assert comm.allreduces == 2 * 80 + 1
    assert comm.allreduce_bytes == 32 * 8192 * 2
    assert comm.gather_bytes == 32 * 128256 * 2  # in the compute dtype (bf16 here)
    assert comm.total_bytes == 161 * 32 * 8192 * 2 + 32 * 128256 * 2
    expected = 161 * (2 * 7 / 8 * 32 * 8192 * 2 / 450e9 + 14 * 1e-6) + (
        7 / 8 * 32 * 128256 * 2 / 450e9 + 7 * 1e-6
    )
    assert tp_decode_comm_seconds(comm, 450e9, 1e-6) == pytest.approx(expected)


def test_the_logits_gather_counts_the_padded_vocabulary() -> None:
    from dataclasses import replace

    cfg = replace(PRESETS["tiny"], vocab_size=4097)
    assert tp_decode_comm_bytes(cfg, 3, 4, 4).gather_bytes == 3 * 4100 * 4


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: allreduce_seconds(1.0, 0, 1e9, 0.0), r"world_size: 0 is invalid"),
        (lambda: allreduce_seconds(1.0, 2, 0.0, 0.0), r"link_bandwidth: 0\.0 is invalid"),
        (lambda: gather_seconds(1.0, 2, 1e9, -1e-6), r"link_latency: -1e-06 is invalid"),
        (lambda: gather_seconds(-1.0, 2, 1e9, 0.0), r"nbytes: -1\.0 is invalid"),
        (lambda: tp_decode_comm_bytes(PRESETS["tiny"], -1, 2, 2), r"batch: -1 is invalid"),
        (
            lambda: tp_decode_comm_bytes(PRESETS["tiny"], 1, 2, 3),
            r"engine\.tensor_parallel_size: 3 is invalid",
        ),
    ],
)
def test_bad_arguments_are_named(call, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()
