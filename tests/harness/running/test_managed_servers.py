"""Sweeps over a real server's flags (engine.launch, docs/managed_servers.md), run as a user runs
them: `inferlab serve` 2 x 2 and llama.cpp's server over threads on SmolLM2, a bad flag that is
one failed row with the server's own error, reuse across workload-only jobs, a sweep killed
with SIGKILL and resumed, Ctrl-C, a server killed mid-run, joblib's and Ray's placement, many client
processes and the capacity search on one server; after each, no server process is left."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[3]
JOB = [
    "model=tiny",
    "workload.num_requests=4",
    "workload.input_len=8",
    "workload.output_len=4",
    "run.warmup_requests=0",
    "run.progress=false",
]
# serving/scripted_server.py: an OpenAI server in the lab's dialect that starts in a second
SCRIPTED = [
    "engine=openai",
    'engine.launch.command=["{python}","-m","serving.scripted_server","--host","{host}",'
    '"--port","{port}","--model","{served_model_name}"]',
    "engine.launch.stop_timeout_s=5",
]


def inferlab(sweep_dir: Path, *overrides: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "-m", *JOB, *overrides,
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def start_inferlab(sweep_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "run", "-m", *JOB, *overrides,
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def summary(job: Path) -> dict[str, Any]:
    return json.loads((job / "summary.json").read_text())


def server_of(job: Path) -> dict[str, Any]:
    launched = summary(job)["engine"]["launched_server"]
    assert isinstance(launched, dict)
    return launched


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


def eventually(condition: Any, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def none_left(pids: list[int]) -> None:
    """No server the sweep started is still running (a moment for the kernel to reap)."""
    assert eventually(lambda: not any(alive(p) for p in pids), 15), [p for p in pids if alive(p)]


def processes_with(*words: str) -> list[int]:
    """Processes whose command line holds every word (a server whose pid no file recorded)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            argv = (proc / "cmdline").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        line = " ".join(a.decode(errors="replace") for a in argv)
        if proc.name.isdigit() and all(w in line for w in words) and alive(int(proc.name)):
            found.append(int(proc.name))
    return found


def server_pid_when_running(job: Path, seconds: float = 120) -> int:
    """The pid of the job's server once it runs (provenance.json names it after the load)."""

    def started() -> bool:
        try:
            return "server" in json.loads((job / "provenance.json").read_text())
        except (OSError, ValueError):
            return False

    assert eventually(started, seconds), f"{job}: no server started"
    pid = json.loads((job / "provenance.json").read_text())["server"]["pid"]
    assert isinstance(pid, int)
    return pid


def test_a_2x2_sweep_over_inferlab_serve_flags(tmp_path: Path) -> None:
    done = inferlab(
        tmp_path,
        "engine=serve_inferlab",
        "engine.launch.params.engine.max_num_seqs=1,4",
        "engine.launch.params.engine.kv_cache=paged,contiguous",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert list(table["status"]) == ["complete"] * 4
    for _, row in table.iterrows():  # each job's flags are on its server's command line
        command = row["server_command"]
        assert f"engine.max_num_seqs={row['engine.launch.params.engine.max_num_seqs']}" in command
        assert f"engine.kv_cache={row['engine.launch.params.engine.kv_cache']}" in command
        assert "-m harness.cli serve model=tiny" in command
    assert set(table["server_version"].astype(str)) == {"0.1.0"}
    assert not table["server_reused"].any()  # the flags differ from job to job
    jobs = [tmp_path / str(i) for i in range(4)]
    pids = [server_of(job)["pid"] for job in jobs]
    assert len(set(pids)) == 4
    for job in jobs:
        provenance = json.loads((job / "provenance.json").read_text())
        assert provenance["server"]["command"] == server_of(job)["command"]
        assert "inferlab serve: tiny" in (job / "server.log").read_text()
    none_left(pids)


def test_llama_cpp_server_two_thread_counts_on_smollm2(tmp_path: Path) -> None:
    done = inferlab(
        tmp_path,
        "engine=serve_llama_cpp_python",
        "model=smollm2-135m",
        "workload.prompt=text",
        "workload.input_len=32",
        "workload.output_len=8",
        "engine.launch.threads=1,2",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert list(table["status"]) == ["complete", "complete"]
    assert "--n_threads 1 --n_threads_batch 1" in table.loc[0, "server_command"]
    assert "--n_threads 2 --n_threads_batch 2" in table.loc[1, "server_command"]
    assert table["output_tokens_total"].eq(4 * 8).all()
    import llama_cpp

    assert set(table["server_version"].astype(str)) == {llama_cpp.__version__}
    none_left([server_of(tmp_path / str(i))["pid"] for i in range(2)])


def test_a_bad_flag_is_one_failed_row_with_the_servers_own_error(tmp_path: Path) -> None:
    done = inferlab(
        tmp_path, "engine=serve_inferlab", "engine.launch.params.engine.max_num_seqs=0,2"
    )
    assert done.returncode == 1  # a job did not complete; the sweep went on
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert list(table["status"]) == ["failed", "complete"]
    error = table.loc[0, "error"]
    assert "exited with status 2 before it was ready" in error
    # inferlab serve's own one-line refusal, from its log
    assert "engine.max_num_seqs: 0 is invalid" in error
    assert "engine.max_num_seqs: 0 is invalid" in (tmp_path / "0" / "server.log").read_text()
    none_left([server_of(tmp_path / "1")["pid"]])
    assert not processes_with("harness.cli", "serve", "engine.max_num_seqs=0")


def test_workload_only_jobs_share_one_server_which_the_sweep_stops(tmp_path: Path) -> None:
    done = inferlab(tmp_path, *SCRIPTED, "workload.output_len=3,5", "workload.input_len=8,16")
    assert done.returncode == 0, done.stderr[-3000:]
    servers = [server_of(tmp_path / str(i)) for i in range(4)]
    assert len({s["pid"] for s in servers}) == 1
    assert [s["reused"] for s in servers] == [False, True, True, True]
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert list(table["server_reused"]) == [False, True, True, True]
    assert table["output_tokens_total"].tolist() == [12, 20, 12, 20]
    # each job's folder has the server's output during that job; the first its start-up
    assert "inferlab serve: scripted" in (tmp_path / "0" / "server.log").read_text()
    none_left([servers[0]["pid"]])


def test_reuse_off_starts_a_server_per_job(tmp_path: Path) -> None:
    done = inferlab(tmp_path, *SCRIPTED, "engine.launch.reuse=false", "workload.output_len=3,5")
    assert done.returncode == 0, done.stderr[-3000:]
    pids = [server_of(tmp_path / str(i))["pid"] for i in range(2)]
    assert pids[0] != pids[1]
    none_left(pids)


SLOW_JOBS = [
    *SCRIPTED,
    "engine.launch.params.itl_ms=20",  # 120 tokens, 20 ms apart: each job runs ~2.5 s
    "workload.output_len=120",
    "workload.input_len=8,9,10",
]


def test_a_sweep_killed_with_sigkill_leaves_no_server_and_resumes(tmp_path: Path) -> None:
    sweep = start_inferlab(tmp_path, *SLOW_JOBS, "engine.launch.reuse=false")
    try:
        pid = server_pid_when_running(tmp_path / "1")
        sweep.kill()  # no clean-up of ours runs
        sweep.wait()
    finally:
        if sweep.poll() is None:
            sweep.kill()
    none_left([pid])  # the server's death signal
    assert summary(tmp_path / "0")["status"] == "complete"
    first_server = server_of(tmp_path / "0")["pid"]
    resumed = inferlab(tmp_path, *SLOW_JOBS, "engine.launch.reuse=false", "run.resume=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "job 0: skipped (already complete)" in resumed.stdout
    table = pd.read_csv(tmp_path / "sweep.csv")
    assert list(table["status"]) == ["complete"] * 3
    assert server_of(tmp_path / "0")["pid"] == first_server  # not run again
    none_left([server_of(tmp_path / str(i))["pid"] for i in (1, 2)])


def test_ctrl_c_stops_the_current_server(tmp_path: Path) -> None:
    sweep = start_inferlab(tmp_path, *SLOW_JOBS)
    try:
        pid = server_pid_when_running(tmp_path / "0")
        time.sleep(0.5)  # requests in flight
        sweep.send_signal(signal.SIGINT)
        output, _ = sweep.communicate(timeout=60)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 130, output[-3000:]
    assert summary(tmp_path / "0")["status"] == "incomplete"
    assert not (tmp_path / "1").exists()  # the sweep stopped
    none_left([pid])


def test_a_server_killed_mid_run_fails_its_job_and_the_next_job_starts_another(
    tmp_path: Path,
) -> None:
    sweep = start_inferlab(tmp_path, *SLOW_JOBS, "workload.input_len=8,9")
    try:
        pid = server_pid_when_running(tmp_path / "0")
        time.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        output, _ = sweep.communicate(timeout=120)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert sweep.returncode == 1, output[-3000:]
    failed = summary(tmp_path / "0")
    assert failed["status"] == "failed"
    assert "the server exited with status -9 during the run" in failed["error"]
    second = server_of(tmp_path / "1")
    assert summary(tmp_path / "1")["status"] == "complete" and not second["reused"]
    none_left([second["pid"]])


@pytest.mark.parametrize(
    "launcher", [["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], ["hydra/launcher=ray"]]
)
def test_launched_jobs_start_their_servers_on_their_own_cores(
    tmp_path: Path, launcher: list[str]
) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.fail("this test needs 2 cores (CI's machine has them)")
    done = inferlab(tmp_path, *SCRIPTED, *launcher, "workload.output_len=3,5")
    assert done.returncode == 0, done.stderr[-3000:]
    cores = []
    for i in range(2):
        placement = json.loads((tmp_path / str(i) / "provenance.json").read_text())["placement"]
        server = server_of(tmp_path / str(i))
        assert server["cores"] == placement["cores"]  # the server runs where its job was put
        assert not server["reused"]  # a job's placement ends with it, and its server too
        cores.append(set(server["cores"]))
    assert not cores[0] & cores[1]
    none_left([server_of(tmp_path / str(i))["pid"] for i in range(2)])


def test_many_client_processes_reach_the_one_server(tmp_path: Path) -> None:
    done = inferlab(tmp_path, *SCRIPTED, "run.num_clients=2", "workload.num_requests=6")
    assert done.returncode == 0, done.stderr[-3000:]
    run = summary(tmp_path / "0")
    assert run["metrics"]["num_requests"] == 6 and run["metrics"]["num_failed"] == 0
    none_left([server_of(tmp_path / "0")["pid"]])


def test_a_capacity_search_runs_every_load_point_on_one_server(tmp_path: Path) -> None:
    done = inferlab(
        tmp_path,
        "experiment=capacity",
        "model=tiny",
        "engine=serve_inferlab",
        "engine.launch.params.engine.max_num_seqs=4",  # past 4 at once, a queue builds
        "workload.num_requests=30",
        "workload.output_len=16",
        "run.search.slo=['ttft_p99_s <= 0.05']",
        "run.search.max_points=4",
    )
    assert done.returncode == 0, done.stderr[-3000:]
    jobs = sorted(p for p in tmp_path.iterdir() if (p / "summary.json").exists())
    assert len(jobs) >= 3
    servers = [server_of(job) for job in jobs]
    assert len({s["pid"] for s in servers}) == 1
    assert sum(not s["reused"] for s in servers) == 1
    assert json.loads((tmp_path / "sweep_summary.json").read_text())["max_rate_at_slo"]
    none_left([servers[0]["pid"]])


def test_a_reused_servers_metrics_count_from_each_jobs_own_start(tmp_path: Path) -> None:
    """The server's /metrics counters run on over jobs; each job's server_* figures are the
    differences over its own measured requests (warm-up left out)."""
    done = inferlab(
        tmp_path, "engine=serve_inferlab", "run.warmup_requests=2", "workload.output_len=3,5"
    )
    assert done.returncode == 0, done.stderr[-3000:]
    metrics = [summary(tmp_path / str(i))["metrics"] for i in range(2)]
    assert server_of(tmp_path / "1")["reused"]
    assert [m["server_requests_finished"] for m in metrics] == [4, 4]
    assert [m["server_generation_tokens"] for m in metrics] == [12, 20]
    none_left([server_of(tmp_path / "0")["pid"]])
