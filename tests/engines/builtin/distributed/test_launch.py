"""Rank 0's handle on the ranks it spawned (engines/builtin/distributed/launch.py), without a
world: what a failure says about them."""

from __future__ import annotations

import subprocess
import sys

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
