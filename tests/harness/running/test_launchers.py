"""Sweeps on Hydra's launcher plugins: a local Ray cluster and submitit_local give what the
basic launcher gives; a job killed on a worker is a failed row that resume finishes; jobs get
disjoint cores (or say they share); a run folder travels back where the sweep folder is not;
a launcher whose extra is missing is one line."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from hydra.core.utils import JobReturn, JobStatus
from omegaconf import OmegaConf

from harness.running import launching, placement
from harness.running.sweep import sweep_rows

REPO = Path(__file__).resolve().parents[3]
TINY_JOB = [
    "model=tiny",
    "workload.num_requests=2",
    "workload.input_len=8",
    "workload.output_len=4",
    "run.warmup_requests=0",
    "run.progress=false",
]


def sweep(sweep_dir: Path, *overrides: str, timeout: float = 300) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "-m", *TINY_JOB, *overrides,
         f"hydra.sweep.dir={sweep_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def layout(sweep_dir: Path) -> dict[str, list[str]]:
    """Each job folder's files, and the sweep folder's own, less a launcher's private state."""
    out = {".": sorted(p.name for p in sweep_dir.iterdir() if p.is_file())}
    for job in sorted(p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()):
        out[job.name] = sorted(str(p.relative_to(job)) for p in job.rglob("*") if p.is_file())
    return out


@pytest.mark.slow
def test_a_ray_sweep_equals_the_basic_launchers(tmp_path: Path) -> None:
    grid = ["engine.kv_cache=none,paged", "workload.output_len=3,4"]
    sweep(tmp_path / "basic", *grid)
    sweep(tmp_path / "ray", *grid, "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2")
    assert layout(tmp_path / "ray") == layout(tmp_path / "basic")
    basic = pd.read_csv(tmp_path / "basic" / "sweep.csv")
    ray = pd.read_csv(tmp_path / "ray" / "sweep.csv")
    assert list(ray.columns) == list(basic.columns)
    keys = ["job", "engine.kv_cache", "workload.output_len", "status"]
    assert ray[keys].equals(basic[keys]) and len(ray) == 4
    assert set(ray["status"]) == {"complete"}
    placements = [
        json.loads((tmp_path / "ray" / str(j) / "provenance.json").read_text())["placement"]
        for j in range(4)
    ]
    assert {p["launcher"] for p in placements} == {"ray"}
    assert all(p["node"] and p["pid"] > 0 and len(p["cores"]) == 1 for p in placements)
    # Ray runs two at a time (num_cpus=2, one per task): their claims never overlap
    assert not any(p["shared_cores"] for p in placements)
    for side in ("basic", "ray"):
        report = subprocess.run(
            [sys.executable, "-m", "harness.cli", "report", str(tmp_path / side)],
            cwd=REPO, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert report.returncode == 0, report.stderr[-2000:]
    assert "report.md" in layout(tmp_path / "ray")["."]
    assert layout(tmp_path / "ray") == layout(tmp_path / "basic")


@pytest.mark.slow
def test_repeats_spread_over_the_launchers_workers(tmp_path: Path) -> None:
    grid = ["engine.kv_cache=none,paged", "repeats=2"]
    sweep(tmp_path / "basic", *grid)
    sweep(tmp_path / "joblib", *grid, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    without_logs = {
        k: [f for f in v if not f.endswith(".log")] for k, v in layout(tmp_path / "basic").items()
    }
    assert {
        k: [f for f in v if not f.endswith(".log")] for k, v in layout(tmp_path / "joblib").items()
    } == without_logs
    for job in ("0", "1"):
        summary = json.loads((tmp_path / "joblib" / job / "summary.json").read_text())
        assert summary["status"] == "complete" and summary["repeat_status"] == ["complete"] * 2
        assert len(summary["metrics_spread"]["ttft_p50_s"]["values"]) == 2
        for k in (0, 1):  # each repeat was a job of the launcher (a subprocess has no placement)
            record = json.loads(
                (tmp_path / "joblib" / job / f"repeat-{k}" / "provenance.json").read_text()
            )
            assert record["placement"]["launcher"] == "joblib"
    rows = pd.read_csv(tmp_path / "joblib" / "sweep.csv")
    assert list(rows["repeats"]) == [2, 2] and set(rows["status"]) == {"complete"}


@pytest.mark.slow
def test_batches_after_repeats_ran_as_jobs_keep_the_grids_job_folders(tmp_path: Path) -> None:
    # batch 1's two jobs of 2 repeats were 4 launcher jobs; batch 2's jobs are still 2 and 3
    # (they were 4 and 5: the launcher numbers on from all it launched)
    grid = ["repeats=2,1", "engine.kv_cache=none,paged", "hydra.sweeper.max_batch_size=2"]
    sweep(tmp_path / "basic", *grid)
    sweep(tmp_path / "joblib", *grid, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert sorted(layout(tmp_path / "joblib")) == [".", "0", "1", "2", "3"]
    rows = pd.read_csv(tmp_path / "joblib" / "sweep.csv")
    basic = pd.read_csv(tmp_path / "basic" / "sweep.csv")
    keys = ["job", "repeats", "engine.kv_cache", "status"]
    assert rows[keys].equals(basic[keys]) and set(rows["status"]) == {"complete"}


def gate_ab_on_joblib(out: Path, rounds: int, launcher_options: str) -> int:
    """`inferlab gate ab` of the tiny job against its paged-KV twin, rounds on joblib."""
    from harness import cli

    return cli.main(
        ["gate", "ab", "--baseline", "", "--candidate", "engine.kv_cache=paged",
         "--common", " ".join(TINY_JOB), "--rounds", str(rounds), "--allow-few-rounds",
         "--launcher", "joblib", "--launcher-options", launcher_options, "--out", str(out)]
    )  # fmt: skip


@pytest.mark.slow
def test_ab_rounds_run_as_launcher_jobs_each_paired_on_one_slot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ab"
    code = gate_ab_on_joblib(out, 3, "hydra.launcher.n_jobs=2")
    printed = capsys.readouterr().out
    assert code == 2, printed  # 3 rounds: too few to decide timing
    ab = json.loads((out / "ab.json").read_text())
    assert ab["status"] == "complete" and len(ab["rounds"]) == 3
    assert [r["order"] for r in ab["rounds"]] == [["a", "b"], ["b", "a"], ["a", "b"]]
    assert len(ab["warmup"]) == 3  # one warm-up per round job: its workers are its own
    for entry in ab["rounds"]:
        assert entry["a_status"] == entry["b_status"] == "complete" and entry["ratios"]
        slot = entry["placement"]
        assert slot["launcher"] == "joblib" and len(slot["cores"]) == 1
        for side in "ab":  # both sides ran in that job's workers, on its core
            record = json.loads((out / entry[side] / "provenance.json").read_text())
            assert record["threads"]["affinity"] == slot["cores"]
    assert "paired ratios over A/B rounds" in printed


def test_ab_launcher_options_it_refuses_are_its_error_not_a_failed_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ab"
    code = gate_ab_on_joblib(out, 2, "hydra.launcher.n_jobs=two")
    captured = capsys.readouterr()
    assert code == 2
    assert "failed" not in captured.out and "baseline" not in captured.out
    error = captured.err.strip().splitlines()[-1]
    assert error.startswith("inferlab gate ab: error: --launcher joblib: the launcher ran no round")
    assert "Value 'two' of type 'str' could not be converted to Integer" in error
    ab = json.loads((out / "ab.json").read_text())
    assert ab["status"] == "stopped" and ab["rounds"] == [] and "verdict" not in ab


def _group_gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.slow
def test_sigterm_to_gate_ab_stops_the_launchers_workers_too(tmp_path: Path) -> None:
    # each run lasts ~3 s (4 requests at 1/s), so the rounds are running when the signal comes
    common = [*TINY_JOB, "workload.num_requests=4", "workload.arrival={process: constant, rate: 1}"]
    out = tmp_path / "ab"
    gate = subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "gate", "ab", "--baseline", "",
         "--candidate", "engine.kv_cache=paged", "--common", shlex.join(common),
         "--rounds", "2", "--allow-few-rounds", "--launcher", "joblib",
         "--launcher-options", "hydra.launcher.n_jobs=2", "--out", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its group: every process the gate and its launcher start
    )  # fmt: skip
    try:
        _wait_for(lambda: any(out.glob("warmup-*-*/summary.json")), 180)
        gate.send_signal(signal.SIGTERM)  # the gate alone, as a CI runner's timeout sends it
        printed, _ = gate.communicate(timeout=120)
        assert gate.returncode == 130, printed[-3000:]
        assert json.loads((out / "ab.json").read_text())["status"] == "incomplete"
        # the launcher's worker processes ended with it: none goes on running rounds
        _wait_for(lambda: _group_gone(gate.pid), 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(gate.pid, signal.SIGKILL)


def _wait_for(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.2)


def _status(job: Path) -> str | None:
    try:
        return json.loads((job / "summary.json").read_text()).get("status")
    except (OSError, ValueError):
        return None


@pytest.mark.slow
def test_a_job_killed_under_submitit_is_a_failed_row_and_resume_finishes_it(
    tmp_path: Path,
) -> None:
    # job 1 decodes for seconds (model=small), long enough to be killed in the middle
    grid = ["model=tiny,small", "workload.output_len=200", "hydra/launcher=submitit_local"]
    command = [sys.executable, "-m", "harness.cli", "run", "-m", *TINY_JOB, *grid,
               f"hydra.sweep.dir={tmp_path}"]  # fmt: skip
    launcher = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    job = tmp_path / "1"
    _wait_for(lambda: _status(job) == "running", 120)
    pid = json.loads((job / "provenance.json").read_text())["placement"]["pid"]
    os.kill(pid, signal.SIGKILL)
    out, _ = launcher.communicate(timeout=300)
    assert launcher.returncode == 1, out[-3000:]  # every job ran; one failed
    assert "sweep: 1 of 2 job(s) did not complete" in out, out[-3000:]
    rows = pd.read_csv(tmp_path / "sweep.csv")
    assert list(rows["status"]) == ["complete", "failed"]
    assert "the job's process ended before its run did" in rows["error"][1]
    assert "UncompletedJobError" in rows["error"][1]  # the launcher's own account

    first = (tmp_path / "0" / "summary.json").read_text()
    resumed = subprocess.run(
        [*command, "run.resume=true"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert (tmp_path / "0" / "summary.json").read_text() == first  # skipped, not run again
    assert list(pd.read_csv(tmp_path / "sweep.csv")["status"]) == ["complete", "complete"]


def test_jobs_the_launcher_lost_keep_their_rows(tmp_path: Path) -> None:
    # a node lost under Ray: neither job's folder reached this host (no summary, no
    # overrides), the sweeper knows only the launcher's error and each job's overrides
    job_dirs = [tmp_path / "0", tmp_path / "1"]
    failed = launching.settle_jobs(job_dirs, "NodeDiedError: node 10.0.0.7 is gone", poll_s=0.01)
    assert failed == job_dirs
    for job_dir, value in zip(job_dirs, ("none", "paged"), strict=True):
        launching.write_job_overrides(job_dir, [f"engine.kv_cache={value}"])
    rows = sweep_rows(tmp_path)
    assert [r["engine.kv_cache"] for r in rows] == ["none", "paged"]
    assert all(r["status"] == "failed" and "NodeDiedError" in r["error"] for r in rows)
    assert all("did not start or its folder never reached this host" in r["error"] for r in rows)


def test_an_interrupted_sweep_stops_its_jobs_and_records_them_incomplete(tmp_path: Path) -> None:
    # job 0 still runs here (a process that ends on SIGTERM), job 1 is complete, job 2 ran on
    # a worker the launcher already ended, job 3 never started (no folder: no row, as under
    # the basic launcher)
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    threading.Thread(target=running.wait, daemon=True).start()  # reaped, as a launcher does
    here = socket.gethostname()
    for job, status, pid in (
        ("0", "running", running.pid),
        ("1", "complete", 0),
        ("2", "running", 0),
    ):
        (tmp_path / job).mkdir()
        (tmp_path / job / "summary.json").write_text(json.dumps({"status": status, "metrics": {}}))
        placement = {"node": here, "pid": pid or 2**22 + 1}  # 0: a pid above Linux's pid_max
        (tmp_path / job / "provenance.json").write_text(json.dumps({"placement": placement}))
    jobs = [tmp_path / str(k) for k in range(4)]
    start = time.monotonic()
    recorded = launching.stop_jobs(jobs, "interrupted: SIGINT", timeout_s=60, poll_s=0.05)
    assert time.monotonic() - start < 30 and running.returncode == -signal.SIGTERM
    assert recorded == [jobs[0], jobs[2]]
    for job in (jobs[0], jobs[2]):
        summary = json.loads((job / "summary.json").read_text())
        assert summary["status"] == "incomplete"
        assert summary["error"].startswith("interrupted: SIGINT: the sweep was stopped")
    assert _status(jobs[1]) == "complete" and not jobs[3].exists()


@pytest.mark.slow
def test_sigterm_to_a_launched_sweep_stops_its_jobs_and_writes_its_table(tmp_path: Path) -> None:
    # each job lasts ~3 s (4 requests at 1/s): both are running when the signal comes
    command = [sys.executable, "-m", "harness.cli", "run", "-m", *TINY_JOB,
               "workload.num_requests=4", "workload.arrival={process: constant, rate: 1}",
               "engine.kv_cache=none,paged", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
               f"hydra.sweep.dir={tmp_path}"]  # fmt: skip
    launcher = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,  # its group: the launcher and its workers
    )  # fmt: skip
    try:
        _wait_for(lambda: all(_status(tmp_path / j) == "running" for j in "01"), 180)
        launcher.send_signal(signal.SIGTERM)  # the launching process alone
        printed, _ = launcher.communicate(timeout=120)
        assert launcher.returncode == 130, printed[-3000:]
        assert "sweep interrupted: SIGTERM: 2 job(s)" in printed
        rows = pd.read_csv(tmp_path / "sweep.csv")
        assert list(rows["status"]) == ["incomplete", "incomplete"]
        assert all(error.startswith("interrupted: SIGTERM") for error in rows["error"])
        _wait_for(lambda: _group_gone(launcher.pid), 30)  # joblib's workers ended with it
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    resumed = subprocess.run(
        [*command, "run.resume=true"], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert list(pd.read_csv(tmp_path / "sweep.csv")["status"]) == ["complete", "complete"]


def test_a_launcher_that_cannot_run_the_sweep_stops_it_with_its_error(tmp_path: Path) -> None:
    # not a lost job (that is a failed row, and the sweep goes on): joblib refuses n_jobs=0
    # for every batch alike, so the sweep stops with exit 1 and the launcher's own words
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "-m", *TINY_JOB,
         "engine.kv_cache=none,paged", "hydra/launcher=joblib", "hydra.launcher.n_jobs=0",
         f"hydra.sweep.dir={tmp_path}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr[-3000:]
    assert done.stderr.strip().splitlines()[-1] == (
        "error: hydra/launcher=joblib could not run the sweep: "
        "ValueError: n_jobs == 0 in Parallel has no meaning"
    )
    assert not (tmp_path / "0").exists() and not (tmp_path / "sweep.csv").exists()
    from joblib.externals.loky.process_executor import TerminatedWorkerError
    from submitit.core.utils import FailedJobError, UncompletedJobError

    lost = [TerminatedWorkerError("SIGKILL"), UncompletedJobError("x"), FailedJobError("x")]
    assert all(launching.lost_a_job(exc) for exc in lost)
    assert not launching.lost_a_job(RuntimeError('Could not detect "srun"'))


def test_a_sweep_folder_that_cannot_be_written_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")  # as a read-only or full filesystem would, mkdir fails
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "-m", *TINY_JOB,
         f"hydra.sweep.dir={tmp_path / 'file' / 'sweep'}"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2  # refused before Hydra or the sweeper writes anything
    assert done.stderr.strip() == (
        f"error: hydra.sweep.dir: {tmp_path / 'file' / 'sweep'} cannot be written: Not a directory"
    )


@pytest.mark.slow
def test_joblib_workers_end_after_their_launcher_was_killed(tmp_path: Path) -> None:
    # SIGKILL (the OOM killer) gives the launching process no say: its joblib workers finish
    # the jobs they run (complete jobs are kept for resume), then end instead of idling for good
    launcher = subprocess.Popen(
        [sys.executable, "-m", "harness.cli", "run", "-m", *TINY_JOB,
         "workload.num_requests=4", "workload.arrival={process: constant, rate: 1}",
         "engine.kv_cache=none,paged", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2",
         f"hydra.sweep.dir={tmp_path}"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    try:
        _wait_for(lambda: all(_status(tmp_path / j) == "running" for j in "01"), 180)
        launcher.kill()
        launcher.wait()
        _wait_for(lambda: _group_gone(launcher.pid), 60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
    assert [_status(tmp_path / j) for j in "01"] == ["complete", "complete"]


def test_the_launching_process_never_watches_its_own_parent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # joblib runs a job in the launching process itself with n_jobs=1: whose parent (a shell
    # closed under nohup) going away must not end the sweep between two jobs
    monkeypatch.setattr(launching, "_watching_parent", False)
    started: list[Any] = []
    monkeypatch.setattr(launching.threading, "Thread", lambda **kw: started.append(kw))
    launching._watch_parent(poll_s=0.01)
    assert started == [] and launching._watching_parent is False


def test_a_run_folder_travels_back_to_the_launching_host(tmp_path: Path) -> None:
    """A job on a host without the sweep folder returns its folder; the sweeper writes it."""
    from hydra_plugins.inferlab_sweeper.inferlab_sweeper import InferlabSweeper

    remote = tmp_path / "remote" / "3"  # the job's host: no .launch.json above its folder
    (remote / ".hydra").mkdir(parents=True)
    (remote / ".hydra" / "overrides.yaml").write_text("- engine.kv_cache=paged\n")
    (remote / "summary.json").write_text(json.dumps({"status": "complete", "metrics": {"x": 1}}))
    (remote / "requests.parquet").write_bytes(b"PAR1 rows")
    assert launching.read_launch_record(remote.parent) is None

    result = JobReturn()
    result.status = JobStatus.COMPLETED
    result.return_value = {
        "status": "complete",
        launching.ARCHIVE_KEY: launching.pack_folder(remote),
    }
    result.hydra_cfg = OmegaConf.create({"hydra": {"sweep": {"subdir": "3"}}})
    home = tmp_path / "home"
    InferlabSweeper(max_batch_size=None)._gather(result, home)
    assert launching.ARCHIVE_KEY not in result.return_value
    assert (home / "3" / "requests.parquet").read_bytes() == b"PAR1 rows"
    [row] = sweep_rows(home)
    assert row["status"] == "complete" and row["engine.kv_cache"] == "paged" and row["x"] == 1


def test_jobs_claim_disjoint_cores_and_gpus_and_say_when_they_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(placement.LOCK_DIR_ENV, str(tmp_path))
    monkeypatch.setattr(placement, "allowed_cores", lambda: [0, 1, 2, 3])
    monkeypatch.setattr(placement, "_pin_threads", lambda cores: None)
    gpus = ["0", "1"]
    with (
        placement.job_placement("joblib", 2, 1, gpus) as a,
        placement.job_placement("joblib", 2, 1, gpus) as b,
    ):
        assert set(a.cores).isdisjoint(b.cores) and len(a.cores) == len(b.cores) == 2
        assert a.gpus != b.gpus and not (a.shared_cores or b.shared_gpus or b.warning)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == b.gpus[0]
        with placement.job_placement("joblib", 2, 1, gpus) as c:
            assert len(c.cores) == 2 and c.shared_cores == c.cores
            assert c.shared_gpus == c.gpus and "shares cores" in (c.warning or "")
    assert "warning: this timing job shares cores [0, 1] and GPUs ['0']" in capsys.readouterr().err
    # released: the next job gets the first cores again
    with placement.job_placement("joblib", 2, 0, gpus) as d:
        assert d.cores == [0, 1] and d.gpus == []
    with (
        pytest.raises(RuntimeError, match="needs 2 GPU"),
        placement.job_placement("ray", 1, 2, ["0"]),
    ):
        pass


def test_claims_work_across_users_of_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The lock folder and files are shared by every user's jobs: the folder is writable by
    # all (sticky, like /tmp), a lock file is readable by all and opened read-only (flock
    # needs no more). Another user's lock file, which we may read and not write, is claimed:
    # opening it for writing raised PermissionError and crashed the job.
    folder = tmp_path / "locks"
    monkeypatch.setenv(placement.LOCK_DIR_ENV, str(folder))
    monkeypatch.setattr(placement, "allowed_cores", lambda: [0, 1])
    monkeypatch.setattr(placement, "_pin_threads", lambda cores: None)
    with placement.job_placement("joblib", 1, 0, []) as first:
        assert first.cores == [0]
    assert folder.stat().st_mode & 0o7777 == 0o1777
    assert (folder / "cpu-0.lock").stat().st_mode & 0o777 == 0o644
    real_open, real_path_open = os.open, Path.open

    def theirs(path: Any, flags: int, *args: Any) -> int:  # as another user's 0644 file
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, flags, *args)

    def theirs_too(path: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
        if set(mode) & set("wax+"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_path_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(placement.os, "open", theirs)
    monkeypatch.setattr(Path, "open", theirs_too)
    with (
        placement.job_placement("joblib", 1, 0, []) as a,
        placement.job_placement("joblib", 1, 0, []) as b,
    ):
        assert (a.cores, b.cores) == ([0], [1]) and not (a.shared_cores or b.shared_cores)


def test_a_job_is_pinned_to_its_cores_and_let_go_after(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(placement.LOCK_DIR_ENV, str(tmp_path))
    before = os.sched_getaffinity(0)
    with placement.job_placement("submitit_local", 1, 0, []) as where:
        assert os.sched_getaffinity(0) == set(where.cores) and len(where.cores) == 1
    assert os.sched_getaffinity(0) == before


def test_cores_per_job_follow_the_launchers_own_settings() -> None:
    def cfg(target: str, **keys: Any) -> dict[str, Any]:
        return {"_target_": f"hydra_plugins.x.{target}", **keys}

    assert launching.cores_per_job(cfg("JoblibLauncher", n_jobs=2), 16, 10) == 8
    assert launching.cores_per_job(cfg("JoblibLauncher", n_jobs=4), 16, 2) == 8  # 2 jobs at once
    assert launching.cores_per_job(cfg("RayLauncher", ray={"remote": {"num_cpus": 3}}), 16, 9) == 3
    assert launching.cores_per_job(cfg("RayLauncher", ray={"remote": {}}), 16, 9) == 1
    assert launching.cores_per_job(cfg("SlurmLauncher", cpus_per_task=6), 64, 2) == 6
    assert launching.cores_per_job(cfg("SlurmLauncher", cpus_per_task=None), 8, 4) == 8
    assert launching.cores_per_job(cfg("LocalLauncher", cpus_per_task=None), 16, 4) == 4
    tp2 = {"engine": {"backend": "builtin", "device": "auto", "tensor_parallel_size": 2}}
    assert launching.gpus_per_job(tp2, ["0", "1"]) == 2
    assert launching.gpus_per_job(tp2, []) == 0  # auto on a host without GPUs: the CPU
    assert launching.gpus_per_job({"engine": {"backend": "openai"}}, ["0"]) == 0


def test_ray_connects_to_an_existing_cluster_without_sizing_its_object_store(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Hydra's Ray launcher gives ray.init a 75 MB object store, which ray.init refuses with an
    # address ("When connecting to an existing cluster, object_store_memory must not be
    # provided"): the sweeper leaves it unset there, so the launcher's setdefault keeps None
    from hydra_plugins.hydra_ray_launcher.ray_launcher import RayLauncher

    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    cluster = RayLauncher(ray=OmegaConf.create({"init": {"address": "ray://head:10001"}}))
    launching.ray_joins_its_cluster(cluster)
    assert cluster.ray_cfg.init.setdefault("object_store_memory", 78643200) is None
    local = RayLauncher(ray=OmegaConf.create({"init": {"address": None}}))
    launching.ray_joins_its_cluster(local)  # a local cluster keeps the launcher's size
    assert local.ray_cfg.init.setdefault("object_store_memory", 78643200) == 78643200
    sized = RayLauncher(ray=OmegaConf.create({"init": {"address": "auto"}}))
    sized.ray_cfg.init.object_store_memory = 10**9
    launching.ray_joins_its_cluster(sized)  # given explicitly: kept
    assert sized.ray_cfg.init.object_store_memory == 10**9
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")  # ray.init reads the address there
    by_env = RayLauncher(ray=OmegaConf.create({"init": {"address": None}}))
    launching.ray_joins_its_cluster(by_env)
    assert by_env.ray_cfg.init.object_store_memory is None


@pytest.mark.slow
def test_a_sweep_joins_a_running_ray_cluster_with_token_authentication(tmp_path: Path) -> None:
    # a cluster started apart (`ray start --head`, with token authentication, the default of
    # `ray start` since Ray 2.59), joined by address: the jobs run as its tasks
    ray_bin = Path(sys.executable).with_name("ray")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": os.urandom(16).hex()}
    env = {**os.environ, **auth}
    env.pop("RAY_ADDRESS", None)
    temp_dir = Path("/tmp") / f"inferlab-ray-{port}"  # Ray's socket paths must stay short
    subprocess.run(
        [ray_bin, "start", "--head", f"--port={port}", "--num-cpus=2", f"--temp-dir={temp_dir}",
         "--include-dashboard=false", "--disable-usage-stats"],
        env=env, check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    try:
        done = subprocess.run(
            [sys.executable, "-m", "harness.cli", "run", "-m", *TINY_JOB,
             "engine.kv_cache=contiguous,paged", "hydra/launcher=ray",
             f"hydra.launcher.ray.init.address=127.0.0.1:{port}", f"hydra.sweep.dir={tmp_path}"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        rows = pd.read_csv(tmp_path / "sweep.csv")
        assert list(rows["status"]) == ["complete", "complete"]
        for job in ("0", "1"):
            placed = json.loads((tmp_path / job / "provenance.json").read_text())["placement"]
            assert placed["launcher"] == "ray" and placed["node"] == socket.gethostname()
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)
        subprocess.run(["rm", "-rf", str(temp_dir)], check=False)


def test_a_cluster_ray_cannot_join_names_token_authentication(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    refused = "ConnectionError: Failed to connect to Ray cluster at 10.0.0.1:6379"
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert "set RAY_AUTH_MODE=token here too" in launching.ray_connection_hint(refused)
    assert launching.ray_connection_hint("ValueError: n_jobs == 0") == ""
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # set already: not the cause
    assert launching.ray_connection_hint(refused) == ""


def test_gate_ab_rounds_on_a_ray_cluster_leave_the_object_store_to_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address = ["hydra.launcher.ray.init.address=ray://head:10001"]
    null = ["+hydra.launcher.ray.init.object_store_memory=null"]
    assert launching.ray_cluster_overrides("ray", address) == null
    assert launching.ray_cluster_overrides("ray", ["+hydra.launcher.ray.init.num_cpus=2"]) == []
    sized = [*address, "+hydra.launcher.ray.init.object_store_memory=1000000000"]
    assert launching.ray_cluster_overrides("ray", sized) == []
    assert launching.ray_cluster_overrides("joblib", address) == []
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.1:6379")
    assert launching.ray_cluster_overrides("ray", []) == null


def test_a_missing_launcher_extra_is_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = launching.importlib.util.find_spec
    monkeypatch.setattr(
        launching.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "hydra_plugins.hydra_ray_launcher" else real(name, *a),
    )
    message = launching.missing_launcher(["model=tiny", "hydra/launcher=ray"])
    assert message is not None and "\n" not in message
    assert "pip install -e '.[ray]'" in message
    assert launching.missing_launcher(["hydra/launcher=joblib"]) is None
    assert launching.missing_launcher(["hydra/launcher=basic"]) is None
    from harness import cli

    with pytest.raises(SystemExit) as stop:
        cli.main(["run", "model=tiny", "hydra/launcher=ray"])
    assert stop.value.code == 2
    assert capsys.readouterr().err == f"error: {message}\n"
