"""Starting the ranks (engines/builtin/distributed/launch.py) without a world: what a failure
says about the ranks rank 0 spawned, and what is refused before any rank starts."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch.distributed as dist

import engines.builtin.engine as engine_module
from engines.base import ConfigError
from engines.builtin import LLM
from engines.builtin.distributed.group import ControlChannel, TPGroup
from engines.builtin.distributed.launch import Peers


def test_a_rank_whose_exit_lags_its_closed_connection_is_named_killed() -> None:
    # A SIGKILLed rank's sockets close before its exit can be collected: rank 0's collective
    # fails while poll() still says running. Here the exit comes a moment after the call.
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import os, signal, time; time.sleep(0.2); os.kill(os.getpid(), signal.SIGKILL)",
        ]
    )
    peers = Peers(2, "spawn", "gloo", ControlChannel(0, None), TPGroup(), [process])
    try:
        assert peers.describe_failure() == "workers: rank 1 killed by SIGKILL"
    finally:
        process.kill()
        process.wait()


def test_int4_groups_that_straddle_the_shards_are_refused_before_any_rank_starts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_start(*args: Any) -> None:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(engine_module, "start_peers", no_start)
    # tiny's o_proj has 64 inputs, 32 a rank: groups of 64 would straddle the shards
    with pytest.raises(
        ConfigError,
        match=r"engine\.quantization_group_size: groups of 64 inputs straddle the "
        r"tensor-parallel shards of layers\.\*\.attn\.o_proj .*allowed: .*quantization_group_size "
        r"32\)",
    ):
        LLM(model="tiny", tensor_parallel_size=2, quantization="int4", quantization_group_size=64)


def test_a_failure_after_the_ranks_started_ends_them() -> None:
    # the speculative proposer is refused once the model is loaded (a sliding-window ring
    # cannot hold drafts): the workers and the world must go with the engine, or every later
    # tensor-parallel engine of the process (a sweep's next job) is refused
    with pytest.raises(ConfigError, match=r"engine\.speculative_config: .*sliding-window ring"):
        LLM(
            model="tiny",
            tensor_parallel_size=2,
            num_threads=1,
            model_overrides={"sliding_window": 8},
            speculative_config={"method": "ngram", "num_speculative_tokens": 2},
        )
    assert not dist.is_initialized()
