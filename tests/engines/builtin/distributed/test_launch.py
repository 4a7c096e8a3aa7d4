"""Starting the ranks (engines/builtin/distributed/launch.py) without a world: what a failure
says about the ranks rank 0 spawned, and what is refused before any rank starts."""

from __future__ import annotations

import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

import engines.builtin.engine as engine_module
from engines.base import ConfigError
from engines.builtin import LLM
from engines.builtin.distributed.group import ControlChannel, TPGroup
from engines.builtin.distributed.launch import WORKER_COMMAND, Peers

CHECKOUT = Path(__file__).parents[4]


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


#: A stand-in for rank 0: spawns a worker as rank 0 does, prints its pid, then waits to be
#: killed (argv: the worker's command, then the port of a store nobody hosts)
RANK_ZERO = """
import os, subprocess, sys, time
from engines.builtin.distributed.launch import CODE_ROOT
command, port = sys.argv[1:-1], sys.argv[-1]
worker = subprocess.Popen([*command, CODE_ROOT, "1", "2", port, str(os.getpid())])
print(worker.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_worker_whose_rank_0_is_killed_while_it_starts_exits() -> None:
    # rank 0 killed before its worker reached the store: the worker used to retry connecting
    # for the start-up deadline (300 s), outliving the run
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    rank_zero = subprocess.Popen(
        [sys.executable, "-c", RANK_ZERO, *WORKER_COMMAND, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert rank_zero.stdout is not None
    worker = int(rank_zero.stdout.readline())
    try:
        rank_zero.kill()
        rank_zero.wait()
        deadline = time.monotonic() + 20  # the worker imports torch first
        while not exited(worker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert exited(worker), "the worker outlived its rank 0"
    finally:
        if not exited(worker):
            os.kill(worker, signal.SIGKILL)


def exited(pid: int) -> bool:
    """Gone, or a zombie its new parent (init, a subreaper) has not reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("rank", ["2", "-1"])
def test_a_rank_outside_the_world_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], rank: str
) -> None:
    # stale or mistyped torchrun variables: the process used to wait silently for a world
    # that never forms, until the start-up deadline (300 s)
    from harness import cli

    for key, value in (
        ("RANK", rank),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "1"),
    ):
        monkeypatch.setenv(key, value)
    refused = rf"RANK={rank} is outside WORLD_SIZE=2 .*allowed: RANK 0\.\.1"
    began = time.monotonic()
    assert cli.main(["run", "model=tiny"]) == 2
    assert re.match(rf"error: {refused}", capsys.readouterr().err)
    with pytest.raises(ConfigError, match=refused):
        LLM(model="tiny", tensor_parallel_size=2)
    assert time.monotonic() - began < 10


#: rank 0 of a world of 2, in a fresh process: a failed init_process_group leaves
#: torch.distributed's group count moved on for the rest of the process
RANK_0_SAYS_ITS_CONFIG_ERROR = (
    "from engines.base import ConfigError\n"
    "from engines.builtin.distributed.launch import init_world\n"
    "try:\n"
    "    init_world(0, 2)\n"
    "except ConfigError as exc:\n"
    "    print(exc)\n"
)


def rank_0_says(env: dict[str, str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Rank 0 of a world of 2 with `env`, its ConfigError (if any) on stdout."""
    return subprocess.run(
        [sys.executable, "-c", RANK_0_SAYS_ITS_CONFIG_ERROR],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_master_port_in_use_is_refused_by_name() -> None:
    # torchrun's rank 0 serves the store on MASTER_PORT: one in use was a DistNetworkError
    # (EADDRINUSE) that never named the variable. In a fresh process: a failed
    # init_process_group leaves torch.distributed's group count moved on, and the next world
    # this process formed would wait forever for ranks that count differently.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        env = {**os.environ, **torchrun_env(0, 2, port)}
        done = rank_0_says(env, timeout=60)
    assert done.stdout.startswith(f"MASTER_PORT={port}: the port is in use"), done.stderr[-2000:]


def test_an_unknown_master_addr_is_refused_by_name() -> None:
    # rank 0's TCPStore connected to its own store at MASTER_ADDR: an unknown host printed two
    # C++ stack traces and waited ~7 min, deaf to SIGTERM and Ctrl-C. (In a fresh process, as
    # the test above.)
    env = {**os.environ, **torchrun_env(0, 2, free_port()), "MASTER_ADDR": "nonexistent.invalid"}
    done = rank_0_says(env, timeout=120)
    assert done.stdout.startswith("MASTER_ADDR: 'nonexistent.invalid' is not a known host")


def test_ranks_reach_rank_0_through_an_address_it_does_not_own() -> None:
    """A MASTER_ADDR that other machines reach rank 0 by but that is not its own (a NAT, a
    Kubernetes service address) works, as with torch's env://: rank 0 serves on every address
    and says so. Here rank 0 is told 192.0.2.1 (no address of this machine's) while rank 1
    reaches it through 127.0.0.1; its own TCPStore client waited on 192.0.2.1 silently."""
    script = (
        "import sys\n"
        "from engines.builtin.distributed.launch import init_world\n"
        "init_world(int(sys.argv[1]), 2)\n"
        "print('joined')\n"
    )
    port = free_port()
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(rank)],
            env={**os.environ, **torchrun_env(rank, 2, port), "MASTER_ADDR": address},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank, address in ((0, "192.0.2.1"), (1, "127.0.0.1"))
    ]
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [out for out, _ in outputs] == ["joined\n", "joined\n"], outputs
    assert "rank 0: MASTER_ADDR '192.0.2.1' is not an address of this machine" in outputs[0][1]


def torchrun_env(rank: int, world: int, port: int | str) -> dict[str, str]:
    """The variables torchrun sets in rank `rank`'s process."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


@pytest.mark.parametrize(
    "key, value, allowed",
    [
        ("MASTER_PORT", "notaport", "an integer 1..65535"),
        ("MASTER_PORT", "0", "an integer 1..65535"),
        ("MASTER_PORT", "70000", "an integer 1..65535"),
        ("WORLD_SIZE", "two", "an integer >= 1"),
        ("WORLD_SIZE", "0", "an integer >= 1"),
        ("RANK", "x", "an integer"),
        ("LOCAL_RANK", "x", "an integer >= 0"),
        ("LOCAL_WORLD_SIZE", "0", "an integer >= 1"),
    ],
)
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_torchrun_variable_that_is_not_a_number_it_allows_is_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
    key: str,
    value: str,
    allowed: str,
    rank: str,
) -> None:
    # MASTER_PORT=notaport was `ValueError: invalid literal for int()` from deep in
    # torch.distributed; RANK=x made `inferlab run` spawn ranks of its own, ignoring torchrun's
    from harness import cli

    for name, setting in {**torchrun_env(int(rank), 2, 29500), key: value}.items():
        monkeypatch.setenv(name, setting)
    refused = rf"{key}: '{value}' is invalid; allowed: {allowed} \(a torchrun variable\)"
    run = ["run", "model=tiny", "engine.tensor_parallel_size=2", f"hydra.run.dir={tmp_path}"]
    assert cli.main(run) == 2
    assert re.fullmatch(rf"error: {refused}.*\n", capsys.readouterr().err)
    with pytest.raises(ConfigError, match=refused):
        LLM(model="tiny", tensor_parallel_size=2)


def test_an_empty_master_addr_is_refused_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, setting in {**torchrun_env(0, 2, 29500), "MASTER_ADDR": " "}.items():
        monkeypatch.setenv(name, setting)
    with pytest.raises(ConfigError, match=r"^MASTER_ADDR: ' ' is invalid; allowed: the host"):
        LLM(model="tiny", tensor_parallel_size=2)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def inferlab_run(env: dict[str, str], run_dir: Path, tp: int = 2) -> subprocess.Popen[str]:
    """`inferlab run` of the tiny model at tensor_parallel_size `tp`, with `env` on top."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "run",
            "model=tiny",
            f"engine.tensor_parallel_size={tp}",
            "engine.num_threads=1",
            "workload.num_requests=1",
            f"hydra.run.dir={run_dir}",
        ],
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def read_until(stream: Any, wanted: str, timeout_s: float) -> str:
    """What `stream` says until a line containing `wanted` (or the timeout, or its end)."""
    said = ""
    deadline = time.monotonic() + timeout_s
    while wanted not in said and time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.2)
        if ready:
            line = stream.readline()
            if not line:
                break
            said += line
    return said


@pytest.mark.slow
def test_a_torchrun_rank_0_without_its_peers_says_what_it_waits_for_and_stops_on_ctrl_c(
    tmp_path: Path,
) -> None:
    # it used to wait 300 s inside init_process_group, silently, where Ctrl-C did not reach
    port = free_port()
    rank_zero = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from engines.builtin import LLM\n"
            "LLM(model='tiny', tensor_parallel_size=2, num_threads=1)\n",
        ],
        env={**os.environ, **torchrun_env(0, 2, port)},
        stderr=subprocess.PIPE,
        text=True,
    )
    assert rank_zero.stderr is not None
    try:
        said = read_until(rank_zero.stderr, "rank 0 waits", timeout_s=120)
        assert (
            f"inferlab: rank 0 waits for 1 of 1 ranks of WORLD_SIZE=2 at "
            f"MASTER_ADDR:MASTER_PORT=127.0.0.1:{port} (not joined: rank 1)"
        ) in said, said
        rank_zero.send_signal(signal.SIGINT)
        rank_zero.wait(timeout=60)  # not the 300 s deadline
        assert "KeyboardInterrupt" in rank_zero.stderr.read()
    finally:
        rank_zero.kill()
        rank_zero.wait()


@pytest.mark.slow
def test_ranks_launched_with_different_world_sizes_are_refused_by_name(tmp_path: Path) -> None:
    # each waited for a world that never forms, until the start-up deadline (300 s)
    port = free_port()
    ranks = [
        inferlab_run(torchrun_env(0, 2, port), tmp_path / "rank0"),
        inferlab_run(torchrun_env(1, 3, port), tmp_path / "rank1"),
    ]
    try:
        said = [rank.communicate(timeout=120)[1] for rank in ranks]
    finally:
        for rank in ranks:
            rank.kill()
    mismatch = (
        f"WORLD_SIZE differs between the ranks at MASTER_ADDR:MASTER_PORT=127.0.0.1:{port}: rank "
        "0 has WORLD_SIZE=2, rank 1 WORLD_SIZE=3; allowed: the same WORLD_SIZE for every rank"
    )
    # rank 1 is refused before it serves; rank 0 while it loads its engine, which `inferlab
    # run` records as a failed run, exit 2 as for any configuration refused at load
    for rank, err in zip(ranks, said, strict=True):
        assert rank.returncode == 2, err[-3000:]
        assert mismatch in err, err[-3000:]
        assert "Traceback" not in err, err[-3000:]


FROM_ELSEWHERE = """
import sys
sys.path.insert(0, {root!r})  # this checkout, put first by hand
from engines.builtin import LLM, SamplingParams
llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1)
outs = llm.generate("hello there", SamplingParams(temperature=0.0, max_tokens=4))
print("TOKENS", outs[0].token_ids, flush=True)
llm.engine.close()
"""


@pytest.mark.slow
def test_workers_import_the_code_of_a_script_that_put_its_checkout_on_sys_path(
    tmp_path: Path,
) -> None:
    # The script runs from another folder, with another copy of inferlab importable (here: on
    # PYTHONPATH, as a pip-installed one is in site-packages): the workers, started with
    # `python -m engines.builtin.distributed`, imported that copy, not the script's.
    other = tmp_path / "other"
    for package in ("engines", "engines/builtin", "engines/builtin/distributed"):
        (other / package).mkdir(parents=True)
        (other / package / "__init__.py").write_text("")
    for module in ("__main__.py", "worker.py"):
        (other / "engines/builtin/distributed" / module).write_text(
            "raise SystemExit('imported the other copy of inferlab')\n"
        )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = elsewhere / "script.py"
    script.write_text(FROM_ELSEWHERE.format(root=str(CHECKOUT)))
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=elsewhere,
        env={**os.environ, "PYTHONPATH": str(other)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "TOKENS" in done.stdout
    assert "other copy" not in done.stderr


def test_a_worker_that_imported_another_copy_of_inferlab_says_so() -> None:
    from engines.builtin.distributed.launch import CODE_ROOT
    from engines.builtin.distributed.worker import WrongCodeError, check_same_code

    check_same_code(CODE_ROOT)
    with pytest.raises(
        WrongCodeError,
        match=rf"^this worker imported inferlab's engines from {CODE_ROOT}, but rank 0 runs the "
        r"copy in /elsewhere; every rank must run the same code",
    ):
        check_same_code("/elsewhere")
