"""A finished run leaves nothing of its engine behind in the process (A/B workers and
in-process sweeps run many configurations one after another)."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from engines.builtin.engine import LLMEngine
from harness.running.experiment import run_experiment

pytestmark = pytest.mark.slow  # `make test-fast` leaves it out


def test_the_engine_is_freed_when_the_run_returns(tmp_path: Path) -> None:
    config = {
        "engine": {"dtype": "float32", "device": "cpu", "max_model_len": 64},
        "model": {"name": "tiny"},
        "workload": {"type": "synthetic", "num_requests": 2, "input_len": 8, "output_len": 3},
        "run": {"warmup_requests": 0},
    }
    gc.collect()
    # engines other tests keep alive (a module's server fixture) are not this run's
    earlier = weakref.WeakSet(o for o in gc.get_objects() if isinstance(o, LLMEngine))
    gc.disable()  # only run_experiment's own collection may free cycles here
    try:
        for i in range(2):
            summary = run_experiment(config, tmp_path / f"run-{i}", progress=False)
            assert summary["status"] == "complete", summary["error"]
            left = [o for o in gc.get_objects() if isinstance(o, LLMEngine) and o not in earlier]
            assert not left
    finally:
        gc.enable()
