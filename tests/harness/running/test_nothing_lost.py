"""Nothing lost: a run really killed mid-way (SIGINT, SIGKILL) keeps its finished rows and
says what happened; summaries are replaced atomically; failed requests are counted and kept
out of the latency statistics."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

import configs
from harness import run_folder
from harness.measuring.metrics import compute_summary
from harness.run_folder import load_table, write_json_atomic
from harness.running.experiment import RunFolderError, run_experiment

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[3]
# Long enough to be caught mid-way: 40 requests of up to 400 tokens, 8 at a time (the
# seeded lengths let two of the first eight finish within about 50 steps).
LONG_RUN = [
    "model=tiny",
    "run.warmup_requests=0",
    "workload.num_requests=40",
    "workload.input_len=8",
    "workload.output_len=[2,400]",
    "engine.max_num_seqs=8",
]


def start_run(run_dir: Path, *overrides: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "harness.running.app", *overrides, f"hydra.run.dir={run_dir}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # a run that hangs is stopped with SIGABRT by `exit_code`, which then prints every
        # thread's stack: the one failure seen in CI (a SIGINT run not gone in 120 s, never
        # reproduced here in 75 tries, with and without two busy cores) says where it waits
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )


def exit_code(name: str, proc: subprocess.Popen[str], timeout_s: float = 120) -> int:
    """The run's exit code; a run not gone within `timeout_s` fails the test with the stacks
    of its threads."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGABRT)
        _, stderr = proc.communicate(timeout=60)
        pytest.fail(
            f"run {name} still running {timeout_s:.0f} s after its signal:\n{stderr[-8000:]}"
        )


def signal_each_once_it_has_rows(
    procs: dict[str, subprocess.Popen[str]], jsonl: dict[str, Path], rows: int
) -> None:
    """Send each run its signal (its name) as soon as its own JSONL has `rows` rows. All are
    watched at once: waiting for one run after another let a later run finish before it was
    reached, on a busy machine."""
    pending = dict(procs)
    deadline = time.monotonic() + 120
    while pending:
        for name, proc in list(pending.items()):
            path = jsonl[name]
            if path.is_file() and len(path.read_text().splitlines()) >= rows:
                proc.send_signal(getattr(signal, name))
                del pending[name]
            elif proc.poll() is not None:
                pytest.fail(f"run {name} ended before it could be killed: {proc.stderr.read()}")
        if time.monotonic() > deadline:
            for proc in pending.values():
                proc.kill()
            pytest.fail(f"no request rows within 120 s: {sorted(pending)}")
        time.sleep(0.05)


def check_rows_consistent(run_dir: Path) -> pd.DataFrame:
    requests = load_table(run_dir, "requests")
    tokens = load_table(run_dir, "tokens")
    assert 2 <= len(requests) < 40
    assert (requests["status"] == "ok").all()
    # a request's tokens are written before its row, so every finished request has them all
    finished = tokens[tokens["request_id"].isin(set(requests["request_id"]))]
    assert len(finished) == requests["output_tokens"].sum()
    return requests


@pytest.fixture(scope="module")
def killed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, int]]:
    """Three runs started together (to save time), each sent its signal once it has request
    rows: one with SIGINT (Ctrl-C), one with SIGKILL, and a series of repeats=3 with SIGTERM
    once its first repeat has rows. signal name -> (run folder, exit code)."""
    root = tmp_path_factory.mktemp("killed")
    runs = {  # signal -> (run folder, the JSONL file to watch, extra overrides)
        "SIGINT": (root / "SIGINT", root / "SIGINT" / "requests.jsonl", ()),
        "SIGKILL": (root / "SIGKILL", root / "SIGKILL" / "requests.jsonl", ()),
        "SIGTERM": (
            root / "series",
            root / "series" / "repeat-0" / "requests.jsonl",
            ("repeats=3",),
        ),
    }
    procs = {
        name: start_run(run_dir, *LONG_RUN, *extra) for name, (run_dir, _, extra) in runs.items()
    }
    signal_each_once_it_has_rows(procs, {name: run[1] for name, run in runs.items()}, 2)
    return {name: (runs[name][0], exit_code(name, proc)) for name, proc in procs.items()}


def test_sigint_leaves_rows_and_an_incomplete_summary(killed_runs) -> None:
    run_dir, code = killed_runs["SIGINT"]
    assert code == 130
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "incomplete"
    assert summary["error"] == "interrupted: SIGINT"  # Ctrl-C's KeyboardInterrupt is bare
    requests = check_rows_consistent(run_dir)
    assert (run_dir / "requests.parquet").is_file()  # the tables were still finalized
    assert summary["metrics"]["num_requests"] == len(requests)
    assert summary["metrics"]["output_tokens_total"] == requests["output_tokens"].sum()
    assert not list(run_dir.glob(".summary.json.*"))  # no temporary left behind


def test_sigkill_leaves_rows_and_a_summary_still_running(killed_runs) -> None:
    """SIGKILL cannot be caught: the summary still says `running` (documented), and the JSONL
    rows of every request that finished are on disk and readable."""
    run_dir, code = killed_runs["SIGKILL"]
    assert code == -signal.SIGKILL
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "running"
    assert not (run_dir / "requests.parquet").exists()
    requests = check_rows_consistent(run_dir)
    # a line torn by the kill is skipped, the rows before it still read
    with open(run_dir / "requests.jsonl", "a") as f:
        f.write('{"request_id": "torn')
    assert len(load_table(run_dir, "requests")) == len(requests)
    # the killed run's rows still give its metrics
    summary = compute_summary(requests, load_table(run_dir, "tokens"), load_table(run_dir, "steps"))
    assert summary["num_completed"] == len(requests) and summary["ttft_p50_s"] > 0


def test_summary_replacement_is_atomic(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    write_json_atomic(path, {"status": "running"})

    class Unprintable:
        def __str__(self) -> str:
            raise RuntimeError("cannot serialize")

    with pytest.raises(RuntimeError):
        write_json_atomic(path, {"status": "complete", "bad": Unprintable()})
    assert json.loads(path.read_text()) == {"status": "running"}  # the old one, whole
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_files_replaced_whole_keep_the_umasks_mode(tmp_path: Path, umask: int, mode: int) -> None:
    """summary.json, config.yaml, provenance.json, the parquet tables and sweep.csv were
    mode 0600 under any umask (mkstemp's mode survives the rename), while the JSONL beside
    them were 0644: a colleague or a CI artifact server could read a run's rows but not its
    summary. They get the mode a plain open() gives, as the JSONL do."""
    old = os.umask(umask)
    try:
        write_json_atomic(tmp_path / "summary.json", {"status": "complete"})
        run_folder.write_parquet_atomic(pd.DataFrame({"a": [1]}), tmp_path / "requests.parquet")
        run_folder.write_text_atomic(tmp_path / "sweep.csv", "job\n0\n")
        (tmp_path / "requests.jsonl").write_text("{}\n")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == dict.fromkeys(
        ["summary.json", "requests.parquet", "sweep.csv", "requests.jsonl"], mode
    )


def test_failed_requests_are_counted_and_kept_out_of_latencies(tmp_path: Path) -> None:
    """Two-turn sessions on a 64-token context: every second turn (history + new part) no
    longer fits max_model_len and fails; the run completes and counts them. (In this process,
    composed as `inferlab run` composes it: the run's accounting is checked, not the command.)"""
    run_dir = tmp_path / "run"
    config = OmegaConf.to_container(
        configs.compose(
            [
                "model=tiny",
                "engine.max_model_len=64",
                "workload.num_requests=6",
                "workload.input_len=30",
                "workload.output_len=4",
                "workload.sessions={num_turns: 2, think_time_s: 0}",
                "run.warmup_requests=0",
            ]
        ),
        resolve=True,
    )
    assert isinstance(config, dict)
    assert run_experiment(config, run_dir, progress=False)["status"] == "complete"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete"
    metrics = summary["metrics_whole_run"]
    requests = pd.read_parquet(run_dir / "requests.parquet")
    failed = requests[requests["status"] == "failed"]
    ok = requests[requests["status"] == "ok"]
    assert len(failed) == metrics["num_failed"] == 3 and metrics["num_completed"] == 3
    assert failed["error"].str.contains("max_model_len").all()
    assert (failed["output_tokens"] == 0).all()
    # the statistics are those of the completed requests alone
    ttft = (ok["first_token_s"] - ok["arrival_s"]).to_numpy()
    e2e = (ok["last_token_s"] - ok["arrival_s"]).to_numpy()
    assert metrics["ttft_mean_s"] == pytest.approx(ttft.mean(), abs=1e-12)
    assert metrics["e2e_p99_s"] == pytest.approx(np.percentile(e2e, 99), abs=1e-12)
    assert metrics["output_tokens_total"] == ok["output_tokens"].sum()
    duration = ok["last_token_s"].max() - requests["arrival_s"].min()
    assert metrics["req_per_s"] == pytest.approx(3 / duration)


def test_sigterm_stops_a_series_of_repeats(killed_runs) -> None:
    """The series passes the signal on to the running repeat, which keeps its rows; both
    summaries say incomplete and no further repeat starts."""
    run_dir, code = killed_runs["SIGTERM"]
    assert code == 130
    series = json.loads((run_dir / "summary.json").read_text())
    assert series["status"] == "incomplete"
    assert series["repeat_status"] == ["incomplete", "not run", "not run"]
    assert series["error"] == "repeat 0: interrupted: SIGTERM"
    repeat = json.loads((run_dir / "repeat-0" / "summary.json").read_text())
    assert repeat["status"] == "incomplete"
    check_rows_consistent(run_dir / "repeat-0")
    assert not (run_dir / "repeat-1").exists()


TINY_CONFIG = {
    "engine": {"dtype": "float32", "device": "cpu", "max_model_len": 64},
    "model": {"name": "tiny"},
    "workload": {"type": "synthetic", "num_requests": 3, "input_len": 8, "output_len": 3},
    "run": {"warmup_requests": 0, "monitor": {"enabled": False}},
}


def disk_full(path: object) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def test_a_full_disk_while_finalizing_fails_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def to_parquet(self: pd.DataFrame, path: object, *args: object, **kwargs: object) -> None:
        raise disk_full(path)

    monkeypatch.setattr(pd.DataFrame, "to_parquet", to_parquet)
    summary = run_experiment(TINY_CONFIG, tmp_path, progress=False)
    assert summary["status"] == "failed"
    assert summary["error"].startswith(
        "writing the run folder failed: OSError: [Errno 28] No space left on device"
    )
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    # no table was written whole, so none is there: readers take the JSONL rows, all of them
    assert not list(tmp_path.glob("*.parquet")) and not list(tmp_path.glob(".*"))
    assert len(load_table(tmp_path, "requests")) == summary["metrics"]["num_requests"] == 3


def test_a_full_disk_for_the_summary_too_leaves_no_running_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = run_folder.write_json_atomic
    written: list[str] = []

    def write_json_atomic(path: Path, data: dict) -> None:  # only `running` still fits
        if path.name == "summary.json":
            if data.get("status") != "running":
                raise disk_full(path)
            written.append(data["status"])
        real(path, data)

    monkeypatch.setattr(run_folder, "write_json_atomic", write_json_atomic)
    with pytest.raises(RunFolderError) as error:
        run_experiment(TINY_CONFIG, tmp_path, progress=False)
    assert written[-1] == "running"
    assert not (tmp_path / "summary.json").exists()  # nothing says the run is still going
    message = str(error.value)
    assert message == (
        f"{tmp_path}: writing summary.json failed: OSError: [Errno 28] No space "
        f"left on device: '{tmp_path / 'summary.json'}'"
    )
    assert error.value.summary["status"] == "failed"


def test_the_summary_written_on_a_second_try_says_why_it_failed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = run_folder.write_json_atomic
    failures = iter([disk_full("summary.json")])

    def write_json_atomic(path: Path, data: dict) -> None:
        if data.get("status") == "complete" and (exc := next(failures, None)):
            raise exc
        real(path, data)

    monkeypatch.setattr(run_folder, "write_json_atomic", write_json_atomic)
    summary = run_experiment(TINY_CONFIG, tmp_path, progress=False)
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["status"] == summary["status"] == "failed"
    assert on_disk["error"].startswith("writing summary.json failed: OSError: [Errno 28]")
    assert on_disk["metrics"]["num_completed"] == 3  # the run's figures are still there


def test_an_unwritable_run_folder_is_one_line_and_exit_1(tmp_path: Path) -> None:
    # summary.json cannot be created where a folder of that name stands, root or not;
    # run.resume=true: without it the folder is refused before the run, as one that holds a
    # run's file (test_folder_guard.py)
    run_dir = tmp_path / "run"
    (run_dir / "summary.json").mkdir(parents=True)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "run",
            "model=tiny",
            "workload.num_requests=2",
            "run.resume=true",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "summary.json" in errors[0], result.stderr
    assert "the run folder cannot be written" in errors[0]
    assert not (run_dir / "summary.json").is_file()


INJECT_FULL_DISK = """
import errno, os, sys
import pandas as pd
from harness import run_folder

sweep = sys.argv[1]
real_parquet, real_json = pd.DataFrame.to_parquet, run_folder.write_json_atomic


def full(path):
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


def to_parquet(self, path, *args, **kwargs):  # jobs 0 and 1 find the disk full
    if not str(path).startswith(os.path.join(sweep, "2")):
        raise full(path)
    return real_parquet(self, path, *args, **kwargs)


def write_json_atomic(path, data):  # job 1's final summary does not fit either
    if str(path) == os.path.join(sweep, "1", "summary.json") and data["status"] != "running":
        raise full(path)
    return real_json(path, data)


pd.DataFrame.to_parquet = to_parquet
run_folder.write_json_atomic = write_json_atomic
from harness.cli import main

raise SystemExit(main(["run", *sys.argv[2:], f"hydra.sweep.dir={sweep}"]))
"""


def test_a_sweep_job_that_finds_the_disk_full_is_a_failed_row(tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            INJECT_FULL_DISK,
            str(sweep),
            "-m",
            "model=tiny",
            "workload.num_requests=2",
            "workload.input_len=8",
            "workload.output_len=2",
            "run.warmup_requests=0",
            "run.monitor.enabled=false",
            "workload.seed=0,1,2",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # a failing job never stops a sweep; it exits 1 once every job ran
    assert result.returncode == 1, result.stderr
    assert "sweep: 2 of 3 job(s) did not complete" in result.stderr
    assert "Traceback" not in result.stderr
    rows = pd.read_csv(sweep / "sweep.csv").set_index("job")
    assert rows["status"].tolist() == ["failed", "failed", "complete"]
    for job in (0, 1):
        assert "[Errno 28] No space left on device" in rows.loc[job, "error"], job
    assert rows.loc[0, "error"].startswith("writing the run folder failed")
    assert rows.loc[1, "error"].startswith(f"{sweep / '1'}: writing summary.json failed")
    assert not (sweep / "1" / "summary.json").exists()
    assert json.loads((sweep / "0" / "summary.json").read_text())["status"] == "failed"
