"""One real lab run (model=tiny), shared by the interop tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import configs
from harness.running.experiment import run_experiment


def tiny_config(*overrides: str) -> dict[str, Any]:
    """A fast `model=tiny` run: Poisson arrivals under a concurrency cap of 3, so requests
    wait before their send (vLLM's client queue time) and the lab's TTFT differs from vLLM's."""
    cfg = configs.compose(
        [
            "model=tiny",
            "workload.num_requests=8",
            "workload.input_len=[8,24]",
            "workload.output_len=[2,12]",
            "workload.arrival.process=poisson",
            "workload.arrival.rate=400",
            "workload.arrival.max_concurrency=3",
            "run.warmup_requests=1",
            "run.progress=false",
            "run.monitor.enabled=false",
            "engine.kv_cache_memory_bytes=4000000",
            "engine.device=cpu",
            *overrides,
        ]
    )
    config = OmegaConf.to_container(cfg, resolve=True)
    assert isinstance(config, dict)
    return config


@pytest.fixture(scope="session")
def lab_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A complete tiny lab run folder, shared read-only by the interop tests."""
    run_dir = tmp_path_factory.mktemp("interop") / "lab"
    summary = run_experiment(tiny_config(), run_dir, progress=False)
    assert summary["status"] == "complete", summary["error"]
    return run_dir
