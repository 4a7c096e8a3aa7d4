"""A tensor-parallel run through the harness: its communication in steps.parquet and
summary.json, the roofline's link term, and a rank dying mid-run failing the run by name."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pandas as pd
import pytest

from engines.builtin.engine import LLMEngine
from harness.running.experiment import run_experiment

pytestmark = pytest.mark.slow


def tp_run_config(num_requests: int = 4) -> dict:
    return {
        "engine": {
            "backend": "builtin",
            "dtype": "float32",
            "device": "cpu",
            "max_model_len": 128,
            "max_num_seqs": 4,
            "num_threads": 1,
            "tensor_parallel_size": 2,
            "tensor_parallel_timeout_s": 10.0,
        },
        "model": {"name": "tiny"},
        "workload": {
            "type": "synthetic",
            "num_requests": num_requests,
            "input_len": 24,
            "output_len": 8,
        },
        "hardware": "h100",  # a spec with a link: the roofline adds the collectives
        "run": {"warmup_requests": 0},
    }


def test_a_two_rank_run_records_its_communication(tmp_path: Path) -> None:
    summary = run_experiment(tp_run_config(), tmp_path / "run", progress=False)
    assert summary["status"] == "complete", summary["error"]
    assert summary["engine"]["tensor_parallel_size"] == 2
    assert summary["engine"]["tensor_parallel"]["launcher"] == "spawn"
    steps = pd.read_parquet(tmp_path / "run" / "steps.parquet")
    assert (steps["comm_s"] > 0).all() and (steps["broadcast_s"] > 0).all()
    # tiny: 2 layers -> 5 all-reduces of tokens x 64 x 4 bytes, and rank 0's logits slice
    tokens = steps["prefill_tokens"] + steps["decode_tokens"]
    vocab_rows = summary["engine"]["tensor_parallel"]["vocab_per_rank"]
    assert (
        steps["comm_bytes"] == 5 * tokens * 64 * 4 + steps["logits_tokens"] * vocab_rows * 4
    ).all()
    for key in ("comm_share", "comm_share_decode", "comm_share_prefill", "broadcast_share"):
        assert 0 < summary["metrics"][key] < 1, key
    assert (steps["predicted_comm_s"] > 0).all()
    assert (steps["predicted_s"] > steps["predicted_comm_s"]).all()


def test_a_rank_that_dies_mid_run_fails_the_run_by_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_end_step = LLMEngine._end_step

    def kill_after_third_step(self: LLMEngine, start_ns: int) -> int:
        if self.scheduler.step_counter == 3 and self.peers is not None:
            os.kill(self.peers.processes[0].pid, signal.SIGKILL)
        return real_end_step(self, start_ns)

    monkeypatch.setattr(LLMEngine, "_end_step", kill_after_third_step)
    summary = run_experiment(tp_run_config(8), tmp_path / "run", progress=False)
    assert summary["status"] == "failed"
    assert "the backend failed during the run" in summary["error"]
    assert "rank 1 killed by SIGKILL" in summary["error"]
    requests = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert len(requests) == 8  # every request has its row: nothing is lost
    assert (requests["status"] == "failed").any()
