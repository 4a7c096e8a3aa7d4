"""Every shipped config composes and validates: presets, variants, models, workloads."""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from engines.builtin.config import EngineConfig
from engines.hf.config import HFConfig
from harness.experiment import build_backend, make_workload
from harness.window import WindowConfig

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
TRACES = Path(__file__).resolve().parents[1] / "data" / "traces"


def composed(*overrides: str) -> dict:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONFIGS)):
        cfg = compose(config_name="config", overrides=list(overrides))
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


ENGINE_CONFIGS = {"builtin": EngineConfig, "hf": HFConfig}


def check(cfg: dict) -> None:
    engine = dict(cfg["engine"])
    backend = engine.pop("backend")
    if backend in ENGINE_CONFIGS:  # in-process engines validate their options on their own
        ENGINE_CONFIGS[backend].from_dict({**engine, "model": "tiny"})
    if cfg["model"]["name"] not in ("hf", "tiny-trained"):  # those need a folder / training
        build_backend(cfg["engine"], cfg["model"])  # validates without loading
    make_workload(cfg["workload"])
    WindowConfig.from_dict(cfg["run"]["window"])


@pytest.mark.parametrize("experiment", names("experiment"))
def test_experiment_presets_compose_and_validate(experiment: str) -> None:
    cfg = composed(f"experiment={experiment}")
    assert cfg["run"]["name"] == experiment
    check(cfg)


@pytest.mark.parametrize("variant", names("variant"))
def test_variants_compose_and_validate(variant: str) -> None:
    check(composed(f"variant={variant}"))


@pytest.mark.parametrize("model", [m for m in names("model") if m != "hf"])
def test_model_presets_compose(model: str) -> None:
    check(composed(f"model={model}"))


@pytest.mark.parametrize("workload", names("workload"))
def test_workload_configs_compose_and_validate(workload: str) -> None:
    overrides = [f"workload={workload}"]
    if workload == "trace":
        overrides.append(f"workload.path={TRACES / 'AzureLLMInferenceTrace_conv.csv'}")
    if workload == "prompts":
        overrides.append(f"workload.path={TRACES / 'sharegpt_v3_filtered_500.json'}")
    check(composed(*overrides))
