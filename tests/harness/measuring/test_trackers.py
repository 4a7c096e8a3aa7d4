"""The run's trackers (harness/measuring/trackers.py) chosen by what a backend declares
(`Backend.capabilities`), not by its type: the quality probe reads the built-in engine in a
run, with and without a KV cache to read back; and the run builds its workload once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

import configs
import engines.registry  # noqa: F401  (registers the engine groups' schemas)
import workloads
from engines.base import BackendCapabilities
from engines.builtin.backend import BuiltinBackend
from engines.hf.backend import HFBackend
from engines.openai.backend import OpenAIBackend
from harness.measuring.quality import QualityTracker
from harness.running import experiment
from harness.running.experiment import run_experiment


def test_each_backend_declares_what_the_harness_may_do_with_it() -> None:
    assert BuiltinBackend.capabilities == BackendCapabilities(quality_probe="engine")
    assert HFBackend.capabilities == BackendCapabilities(in_process=True, quality_probe=None)
    assert OpenAIBackend.capabilities.in_process is False
    assert OpenAIBackend.capabilities.quality_probe is None


def test_a_backend_without_a_probe_is_not_probed() -> None:
    tracker = QualityTracker.from_config({"enabled": True})
    assert tracker is not None
    backend: Any = type("NoLogits", (), {"capabilities": BackendCapabilities()})()
    tracker.stop(backend, {})
    assert tracker.results(Path("."), None) == {}
    assert QualityTracker.from_config({"enabled": False}) is None


def _config(*overrides: str) -> dict[str, Any]:
    composed = configs.compose(
        [
            "model=tiny",
            "workload.num_requests=2",
            "workload.input_len=8",
            "workload.output_len=3",
            "run.warmup_requests=0",
            "run.progress=false",
            "run.monitor.enabled=false",
            "engine.device=cpu",
            "run.quality.enabled=true",
            "run.quality.num_prompts=2",
            "run.quality.prompt_len=16",
            *overrides,
        ]
    )
    config = OmegaConf.to_container(composed, resolve=True)
    assert isinstance(config, dict)
    return config


@pytest.mark.parametrize("kv_cache", ["paged", "none"])
def test_the_quality_probe_reads_the_builtin_engine_in_a_run(tmp_path: Path, kv_cache: str) -> None:
    # kv_cache=none keeps no context to read back: the probe prefills whole, as before
    summary = run_experiment(_config(f"engine.kv_cache={kv_cache}"), tmp_path, progress=False)
    assert summary["status"] == "complete", summary.get("error")
    quality = summary["quality"]
    # the same engine against its own float32 weights: the distributions agree
    assert quality["top1_agreement"] in (None, 1.0) and quality["kl_mean"] < 1e-6
    assert quality["quality_positions"] >= 0


def test_the_workload_is_built_once_warm_up_included(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the warm-up's requests are copies of the measured run's first ones, not a second build
    built: list[dict[str, Any]] = []

    def counted(section: dict[str, Any]) -> Any:
        built.append(section)
        return workloads.from_config(section)

    monkeypatch.setattr(experiment, "make_workload", counted)
    config = _config("run.quality.enabled=false", "run.warmup_requests=2")
    summary = run_experiment(config, tmp_path, progress=False)
    assert summary["status"] == "complete", summary.get("error")
    assert len(built) == 1
    assert summary["metrics"]["num_requests"] == 2  # the warm-up is left out of the rows
