"""Cancellation and the run's bounds end to end on the built-in engine (model=tiny): the
cancelled rows equal the workload's plan, the engine frees each cancelled request's KV blocks
before its next step (a counter, and the pool itself), and summary.json says how a run ended
(`stopped_by`, `saturated`, `saturation`, `num_unsent`); a run stopped by max_errors fails with
the bound named; bad bounds are named."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from engines.base import StepRecord
from engines.builtin.backend import BuiltinBackend
from engines.builtin.config import EngineConfig
from engines.builtin.kv_cache import PagedKVCacheManager
from engines.sampling_params import SamplingParams
from harness.running.experiment import run_experiment
from harness.running.run_config import run_config


def config(workload: dict[str, Any], run: dict[str, Any], **engine: Any) -> dict[str, Any]:
    return {
        "engine": {"kv_cache": "paged", **engine},
        "model": {"name": "tiny"},
        "workload": {"type": "synthetic", "input_len": 16, **workload},
        "run": {"warmup_requests": 0, "monitor": {"enabled": False}, "progress": False, **run},
    }


def requests_of(run_dir: Path) -> pd.DataFrame:
    return pd.read_parquet(run_dir / "requests.parquet")


def test_cancelled_rows_equal_the_plan_and_the_engine_frees_their_kv_at_once(
    tmp_path: Path,
) -> None:
    """8 requests of 1500 tokens (about a second each at once on tiny on a quiet machine, 400
    took a quarter of one), half cancelled 0.3 s after they were sent."""
    workload = {
        "num_requests": 8,
        "output_len": 1500,
        "cancel_fraction": 0.5,
        "cancel_after_s": 0.3,
        "seed": 3,
    }
    summary = run_experiment(config(workload, {}), tmp_path, progress=False)
    assert summary["status"] == "complete", summary["error"]
    assert summary["workload"]["cancel_planned"] == 4
    requests = requests_of(tmp_path)
    cancelled = requests[requests["status"] == "cancelled"]
    assert len(cancelled) == 4 and (requests["status"] == "ok").sum() == 4
    assert set(cancelled["error"]) == {"cancelled by the workload 0.3 s after it was sent"}
    assert ((cancelled["output_tokens"] > 0) & (cancelled["output_tokens"] < 1500)).all()
    tokens = pd.read_parquet(tmp_path / "tokens.parquet")
    kept = tokens[tokens["request_id"].isin(cancelled["request_id"])]
    assert len(kept) == cancelled["output_tokens"].sum()  # their tokens so far are kept
    engine = summary["engine"]
    assert engine["aborted_sequences"] == 4 and engine["abort_kv_blocks_freed"] > 0
    assert engine["abort_kv_free_steps_max"] == 0  # every block back before the next step
    assert (summary["stopped_by"], summary["saturated"], summary["saturation"]) == (
        None,
        False,
        None,
    )
    assert summary["num_unsent"] == 0


def test_an_abort_mid_decode_returns_every_block_before_the_next_step() -> None:
    backend = BuiltinBackend(EngineConfig(model="tiny", kv_cache="paged"))
    backend.load()
    engine = backend.engine
    assert engine is not None and isinstance(engine.kv, PagedKVCacheManager)
    pool = engine.kv.pool
    free_before = pool.num_free
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    engine.add_request("kept", list(range(10, 50)), params)
    engine.add_request("cut", list(range(60, 100)), params)
    for _ in range(5):  # the prefill, then decodes
        engine.step()
    held = len(engine.kv.block_tables[engine.sequences["cut"].seq_id])
    in_use = free_before - pool.num_free
    engine.abort_request("cut")
    assert free_before - pool.num_free == in_use - held  # back in the pool already
    records: list[StepRecord] = []
    engine.step_observers.append(records.append)
    engine.step()
    assert records[0].num_running == 1 and records[0].num_seqs == 1
    facts = engine.describe()
    assert (facts["aborted_sequences"], facts["abort_kv_blocks_freed"]) == (1, held)
    assert facts["abort_kv_free_steps_max"] == 0
    backend.close()


def test_max_duration_stops_the_run_keeps_it_complete_and_counts_the_unsent(
    tmp_path: Path,
) -> None:
    workload = {
        "num_requests": 200,
        "output_len": 8,
        "arrival": {"process": "poisson", "rate": 40.0},
    }
    run = {"max_duration_s": 1.0, "max_duration_grace_s": 0.5}
    summary = run_experiment(config(workload, run), tmp_path, progress=False)
    assert summary["status"] == "complete" and summary["stopped_by"] == "max_duration_s"
    assert summary["stop_reason"] == "run.max_duration_s=1 reached"
    requests = requests_of(tmp_path)
    assert 0 < len(requests) < 200 and len(requests) + summary["num_unsent"] == 200
    assert requests["sent_s"].max() <= 1.0 + 0.05  # nothing sent after the bound
    assert summary["saturated"] is False


def test_max_errors_fails_the_run_with_the_bound_named(tmp_path: Path) -> None:
    """A stop token outside the vocabulary: the engine refuses every request."""
    workload = {
        "num_requests": 100,
        "output_len": 4,
        "arrival": {"process": "poisson", "rate": 50.0},
        "sampling": {"stop_token_ids": [10**9]},
    }
    summary = run_experiment(config(workload, {"max_errors": 5}), tmp_path, progress=False)
    assert summary["status"] == "failed" and summary["stopped_by"] == "max_errors"
    assert summary["error"].startswith("run.max_errors=5 reached: 5 requests failed; the first, ")
    assert "stop_token_ids" in summary["error"]  # why they failed, not only how many
    requests = requests_of(tmp_path)
    assert (requests["status"] == "failed").sum() >= 5
    assert len(requests) + summary["num_unsent"] == 100 and summary["num_unsent"] > 50


def test_a_tiny_server_far_past_saturation_stops_early_and_is_flagged(tmp_path: Path) -> None:
    """model=tiny with 16 sequences at a time finishes about 100 requests/s of 64 tokens here;
    offered 400/s for 15 s it saturates at once; with a short window the run stops within
    seconds and says why."""
    workload = {
        "num_requests": 6000,
        "output_len": 64,
        "arrival": {"process": "poisson", "rate": 400.0},
    }
    run = {
        "stop_on_saturation": True,
        "max_duration_grace_s": 1.0,
        "saturation": {"window_s": 4.0, "min_duration_s": 2.0},
    }
    summary = run_experiment(config(workload, run, max_num_seqs=16), tmp_path, progress=False)
    assert summary["status"] == "complete", summary["error"]
    assert summary["stopped_by"] == "saturation" and summary["saturated"] is True
    evidence = summary["saturation"]
    assert evidence["detected_at_s"] <= 2.0 + 4.0 + 2.0
    assert evidence["in_flight"]["t"] >= 4 and evidence["ttft_s"]["t"] >= 4
    requests = requests_of(tmp_path)
    assert len(requests) + summary["num_unsent"] == 6000 and summary["num_unsent"] > 2000
    assert set(requests["status"]) <= {"ok", "cancelled"}
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["saturation"]["detected_at_s"] == evidence["detected_at_s"]


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"max_errors": 1.5}, r"^run\.max_errors: 1\.5 is invalid; allowed: null, an integer"),
        ({"max_duration_s": -2}, r"^run\.max_duration_s: -2 is invalid; allowed: null or a"),
        ({"stop_on_saturation": "yes"}, r"^run\.stop_on_saturation: 'yes' is invalid"),
        (
            {"max_duration_s": 5, "num_clients": 2},
            r"^run\.num_clients: 2 is invalid with run\.max_duration_s",
        ),
    ],
)
def test_bad_bounds_are_named(run: dict[str, Any], message: str) -> None:
    engine = {"backend": "openai"} if "num_clients" in run else {}
    with pytest.raises(ValueError, match=message):
        run_config({"run": run, "engine": engine})
