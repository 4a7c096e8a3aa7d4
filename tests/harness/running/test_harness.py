"""The harness end to end: `inferlab run` writes a complete, consistent run folder; sweeps write
sweep.csv; bad requests fail alone; bad config keys are named; interrupted runs keep rows."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import yaml
from omegaconf import OmegaConf

import configs
from configs import ComposeError
from engines.backends import build_backend
from engines.base import ConfigError, GenerationRequest
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.sampling_params import SamplingParams
from harness.measuring.metrics import REGISTRY, compute_summary
from harness.run_folder import RunRecorder, load_table
from harness.running import experiment
from harness.running.driver import Driver
from harness.running.experiment import run_experiment
from harness.running.repeats import validate_repeats
from harness.running.run_config import RunConfig
from harness.running.table import summary_table
from workloads.request import WorkloadRequest

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out

REPO = Path(__file__).resolve().parents[3]
TINY = [
    "model=tiny",
    "workload.num_requests=6",
    "workload.input_len=[8,24]",
    "workload.output_len=[3,12]",
    "run.warmup_requests=1",
]


def inferlab(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harness.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def inferlab_started(*args: str) -> subprocess.Popen[str]:
    """`inferlab ARGS` started, not awaited: independent commands run side by side (each
    process spends seconds importing)."""
    return subprocess.Popen(
        [sys.executable, "-m", "harness.cli", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen[str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    result = inferlab("run", *TINY, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert "output_tok_per_s" in result.stdout  # the printed table
    # without a terminal, the phases as lines on stderr (never a silent cold start)
    assert "loading the builtin backend, model tiny\nloaded in " in result.stderr
    assert "warm-up: 1 requests\nrunning 6 requests\n" in result.stderr, result.stderr
    return run_dir


def test_run_folder_has_every_file(tiny_run: Path) -> None:
    for name in (
        "config.yaml",
        "provenance.json",
        "summary.json",
        "requests.parquet",
        "tokens.parquet",
        "steps.parquet",
        "timeslices.csv",
    ):
        assert (tiny_run / name).is_file(), name
    provenance = json.loads((tiny_run / "provenance.json").read_text())
    for key in (
        "git_commit",
        "packages",
        "cpu",
        "torch_num_threads",
        "gpu",
        "hostname_hash",
        "config_hash",
    ):
        assert key in provenance
    summary = json.loads((tiny_run / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["schema_version"] == 1
    assert set(summary["metrics"]) <= set(REGISTRY)


def test_run_folder_values_are_consistent(tiny_run: Path) -> None:
    summary = json.loads((tiny_run / "summary.json").read_text())["metrics"]
    requests = pd.read_parquet(tiny_run / "requests.parquet")
    tokens = pd.read_parquet(tiny_run / "tokens.parquet")
    steps = pd.read_parquet(tiny_run / "steps.parquet")

    assert len(requests) == summary["num_requests"] == 6
    assert (requests["status"] == "ok").all() and summary["num_failed"] == 0
    assert not requests["request_id"].str.startswith("warmup").any()
    assert len(tokens) == summary["output_tokens_total"] == requests["output_tokens"].sum()
    assert len(steps) == summary["num_steps"]
    # ignore_eos: every request produced exactly what it asked for
    assert (requests["output_tokens"] == requests["output_tokens_requested"]).all()
    assert (requests["prompt_tokens"] == requests["prompt_tokens_requested"]).all()
    # event order per request: arrival <= sent <= scheduled <= first token <= last token
    for col_a, col_b in (
        ("arrival_s", "sent_s"),
        ("sent_s", "scheduled_s"),
        ("scheduled_s", "first_token_s"),
        ("first_token_s", "last_token_s"),
    ):
        assert (requests[col_a] <= requests[col_b]).all(), (col_a, col_b)
    per_request = tokens.groupby("request_id")["time_s"].agg(["min", "max", "count"])
    merged = requests.set_index("request_id").join(per_request)
    assert (merged["min"] == merged["first_token_s"]).all()
    assert (merged["max"] == merged["last_token_s"]).all()
    assert (merged["count"] == merged["output_tokens"]).all()
    # every token's step exists in steps.parquet and ends exactly when the token appeared
    step_end = steps.set_index("step")["end_s"]
    assert (tokens["time_s"].to_numpy() == step_end.loc[tokens["step"]].to_numpy()).all()
    # the steps' token counts add up to the work done
    assert steps["prefill_tokens"].sum() == requests["prompt_tokens"].sum()
    assert steps["decode_tokens"].sum() == (requests["output_tokens"] - 1).sum()
    assert summary["mean_batch_size"] == pytest.approx(steps["num_seqs"].mean())
    assert (steps["kv_bytes_used"] <= steps["kv_bytes_reserved"]).all()
    assert summary["ttft_p50_s"] > 0 and summary["cold_start_s"] > summary["load_s"] > 0


def test_sweep_writes_one_row_per_job_and_records_failures(tmp_path: Path) -> None:
    result = inferlab(
        "run",
        "-m",
        *TINY,
        "run.warmup_requests=0",
        "engine.kv_cache=none,contiguous",
        "engine.max_num_seqs=0,4",
        f"hydra.sweep.dir={tmp_path}",
    )
    assert result.returncode == 1, result.stderr  # every job ran; two failed
    assert "sweep: 2 of 4 job(s) did not complete" in result.stderr
    sweep = pd.read_csv(tmp_path / "sweep.csv")
    assert len(sweep) == 4
    assert {"engine.kv_cache", "engine.max_num_seqs", "status", "ttft_p50_s"} <= set(sweep.columns)
    failed = sweep[sweep["engine.max_num_seqs"] == 0]
    assert (failed["status"] == "failed").all()
    assert failed["error"].str.contains("engine.max_num_seqs").all()
    ok = sweep[sweep["engine.max_num_seqs"] == 4]
    assert (ok["status"] == "complete").all()
    # no cache and KV cache produce the same tokens, so the same counts
    assert ok["output_tokens_total"].nunique() == 1
    none_row = ok[ok["engine.kv_cache"] == "none"].iloc[0]
    kv_row = ok[ok["engine.kv_cache"] == "contiguous"].iloc[0]
    assert none_row["prefill_tokens_total"] > kv_row["prefill_tokens_total"]  # recomputation


def test_unknown_config_keys_are_named(tmp_path: Path) -> None:
    unknown = inferlab_started(
        "run", "model=tiny", "engine.no_such_option=1", f"hydra.run.dir={tmp_path}/a"
    )
    invalid = inferlab_started(
        "run", "model=tiny", "engine.quantization_zero_point=half", f"hydra.run.dir={tmp_path}/d"
    )
    unknown_result, invalid_result = finished(unknown), finished(invalid)
    # the command: a key Hydra refuses stops `inferlab run`, named
    assert unknown_result.returncode != 0 and "no_such_option" in unknown_result.stderr
    # the composition and the engine build `inferlab run` does, in this process (a process
    # each costs ~10 s of imports): a key added with + reaches the engine, which names it
    added = OmegaConf.to_container(
        configs.compose(["model=tiny", "+engine.no_such_option=1"]), resolve=True
    )
    assert isinstance(added, dict)
    with pytest.raises(ConfigError, match=re.escape("unknown option(s) ['no_such_option']")):
        build_backend(added["engine"], added["model"])
    with pytest.raises(ComposeError, match="'model/no_such_preset'"):
        configs.compose(["model=no_such_preset"])
    assert invalid_result.returncode != 0
    message = "engine.quantization_zero_point: 'half' is invalid; allowed: float|int"
    assert message in invalid_result.stderr


def test_bad_requests_fail_alone(tmp_path: Path) -> None:
    backend = BuiltinBackend(EngineConfig(model="tiny", max_model_len=64))
    backend.load()
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = {
        "good-1": [10, 11, 12],
        "empty": [],
        "too-long": list(range(10, 110)),
        "good-2": "Shall I compare thee to a summer's day?",
    }
    workload = [
        WorkloadRequest(GenerationRequest(rid, prompt, greedy), 0.0)
        for rid, prompt in prompts.items()
    ]
    recorder = RunRecorder(tmp_path)
    Driver(backend, recorder.append).run(workload)
    frames = recorder.finalize()
    requests = frames["requests"].set_index("request_id")
    assert requests.loc["good-1", "status"] == "ok" and requests.loc["good-2", "status"] == "ok"
    assert requests.loc["good-1", "output_tokens"] == 4
    assert requests.loc["empty", "status"] == "failed"
    assert "prompt" in requests.loc["empty", "error"]
    assert "max_model_len" in requests.loc["too-long", "error"]
    summary = compute_summary(frames["requests"], frames["tokens"], frames["steps"])
    assert summary["num_failed"] == 2 and summary["num_completed"] == 2
    assert backend.engine is not None and backend.engine.kv.num_live == 0  # nothing leaked


def test_interrupted_run_keeps_finished_rows(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "run",
            "model=tiny",
            "run.warmup_requests=0",
            "workload.num_requests=40",
            "workload.input_len=8",
            "workload.output_len=[2,400]",
            "engine.max_num_seqs=4",
            f"hydra.run.dir={run_dir}",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    requests_jsonl = run_dir / "requests.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if requests_jsonl.is_file() and len(requests_jsonl.read_text().splitlines()) >= 3:
            break
        if proc.poll() is not None:
            pytest.fail(f"run ended before it could be interrupted: {proc.stderr.read()}")
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    assert proc.wait(timeout=60) == 130
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "incomplete"
    assert summary["error"] == "interrupted: SIGTERM"
    requests = load_table(run_dir, "requests")
    assert 3 <= len(requests) < 40
    assert summary["metrics"]["num_requests"] == len(requests)
    tokens = load_table(run_dir, "tokens")
    assert len(tokens) == requests["output_tokens"].sum()


@pytest.mark.parametrize(
    ("run", "named"),
    [
        (
            {"foo": 1},
            "run: unknown key(s) ['foo']; allowed: ['accuracy', 'allow_failed_jobs', 'clients_on', "
            "'max_duration_grace_s', 'max_duration_s', 'max_errors', 'monitor', 'name', "
            "'num_clients', 'percentiles', 'progress', 'quality', 'resume', 'saturation', "
            "'search', 'slo', 'stop_on_saturation', 'timeslice_s', 'warmup_requests', 'window']",
        ),
        ({"warmup_requests": -1}, "run.warmup_requests: -1 is invalid; allowed: an integer >= 0"),
        ({"warmup_requests": 1.5}, "run.warmup_requests: 1.5 is invalid"),
        ({"warmup_requests": "2"}, "run.warmup_requests: '2' is invalid"),
        ({"warmup_requests": True}, "run.warmup_requests: True is invalid"),
        (
            {"window": {"skip": 0.2}},
            "run.window: unknown key(s) ['skip']; allowed: "
            "['min_duration_s', 'min_requests', 'skip_fraction']",
        ),
        (
            {"slo": {"ttft": 1.0}},
            "run.slo: unknown key(s) ['ttft']; allowed: ['e2e_s', 'tpot_s', 'ttft_s']",
        ),
        (
            {"slo": {"ttft_s": -1}},
            "run.slo.ttft_s: -1 is invalid; allowed: null or a number of seconds > 0",
        ),
        # NaN passed `value < 0`, inf every bound
        *(
            ({"slo": {"ttft_s": value}}, f"run.slo.ttft_s: {value!r} is invalid")
            for value in (float("nan"), float("inf"), 10**400)
        ),
        *(
            ({"window": {"min_duration_s": value}}, f"run.window.min_duration_s: {value!r}")
            for value in (float("nan"), float("inf"))
        ),
        ({"quality": {"min_margin": float("nan")}}, "run.quality.min_margin: nan is invalid"),
        ({"monitor": {"interval": 1}}, "run.monitor: unknown key(s) ['interval']"),
        ({"monitor": "off"}, "run.monitor: 'off' is invalid; allowed: a mapping of"),
        ({"quality": {"enable": True}}, "run.quality: unknown key(s) ['enable']"),
        ({"quality": {"num_prompts": 0}}, "run.quality.num_prompts: 0 is invalid"),
        ({"resume": "yes"}, "run.resume: 'yes' is invalid; allowed: true|false"),
        ({"progress": 1}, "run.progress: 1 is invalid; allowed: true|false"),
    ],
)
def test_the_run_section_names_a_bad_key(run: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match="allowed") as error:
        RunConfig.from_dict(run)
    assert named in str(error.value)


def test_the_default_run_section_is_valid() -> None:
    config = yaml.safe_load((REPO / "configs" / "config.yaml").read_text())
    run = RunConfig.from_dict(config["run"])
    assert (run.name, run.warmup_requests, run.resume) == ("default", 2, False)
    assert run.window.skip_fraction == 0.1 and run.slo.ttft_s is None
    assert RunConfig.from_dict(None) == RunConfig()  # a config without `run` gets defaults


@pytest.mark.parametrize("value", [0, -1, 1.5, "2", True])
def test_repeats_must_be_a_positive_integer(value: object) -> None:
    with pytest.raises(ValueError, match=r"repeats: .* is invalid; allowed: an integer >= 1"):
        validate_repeats(value)


def test_a_bad_run_key_exits_2_before_anything_runs(tmp_path: Path) -> None:
    result = inferlab("run", "model=tiny", "+run.foo=1", f"hydra.run.dir={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: run: unknown key(s) ['foo']; allowed: ['accuracy', 'allow_failed_jobs', "
        "'clients_on', 'max_duration_grace_s', 'max_duration_s', 'max_errors', 'monitor', 'name', "
        "'num_clients', 'percentiles', 'progress', 'quality', 'resume', 'saturation', "
        "'search', 'slo', 'stop_on_saturation', 'timeslice_s', 'warmup_requests', 'window']"
    )
    assert not (tmp_path / "summary.json").exists()  # nothing started


def test_a_wrongly_typed_run_value_exits_2_in_one_line(tmp_path: Path) -> None:
    """`inferlab run run.monitor.server_interval_s=abc` printed Hydra's multi-line merge
    report and exited 1; now one line naming the key and the allowed values, exit 2, as a
    bad `run` value, and nothing started."""
    result = inferlab(
        "run", "model=tiny", "run.monitor.server_interval_s=abc", f"hydra.run.dir={tmp_path}"
    )
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "error: run.monitor.server_interval_s: 'abc' is invalid; allowed: a number"
    )
    assert not tmp_path.exists() or not (tmp_path / "summary.json").exists()


def test_inferlab_run_in_process_leaves_hydras_error_setting_as_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # `inferlab run` lets Hydra's errors through (HYDRA_FULL_ERROR=1) to say them in one
    # line; left set in a caller's process, every later `inferlab run` it started took it for
    # the user's and printed Hydra's whole report (exit 1): seen in the test suite
    from harness import cli

    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    monkeypatch.delenv("INFERLAB_USER_HYDRA_FULL_ERROR", raising=False)
    before = dict(os.environ)
    with pytest.raises(SystemExit) as stopped:
        cli.main(["run", "model=tiny", "run.monitor.dcgm_gpu=x", f"hydra.run.dir={tmp_path}"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: run.monitor.dcgm_gpu: 'x' is invalid; allowed: an integer"
    )
    assert dict(os.environ) == before
    # the user's own HYDRA_FULL_ERROR=1 keeps Hydra's full report
    monkeypatch.setenv("HYDRA_FULL_ERROR", "1")
    with pytest.raises(Exception, match=r"Error merging override run\.monitor\.dcgm_gpu=x"):
        cli.main(["run", "model=tiny", "run.monitor.dcgm_gpu=x", f"hydra.run.dir={tmp_path}"])
    assert os.environ["HYDRA_FULL_ERROR"] == "1"


def test_the_table_marks_whole_run_values() -> None:
    metrics = {"num_requests": 8, "output_tok_per_s": 120.0, "req_per_s": 2.5, "ttft_p50_s": 0.25}
    window = {
        "valid": False,
        "reason": "no request completed inside the window",
        "whole_run_metrics": ["duration_s", "output_tok_per_s", "req_per_s"],
    }
    lines = summary_table(metrics, window=window).splitlines()
    assert lines == [
        "  num_requests      8",
        "  output_tok_per_s  120.00 tok/s *",
        "  req_per_s         2.50 req/s *",
        "  ttft_p50_s        250.00 ms",
        "  * over the whole run: the steady-state window is not valid (no request "
        "completed inside the window)",
    ]
    assert "*" not in summary_table(metrics, window={"valid": True, "whole_run_metrics": []})


class Refusing(BuiltinBackend):
    """The tiny engine behind a server that refuses some requests (an HTTP 500 per request)."""

    def __init__(self, refused: str) -> None:
        super().__init__(
            EngineConfig(model="tiny", max_model_len=64, dtype="float32", device="cpu")
        )
        self.refused = refused

    async def generate(self, request: GenerationRequest) -> AsyncIterator[Any]:
        if request.request_id.endswith(self.refused):
            raise RuntimeError(f"HTTP 500 for {request.request_id}: token ids refused")
        async for event in super().generate(request):
            yield event


@pytest.mark.parametrize("refused", ["", "1"])
def test_a_run_whose_every_request_failed_is_failed(
    refused: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(experiment, "build_backend", lambda engine, model: Refusing(refused))
    config = {
        "engine": {},
        "model": {"name": "tiny"},
        "workload": {"type": "synthetic", "num_requests": 4, "input_len": 8, "output_len": 3},
        "run": {"warmup_requests": 0, "monitor": {"enabled": False}},
    }
    summary = run_experiment(config, tmp_path, progress=False)
    metrics = summary["metrics"]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["status"] == summary["status"]
    if refused == "":  # every request refused: the run did not measure anything
        assert summary["status"] == "failed"
        assert summary["error"] == (
            "every measured request failed (4 of 4); the first, "
            "req-0: RuntimeError: HTTP 500 for req-0: token ids refused"
        )
        assert (metrics["num_failed"], metrics["num_completed"]) == (4, 0)
    else:  # one of four refused: a complete run that counts it
        assert summary["status"] == "complete" and summary["error"] is None
        assert (metrics["num_failed"], metrics["num_completed"]) == (1, 3)


def test_a_capped_poisson_run_never_overlaps_requests(tmp_path: Path) -> None:
    """vLLM's `--request-rate R --max-concurrency 1` on the tiny engine: requests arrive far
    faster than they are served, and each is sent only once the one before it finished."""
    config = {
        "engine": {},
        "model": {"name": "tiny"},
        "workload": {
            "type": "synthetic",
            "num_requests": 6,
            "input_len": 8,
            "output_len": 3,
            "arrival": {"process": "poisson", "rate": 1000.0, "max_concurrency": 1},
        },
        "run": {"warmup_requests": 0, "monitor": {"enabled": False}},
    }
    summary = run_experiment(config, tmp_path, progress=False)
    assert summary["status"] == "complete", summary["error"]
    assert summary["closed_loop"] is False and summary["workload"]["max_concurrency"] == 1
    requests = pd.read_parquet(tmp_path / "requests.parquet").sort_values("sent_s")
    assert (requests["status"] == "ok").all() and len(requests) == 6
    sent, finished = requests["sent_s"].to_numpy(), requests["finished_s"].to_numpy()
    assert (sent[1:] >= finished[:-1]).all()  # one in flight at a time
    # the schedule is kept; the wait for the slot is the lateness
    assert (requests["arrival_s"].diff().dropna() >= 0).all()
    assert (requests["sent_s"] - requests["arrival_s"]).max() > 0


def test_an_output_the_run_could_not_make_is_a_warning_on_the_console(tmp_path: Path) -> None:
    """run.timeslice_s=1e-9 gives millions of slices: timeslices.csv is refused after the run,
    which stays complete; the reason was only in summary.json's finalize_errors, the console
    said `complete` and nothing else. Now a warning line names it."""
    result = inferlab(
        "run", "model=tiny", "workload.num_requests=2", "workload.output_len=4",
        "run.warmup_requests=0", "run.progress=false", "run.timeslice_s=1e-9",
        f"hydra.run.dir={tmp_path}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "complete"
    assert not (tmp_path / "timeslices.csv").exists()
    assert f'warning: {tmp_path}: timeslices: ValueError("run.timeslice_s: 1e-09 gives' in (
        result.stderr
    )
