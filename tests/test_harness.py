"""The harness end to end: `inferlab run` writes a complete, consistent run folder; sweeps write
sweep.csv; bad requests fail alone; bad config keys are named; interrupted runs keep rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from engines.base import GenerationRequest
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.sampling_params import SamplingParams
from harness.driver import Driver
from harness.metrics import REGISTRY, compute_summary
from harness.records import RunRecorder, load_table
from workloads.request import WorkloadRequest

REPO = Path(__file__).resolve().parents[1]
TINY = ["model=tiny", "workload.num_requests=6", "workload.input_len=[8,24]",
        "workload.output_len=[3,12]", "run.warmup_requests=1"]


def inferlab(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "harness.cli", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run_dir = tmp_path_factory.mktemp("run")
    result = inferlab("run", *TINY, f"hydra.run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert "output_tok_per_s" in result.stdout  # the printed table
    return run_dir


def test_run_folder_has_every_file(tiny_run: Path) -> None:
    for name in ("config.yaml", "provenance.json", "summary.json", "requests.parquet",
                 "tokens.parquet", "steps.parquet"):
        assert (tiny_run / name).is_file(), name
    provenance = json.loads((tiny_run / "provenance.json").read_text())
    for key in ("git_commit", "packages", "cpu", "torch_num_threads", "gpu", "hostname_hash",
                "config_hash"):
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
    for col_a, col_b in (("arrival_s", "sent_s"), ("sent_s", "scheduled_s"),
                         ("scheduled_s", "first_token_s"), ("first_token_s", "last_token_s")):
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
    result = inferlab("run", "-m", *TINY, "run.warmup_requests=0",
                      "engine.kv_cache=none,contiguous", "engine.max_num_seqs=0,4",
                      f"hydra.sweep.dir={tmp_path}")
    assert result.returncode == 0, result.stderr
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
    result = inferlab("run", "model=tiny", "engine.no_such_option=1",
                      f"hydra.run.dir={tmp_path}/a")
    assert result.returncode != 0 and "no_such_option" in result.stderr
    result = inferlab("run", "model=tiny", "+engine.no_such_option=1",
                      f"hydra.run.dir={tmp_path}/b")
    assert result.returncode != 0
    assert "unknown option(s) ['no_such_option']" in result.stderr
    result = inferlab("run", "model=no_such_preset", f"hydra.run.dir={tmp_path}/c")
    assert result.returncode != 0 and "no_such_preset" in result.stderr
    result = inferlab("run", "model=tiny", "engine.quantization=int4",
                      f"hydra.run.dir={tmp_path}/d")
    assert result.returncode != 0 and "quantization_group_size=128" in result.stderr


def test_bad_requests_fail_alone(tmp_path: Path) -> None:
    backend = BuiltinBackend(EngineConfig(model="tiny", max_model_len=64))
    backend.load()
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    prompts = {"good-1": [10, 11, 12], "empty": [], "too-long": list(range(10, 110)),
               "good-2": "Shall I compare thee to a summer's day?"}
    workload = [WorkloadRequest(GenerationRequest(rid, prompt, greedy), 0.0)
                for rid, prompt in prompts.items()]
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
        [sys.executable, "-m", "harness.cli", "run", "model=tiny", "run.warmup_requests=0",
         "workload.num_requests=40", "workload.input_len=8", "workload.output_len=[2,400]",
         "engine.max_num_seqs=4", f"hydra.run.dir={run_dir}"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    requests = load_table(run_dir, "requests")
    assert 3 <= len(requests) < 40
    assert summary["metrics"]["num_requests"] == len(requests)
    tokens = load_table(run_dir, "tokens")
    assert len(tokens) == requests["output_tokens"].sum()
