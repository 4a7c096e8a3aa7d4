"""`inferlab export RUN --format vllm`: vLLM's key set, and every value computed vLLM's way
from a real tiny run's requests and tokens tables (send-based TTFT, per-chunk ITL, client
queue time, vLLM's duration), failures as vLLM records them, the options, sweeps, bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from harness import cli
from harness.run_folder import load_table, read_summary, write_parquet_atomic

# vllm/benchmarks/serve.py: main_async's header keys, benchmark()'s result, then
# process_one_metric's statistics for each --percentile-metrics name (--save-detailed)
VLLM_KEYS = [
    "date",
    "endpoint_type",
    "backend",
    "label",
    "model_id",
    "tokenizer_id",
    "num_prompts",
    "request_rate",
    "burstiness",
    "max_concurrency",
    "duration",
    "completed",
    "failed",
    "total_input_tokens",
    "total_output_tokens",
    "request_throughput",
    "request_goodput",
    "output_throughput",
    "total_token_throughput",
    "input_lens",
    "output_lens",
    "ttfts",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "generated_texts",
    "errors",
    "max_output_tokens_per_s",
    "max_concurrent_requests",
    "rtfx",
] + [
    f"{stat}_{metric}_ms"
    for metric in ("ttft", "tpot", "itl", "e2el")
    for stat in ("mean", "median", "std", "p99")
]


def export(run: Path, out: Path, *options: str) -> dict:
    assert cli.main(["export", str(run), "--out", str(out), *options]) == 0
    return json.loads(out.read_text())


def ordered_requests(run: Path) -> pd.DataFrame:
    return load_table(run, "requests").sort_values(["arrival_s", "request_id"], kind="stable")


def test_key_set_and_traffic_settings(lab_run: Path, tmp_path: Path) -> None:
    result = export(lab_run, tmp_path / "vllm.json")
    # vLLM's keys, in vLLM's order; the lab adds its run folder as --metadata would
    assert [k for k in result if k != "inferlab_run"] == VLLM_KEYS
    assert result["inferlab_run"] == str(lab_run)
    assert (result["request_rate"], result["burstiness"], result["max_concurrency"]) == (
        400.0,
        1.0,
        3,
    )
    assert (result["backend"], result["model_id"], result["num_prompts"]) == (
        "inferlab-builtin",
        "tiny",
        8,
    )
    assert result["generated_texts"] == [""] * 8 and result["errors"] == [""] * 8
    assert result["request_goodput"] is None  # no SLO set, as vLLM without --goodput


def test_values_are_vllms_definitions(lab_run: Path, tmp_path: Path) -> None:
    result = export(lab_run, tmp_path / "vllm.json")
    requests = ordered_requests(lab_run)
    tokens = load_table(lab_run, "tokens")
    sent, arrival = requests["sent_s"].to_numpy(), requests["arrival_s"].to_numpy()
    ttfts = requests["first_token_s"].to_numpy() - sent
    latencies = requests["last_token_s"].to_numpy() - sent
    np.testing.assert_allclose(result["start_times"], sent)
    np.testing.assert_allclose(result["queue_times"], sent - arrival)
    assert max(result["queue_times"]) > 0  # the cap of 3 made some requests wait
    np.testing.assert_allclose(result["ttfts"], ttfts)
    np.testing.assert_allclose(result["latencies"], latencies)
    assert result["input_lens"] == requests["prompt_tokens"].astype(int).tolist()
    assert result["output_lens"] == requests["output_tokens"].astype(int).tolist()
    for request_id, gaps in zip(requests["request_id"], result["itls"], strict=True):
        times = tokens[tokens["request_id"] == request_id].sort_values("index")["time_s"]
        np.testing.assert_allclose(gaps, np.diff(np.unique(times.to_numpy())))

    n = requests["output_tokens"].to_numpy()
    tpots = ((latencies - ttfts) / (n - 1))[n > 1]
    pooled = [g for gaps in result["itls"] for g in gaps]
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", pooled), ("e2el", latencies)):
        assert result[f"mean_{name}_ms"] == pytest.approx(np.mean(values) * 1000)
        assert result[f"median_{name}_ms"] == pytest.approx(np.median(values) * 1000)
        assert result[f"std_{name}_ms"] == pytest.approx(np.std(values) * 1000)
        assert result[f"p99_{name}_ms"] == pytest.approx(np.percentile(values, 99) * 1000)
    # vLLM's duration: from the benchmark's start (the run's t0) to the last request's end
    duration = float(requests["finished_s"].max())
    assert result["duration"] == pytest.approx(duration)
    assert result["completed"] == 8 and result["failed"] == 0
    summary = read_summary(lab_run)
    assert summary is not None
    whole_run = summary["metrics_whole_run"]
    assert result["total_output_tokens"] == whole_run["output_tokens_total"]
    assert result["total_input_tokens"] == whole_run["input_tokens_total"]
    assert result["request_throughput"] == pytest.approx(8 / duration)
    assert result["output_throughput"] == pytest.approx(whole_run["output_tokens_total"] / duration)
    # the lab's TPOT is vLLM's TPOT: the same span and divisor
    assert result["mean_tpot_ms"] == pytest.approx(whole_run["tpot_mean_s"] * 1000)
    # never more in flight than the run's cap, as vLLM counts them (send -> last chunk)
    assert 1 <= result["max_concurrent_requests"] <= 3
    assert result["max_output_tokens_per_s"] >= 1


def test_a_failed_request_as_vllm_records_it(lab_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(lab_run, run)
    requests = load_table(run, "requests")
    failing = requests["request_id"].iloc[2]
    requests.loc[2, ["status", "error"]] = ["failed", "engine: out of KV blocks"]
    write_parquet_atomic(requests, run / "requests.parquet")
    result = export(run, tmp_path / "vllm.json")
    k = ordered_requests(run)["request_id"].tolist().index(failing)
    assert (result["completed"], result["failed"]) == (7, 1)
    assert result["errors"][k] == "engine: out of KV blocks"
    assert (result["ttfts"][k], result["latencies"][k], result["itls"][k]) == (0.0, 0.0, [])
    assert result["output_lens"][k] == 0  # vLLM counts no output for a failed request
    assert result["input_lens"][k] == requests.loc[2, "prompt_tokens"]  # but knows its prompt
    ok = requests[requests["status"] == "ok"]
    assert result["total_output_tokens"] == ok["output_tokens"].sum()
    assert result["total_input_tokens"] == ok["prompt_tokens"].sum()


def test_options_summary_only_and_percentiles(lab_run: Path, tmp_path: Path) -> None:
    short = export(lab_run, tmp_path / "a.json", "--summary-only")
    # vLLM without --save-detailed deletes these lists, and keeps latencies and queue times
    for key in ("input_lens", "output_lens", "start_times", "ttfts", "itls", "errors"):
        assert key not in short
    assert len(short["latencies"]) == len(short["queue_times"]) == 8
    chosen = export(
        lab_run,
        tmp_path / "b.json",
        "--percentile-metrics",
        "ttft,client_queue_time",
        "--metric-percentiles",
        "50,99.9",
    )
    stats = sorted(k for k in chosen if k.endswith("_ms"))
    assert stats == sorted(
        f"{s}_{m}_ms"
        for m in ("ttft", "client_queue_time")
        for s in ("mean", "median", "std", "p50", "p99.9")
    )
    queue = [q for q in chosen["queue_times"]]
    assert chosen["p99.9_client_queue_time_ms"] == pytest.approx(np.percentile(queue, 99.9) * 1000)


def test_a_sweep_exports_each_job(lab_run: Path, tmp_path: Path) -> None:
    sweep = tmp_path / "sweep"
    for job in ("0", "1"):
        shutil.copytree(lab_run, sweep / job)
    (sweep / "multirun.yaml").write_text("{}\n")
    out = tmp_path / "out"
    assert cli.main(["export", str(sweep), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["0.json", "1.json"]
    assert json.loads((out / "1.json").read_text())["completed"] == 8
    # without --out, each run's file lands in its own folder
    assert cli.main(["export", str(sweep)]) == 0
    assert json.loads((sweep / "0" / "vllm_bench_serve.json").read_text())["num_prompts"] == 8


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--metric-percentiles", "99,abc"], "--metric-percentiles: '99,abc' is invalid"),
        (["--metric-percentiles", "120"], "allowed: comma-separated numbers from 0 to 100"),
        (["--percentile-metrics", "ttft,latency"], "--percentile-metrics: 'ttft,latency'"),
    ],
)
def test_bad_options(
    lab_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    arguments: list[str],
    message: str,
) -> None:
    assert cli.main(["export", str(lab_run), "--out", str(tmp_path / "x.json"), *arguments]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.count("\n") == 0
    assert not (tmp_path / "x.json").exists()


def test_not_a_run_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    assert cli.main(["export", str(tmp_path / "empty")]) == 2
    assert "no run folder (requests.parquet or requests.jsonl) in it" in capsys.readouterr().err
    assert cli.main(["export", str(tmp_path / "missing")]) == 2
    assert f"{tmp_path / 'missing'}: no such folder" in capsys.readouterr().err


def test_a_sweep_with_a_failed_job_exports_the_others(
    lab_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A job that failed before any request (a sweep keeps it as a row with its error) stopped
    the whole export, so no job of the sweep could be exported."""
    sweep = tmp_path / "sweep"
    failed = sweep / "0"
    failed.mkdir(parents=True)
    (failed / "requests.jsonl").write_text("")
    (failed / "summary.json").write_text(json.dumps({"status": "failed", "error": "boom"}))
    shutil.copytree(lab_run, sweep / "1")
    out = tmp_path / "out"
    assert cli.main(["export", str(sweep), "--out", str(out)]) == 0
    assert [p.name for p in out.iterdir()] == ["1.json"]
    assert f"skipped: {failed}: no measured request" in capsys.readouterr().err
    shutil.copytree(failed, sweep / "1", dirs_exist_ok=True)  # nothing to export: an error
    (sweep / "1" / "requests.parquet").unlink()
    assert cli.main(["export", str(sweep), "--out", str(tmp_path / "none")]) == 2
    assert "none of its 2 runs could be exported" in capsys.readouterr().err


def test_a_run_that_did_not_finish_says_so(
    lab_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An interrupted run's export read as a finished vLLM benchmark of fewer prompts; its
    status now travels in the file (and back through `inferlab import`)."""
    run = tmp_path / "run"
    shutil.copytree(lab_run, run)
    summary = json.loads((run / "summary.json").read_text())
    summary.update(status="incomplete", error="interrupted: SIGINT")
    (run / "summary.json").write_text(json.dumps(summary))
    result = export(run, tmp_path / "vllm.json")
    assert result["inferlab_status"] == "incomplete: interrupted: SIGINT"
    assert "the run did not finish: incomplete: interrupted: SIGINT" in capsys.readouterr().out
    assert cli.main(["import", str(tmp_path / "vllm.json"), "--out", str(tmp_path / "in")]) == 0
    imported = json.loads((tmp_path / "in" / "summary.json").read_text())
    assert imported["status"] == "incomplete"
    assert "inferlab_status" not in imported["unmapped"]
    assert "inferlab_status" not in export(lab_run, tmp_path / "complete.json")


@pytest.mark.parametrize(
    "own_file",
    ["summary.json", "requests.parquet", "tokens.parquet", "provenance.json", "config.yaml"],
)
def test_out_never_writes_over_a_run_folders_own_file(
    lab_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], own_file: str
) -> None:
    """`--out RUN/summary.json` replaced the run's own summary with the export, and the run
    folder could no longer be read; now it is refused, naming --out, and nothing is written."""
    run = tmp_path / "run"
    shutil.copytree(lab_run, run)
    before = (run / own_file).read_bytes()
    assert cli.main(["export", str(run), "--out", str(run / own_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith(f"inferlab export: error: --out: {run / own_file} is a file of the run")
    assert (run / own_file).read_bytes() == before


def test_out_may_write_over_an_earlier_export(lab_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(lab_run, run)
    for out in (run / "vllm_bench_serve.json", run / "exports" / "summary.json"):
        first = export(run, out)
        assert export(run, out, "--summary-only") != first  # written over
    lone = tmp_path / "elsewhere" / "summary.json"  # a folder of no run: an export's name
    export(run, lone)
    export(run, lone)


def test_out_folder_of_a_sweep_never_writes_over_a_runs_file(
    lab_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A sweep exported into one of its own runs, where a job's name is a run file's."""
    sweep = tmp_path / "sweep"
    for job in ("0", "summary"):
        shutil.copytree(lab_run, sweep / job)
    (sweep / "multirun.yaml").write_text("{}\n")
    assert cli.main(["export", str(sweep), "--out", str(sweep / "0")]) == 2
    assert "--out: " in capsys.readouterr().err
    assert not (sweep / "0" / "0.json").exists()  # none written, not the first few


def test_an_empty_out_is_an_error(
    lab_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # where a file named " " was written
    assert cli.main(["export", str(lab_run), "--out", " "]) == 2
    assert "--out: ' ' is invalid; allowed: a file or folder path" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_a_cancelled_request_is_a_failure_that_says_so(lab_run: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(lab_run, run)
    requests = load_table(run, "requests")
    cancelled = requests["request_id"].iloc[1]
    requests.loc[1, ["status", "error"]] = ["cancelled", "run.max_duration_s reached"]
    write_parquet_atomic(requests, run / "requests.parquet")
    result = export(run, tmp_path / "vllm.json")
    k = ordered_requests(run)["request_id"].tolist().index(cancelled)
    assert (result["completed"], result["failed"]) == (7, 1)  # vLLM has no other outcome
    assert result["errors"][k] == "cancelled by the harness: run.max_duration_s reached"
