"""run.num_clients=N: the workload split over N client processes (harness/running/clients.py).

Against `inferlab serve model=tiny`: one merged table whose request ids are the workload's
and whose token counts are the server's usage, sessions kept whole on one client. Against the
scripted server (serving/scripted_server.py), whose log says when it sent each chunk: the
merged ITL and TTFT are the server's send intervals within the client's own overhead, on the
launcher's t0. A client killed mid-run leaves failed rows that say so; Ctrl-C stops every
client and leaves an incomplete run with the finished requests. The config errors name the
key and the allowed values."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from omegaconf import OmegaConf

import configs
from harness.run_folder import load_table, read_summary
from harness.running.clients import (
    ClockOffset,
    measure_offset,
    split_concurrency,
    split_requests,
)
from harness.running.experiment import run_experiment
from harness.running.run_config import RunConfig, make_workload, run_config
from serving.scripted_server import read_log, scripted_process, with_send_times
from serving.testing import ServeProcess, serve_process

pytestmark = pytest.mark.serial  # asserts timings: run alone (Makefile's `test`)

REPO = Path(__file__).resolve().parents[3]
TTFT_MS, ITL_MS = 30.0, 10.0


def composed(*overrides: str) -> dict[str, Any]:
    config = OmegaConf.to_container(configs.compose(list(overrides)), resolve=True)
    assert isinstance(config, dict)
    return config


def workload_ids(config: dict[str, Any]) -> set[str]:
    return {w.request_id for w in make_workload(config["workload"]).build(None, 256)}


# ---- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -2, 1.5, "2", True])
def test_num_clients_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ValueError) as error:
        RunConfig.from_dict({"num_clients": value})
    assert str(error.value) == f"run.num_clients: {value!r} is invalid; allowed: an integer >= 1"


def test_many_clients_need_engine_openai() -> None:
    config = {"engine": {"backend": "builtin"}, "run": {"num_clients": 2}}
    with pytest.raises(ValueError) as error:
        run_config(config)
    assert str(error.value) == (
        "engine.backend: 'builtin' cannot run with run.num_clients=2; allowed: openai (client "
        "processes of one server), or run.num_clients=1"
    )
    assert run_config({**config, "run": {"num_clients": 1}}).num_clients == 1
    assert run_config({"engine": {"backend": "openai"}, "run": {"num_clients": 3}}).num_clients


def test_clients_run_on_processes_or_ray() -> None:
    with pytest.raises(ValueError) as error:
        RunConfig.from_dict({"clients_on": "k8s"})
    assert str(error.value) == "run.clients_on: 'k8s' is invalid; allowed: processes|ray"


def test_a_closed_loop_needs_a_slot_per_client() -> None:
    assert split_concurrency(5, 2) == [3, 2]
    assert split_concurrency(None, 3) == [None, None, None]
    with pytest.raises(ValueError, match=r"^workload\.arrival\.max_concurrency: 1 is invalid"):
        split_concurrency(1, 2, "workload.arrival.max_concurrency")
    with pytest.raises(ValueError) as error:
        split_concurrency(1, 2)
    assert str(error.value) == (
        "workload.arrival.concurrency: 1 is invalid with run.num_clients=2; allowed: an "
        "integer >= 2 (each client keeps at least one request in flight)"
    )


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["workload.arrival={process: closed, concurrency: 1}"], "workload.arrival.concurrency"),
        (
            ["workload.arrival={process: poisson, rate: 5, max_concurrency: 1}"],
            "workload.arrival.max_concurrency",
        ),
        (  # a trace replay takes its cap at the top of the workload: the error names that key
            [
                "workload=trace",
                "workload.path=data/traces/AzureLLMInferenceTrace_conv.csv",
                "workload.max_concurrency=1",
            ],
            "workload.max_concurrency",
        ),
    ],
)
def test_too_few_slots_for_the_clients_stop_the_run_at_the_edge(
    overrides: list[str], key: str
) -> None:
    # checked with the `run` section, before the server is asked or warmed up, and named by
    # the key the user set
    config = composed("engine=openai", "model=tiny", "run.num_clients=2", *overrides)
    with pytest.raises(ValueError) as error:
        run_config(config)
    assert str(error.value).startswith(f"{key}: 1 is invalid with run.num_clients=2; ")
    assert run_config({**config, "run": {**config["run"], "num_clients": 1}}).num_clients == 1


def test_sessions_stay_whole_and_are_dealt_in_arrival_order() -> None:
    config = composed(
        "model=tiny",
        "workload.num_requests=9",
        "workload.input_len=8",
        "workload.output_len=4",
        "workload.sessions={num_turns: 3, think_time_s: 0.1}",
        "workload.arrival={process: poisson, rate: 5}",
    )
    requests = make_workload(config["workload"]).build(None, 256)
    shares = split_requests(requests, 2)
    assert sorted(w.request_id for share in shares for w in share) == sorted(
        w.request_id for w in requests
    )
    firsts = sorted((w for w in requests if not w.follows), key=lambda w: w.arrival_s)
    for index, share in enumerate(shares):
        ids = {w.request_id for w in share}
        # every turn's previous turn is on the same client
        assert all(w.follows in ids for w in share if w.follows)
        assert [w for w in share if not w.follows] == firsts[index::2]


def test_the_clock_offset_keeps_the_shortest_round_trip() -> None:
    """A scripted exchange: the client's clock runs 1000 ns ahead; of three round trips the
    shortest (100 ns, the client reading 20 ns into it) is kept: off by 30 ns, within 50."""
    now = [0]
    trips = iter([(400, 300), (100, 20), (600, 10)])  # (launcher's trip, when the client reads)

    def clock() -> int:
        return now[0]

    def ask() -> int:
        trip, reads_at = next(trips)
        reading = now[0] + reads_at + 1000
        now[0] += trip
        return reading

    assert measure_offset(ask, clock, rounds=3) == ClockOffset(1000 + 20 - 50, 50)


def test_a_bad_num_clients_stops_inferlab_run_before_anything_runs(tmp_path: Path) -> None:
    command = ["run", "model=tiny", "run.num_clients=2", f"hydra.run.dir={tmp_path}"]
    result = subprocess.run(
        [sys.executable, "-m", "harness.cli", *command],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().endswith(
        "error: engine.backend: 'builtin' cannot run with run.num_clients=2; allowed: openai "
        "(client processes of one server), or run.num_clients=1"
    )
    assert not (tmp_path / "summary.json").exists()


# ---- against servers ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    log = tmp_path_factory.mktemp("scripted") / "server.log"
    with scripted_process(["--ttft-ms", str(TTFT_MS), "--itl-ms", str(ITL_MS)], log) as server:
        yield server


def scripted_config(server: ServeProcess, *overrides: str) -> dict[str, Any]:
    return composed(
        "engine=openai",
        f"engine.base_url={server.base_url}/v1",
        "engine.model=scripted",
        "model=tiny",
        "workload.input_len=8",
        "run.num_clients=2",
        "run.warmup_requests=0",
        "run.progress=false",
        *overrides,
    )


@pytest.mark.slow
def test_two_clients_against_inferlab_serve_make_one_table(tmp_path: Path) -> None:
    serve_args = ["model=tiny", "engine.device=cpu", "engine.dtype=float32"]
    serve_args += ["engine.num_threads=1", "engine.max_model_len=256"]
    with serve_process(serve_args, tmp_path / "server.log", startup_timeout_s=180) as server:
        config = composed(
            "engine=openai",
            f"engine.base_url={server.base_url}/v1",
            "model=tiny",
            "workload.num_requests=6",
            "workload.input_len=16",
            "workload.output_len=8",
            "workload.sessions={num_turns: 2, think_time_s: 0.0}",
            "workload.arrival={process: closed, concurrency: 2}",
            "run.num_clients=2",
            "run.warmup_requests=1",
            "run.progress=false",
        )
        summary = run_experiment(config, tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary["error"]
    requests = load_table(tmp_path / "run", "requests")
    tokens = load_table(tmp_path / "run", "tokens")
    assert set(requests["request_id"]) == workload_ids(config) and len(requests) == 6
    assert (requests["status"] == "ok").all()
    per_request = tokens.groupby("request_id").size()
    by_id = requests.set_index("request_id")
    assert (per_request == by_id["output_tokens"].loc[per_request.index]).all()
    assert set(per_request.index) == set(by_id.index)
    assert (by_id["output_tokens"] == by_id["output_tokens_reported"]).all()  # the server's usage
    assert (by_id["output_tokens"] == 8).all()
    # a second turn went out with its conversation (16 + 8 + 16 tokens): same client, in order
    assert (by_id.loc[by_id["turn"] == 1, "prompt_tokens"] == 40).all()
    clients = summary["clients"]
    assert [c["requests"] for c in clients] == [4, 2]  # 3 sessions of 2 turns, round-robin
    assert [c["concurrency"] for c in clients] == [1, 1]
    assert all(c["status"] == "done" and c["requests_finished"] == c["requests"] for c in clients)
    assert len({c["pid"] for c in clients}) == 2 and os.getpid() not in {c["pid"] for c in clients}
    assert all(c["clock_offset_uncertainty_us"] is not None for c in clients)
    client = summary["engine"]["client"]  # every client's figures, merged; warm-up left out
    assert client["requests_finished"] == 6 and client["output_tokens_usage"] == 48
    assert summary["metrics"]["num_requests"] == 6


@pytest.mark.slow
def test_merged_itl_and_ttft_are_the_servers_send_times(
    scripted: ServeProcess, tmp_path: Path
) -> None:
    config = scripted_config(
        scripted,
        "workload.num_requests=8",
        "workload.output_len=8",
        "workload.arrival={process: poisson, rate: 10}",
    )
    summary = run_experiment(config, tmp_path, progress=False)
    assert summary["status"] == "complete", summary["error"]
    requests = load_table(tmp_path, "requests").set_index("request_id")
    tokens = with_send_times(load_table(tmp_path, "tokens"), read_log(scripted.base_url))
    assert tokens["sent_ns"].notna().all()  # every token the clients saw, the server sent
    t0 = summary["clients_t0_ns"]
    clients = summary["clients"]
    overhead_p99_s = max(c["client_overhead_per_chunk_p99_us"] for c in clients) / 1e6
    uncertainty_s = max(c["clock_offset_uncertainty_us"] for c in clients) / 1e6

    # ITL: the client's gaps against the server's send gaps, chunk by chunk
    client_gaps = tokens.groupby("request_id")["time_s"].diff().dropna()
    server_gaps = tokens.groupby("request_id")["sent_ns"].diff().dropna() / 1e9
    error = (client_gaps - server_gaps).abs()
    assert len(error) == 8 * 7
    assert error.median() <= 0.001 + overhead_p99_s, error.describe()
    assert error.quantile(0.9) <= 0.003 + overhead_p99_s, error.describe()
    itl_mean = summary["metrics_whole_run"]["itl_mean_s"]
    assert itl_mean == pytest.approx(server_gaps.mean(), abs=0.0005)
    assert itl_mean == pytest.approx(ITL_MS / 1e3, rel=0.3)  # the script's ITL, give or take load

    # the rows are on the launcher's t0: a chunk arrives after the server sent it, soon after
    lag = t0 + tokens["time_s"] * 1e9 - tokens["sent_ns"]
    assert lag.min() >= -(uncertainty_s * 1e9 + 200_000), lag.describe()
    assert lag.median() <= 5e6, lag.describe()

    # TTFT: the client's (from its send) is the server's (from its receipt) plus the trip
    first = tokens[tokens["index"] == 0].set_index("request_id")
    server_ttft = (first["sent_ns"] - first["received_ns"]) / 1e9
    client_ttft = first["time_s"] - requests.loc[first.index, "sent_s"]
    extra = client_ttft - server_ttft
    assert (server_ttft >= TTFT_MS / 1e3 - 1e-4).all()
    assert extra.min() >= -uncertainty_s - 1e-4 and extra.median() <= 0.01, extra.describe()


@pytest.mark.slow
def test_a_rate_with_a_cap_holds_over_all_clients(scripted: ServeProcess, tmp_path: Path) -> None:
    # 200 req/s of ~60 ms requests would keep about 12 in flight; the cap of 2, one per
    # client, keeps 2
    config = scripted_config(
        scripted,
        "workload.num_requests=10",
        "workload.output_len=8",
        "workload.arrival={process: poisson, rate: 200, max_concurrency: 2}",
    )
    summary = run_experiment(config, tmp_path, progress=False)
    assert summary["status"] == "complete", summary["error"]
    assert [c["max_concurrency"] for c in summary["clients"]] == [1, 1]
    requests = load_table(tmp_path, "requests")
    events = sorted(
        [(t, 1) for t in requests["sent_s"]] + [(t, -1) for t in requests["finished_s"]],
        key=lambda e: (e[0], e[1]),  # a finish before a send at the same instant
    )
    in_flight = peak = 0
    for _, step in events:
        in_flight += step
        peak = max(peak, in_flight)
    assert peak == 2
    assert (requests["sent_s"] - requests["arrival_s"]).max() > 0.05  # requests waited


@pytest.mark.slow
def test_clients_as_ray_tasks_make_the_same_table(scripted: ServeProcess, tmp_path: Path) -> None:
    import ray

    config = scripted_config(
        scripted,
        "workload.num_requests=6",
        "workload.output_len=8",
        "workload.arrival={process: poisson, rate: 20}",
        "run.clients_on=ray",
    )
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=78643200)
    try:
        summary = run_experiment(config, tmp_path, progress=False)
    finally:
        ray.shutdown()
    assert summary["status"] == "complete", summary["error"]
    clients = summary["clients"]
    assert [c["status"] for c in clients] == ["done", "done"]
    assert sum(c["requests"] for c in clients) == 6
    assert all(c["clock_offset_uncertainty_us"] is not None for c in clients)
    requests = load_table(tmp_path, "requests")
    assert set(requests["request_id"]) == workload_ids(config)
    assert (requests["output_tokens"] == 8).all() and (requests["status"] == "ok").all()
    tokens = with_send_times(load_table(tmp_path, "tokens"), read_log(scripted.base_url))
    client_gaps = tokens.groupby("request_id")["time_s"].diff().dropna()
    server_gaps = tokens.groupby("request_id")["sent_ns"].diff().dropna() / 1e9
    assert (client_gaps - server_gaps).abs().median() <= 0.002


@pytest.mark.slow
def test_a_killed_client_leaves_failed_rows_with_the_reason(
    scripted: ServeProcess, tmp_path: Path
) -> None:
    config = scripted_config(
        scripted,
        "workload.num_requests=8",
        "workload.output_len=30",
        "workload.arrival={process: constant, rate: 4}",
    )
    result: dict[str, Any] = {}
    runner = threading.Thread(
        target=lambda: result.update(run_experiment(config, tmp_path, progress=False))
    )
    runner.start()
    victim = None
    deadline = time.monotonic() + 120
    while victim is None or not load_table(tmp_path, "requests").shape[0]:
        assert time.monotonic() < deadline and runner.is_alive()
        victim = next(
            (p for p in multiprocessing.active_children() if p.name == "inferlab-client-1"), None
        )
        time.sleep(0.05)
    assert victim.pid is not None
    os.kill(victim.pid, signal.SIGKILL)
    runner.join(timeout=120)
    assert result["status"] == "failed"
    reason = f"client 1 (pid {victim.pid}) died (exit code -9)"
    assert result["error"].startswith(f"RuntimeError: {reason}; its ")
    requests = load_table(tmp_path, "requests")
    assert set(requests["request_id"]) == workload_ids(config)  # nothing lost
    failed = requests[requests["status"] == "failed"]
    assert len(failed) >= 1
    assert (failed["error"] == f"{reason} before this request finished").all()
    # client 0 ran its whole share (every other request in arrival order, from the first)
    client_0 = {f"req-{i}" for i in range(0, 8, 2)}
    assert set(requests.loc[requests["status"] == "ok", "request_id"]) >= client_0
    assert not set(failed["request_id"]) & client_0
    states = {c["client"]: c["status"] for c in result["clients"]}
    assert states == {0: "done", 1: "died"}


@pytest.mark.slow
def test_ctrl_c_stops_every_client_and_the_run_is_incomplete(
    scripted: ServeProcess, tmp_path: Path
) -> None:
    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "run",
            "engine=openai",
            f"engine.base_url={scripted.base_url}/v1",
            "engine.model=scripted",
            "model=tiny",
            "workload.num_requests=12",
            "workload.input_len=8",
            "workload.output_len=30",
            "workload.arrival={process: constant, rate: 3}",
            "run.num_clients=2",
            "run.warmup_requests=0",
            "run.progress=false",
            f"hydra.run.dir={tmp_path}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 180
    while not (tmp_path / "requests.jsonl").is_file() or len(load_table(tmp_path, "requests")) < 2:
        assert time.monotonic() < deadline and run.poll() is None, run.communicate()
        time.sleep(0.05)
    run.send_signal(signal.SIGINT)
    out, err = run.communicate(timeout=60)
    assert run.returncode == 130, (out, err)
    summary = read_summary(tmp_path)
    assert summary is not None
    assert (summary["status"], summary["error"]) == ("incomplete", "interrupted: SIGINT")
    requests = load_table(tmp_path, "requests")
    assert 2 <= len(requests) < 12 and (requests["status"] == "ok").all()
    tokens = load_table(tmp_path, "tokens")
    assert (tokens.groupby("request_id").size() == 30).all()
    assert set(tokens["request_id"]) == set(requests["request_id"])
    for client in summary["clients"]:
        assert client["status"] == "interrupted", client
        with pytest.raises(ProcessLookupError):  # no client outlives the run
            os.kill(client["pid"], 0)
    assert np.isfinite(summary["metrics"]["ttft_p50_s"])
    assert json.loads((tmp_path / "summary.json").read_text())["clients_t0_ns"] > 0


@pytest.mark.slow
def test_many_clients_run_in_a_joblib_sweeps_job(scripted: ServeProcess, tmp_path: Path) -> None:
    # A joblib worker's default start method is "loky", which a spawned client did not know:
    # every client died at once ("cannot find context for 'loky'") and the job failed
    # (n_jobs=2: with 1, joblib runs the job in the launching process).
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "-m", "engine=openai",
         f"engine.base_url={scripted.base_url}/v1", "engine.model=scripted", "model=tiny",
         "workload.num_requests=4", "workload.input_len=8", "workload.output_len=4",
         "run.warmup_requests=0", "run.progress=false", "run.num_clients=2",
         "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", f"hydra.sweep.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    summary = read_summary(tmp_path / "0")
    assert summary is not None and summary["status"] == "complete", summary
    assert [c["status"] for c in summary["clients"]] == ["done", "done"]
