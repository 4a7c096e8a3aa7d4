"""Every shipped config composes and validates: presets, variants, models, workloads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import configs
from engines.builtin.config import EngineConfig
from engines.hf.config import HFConfig
from engines.registry import BACKENDS, build_backend
from harness.running.experiment import make_workload
from harness.running.window import WindowConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"


def composed(*overrides: str) -> dict:
    cfg = configs.compose(overrides)
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


# ---- one typed config: the options dataclasses are the engine groups' schemas ----------------


def command_line_value(value: object) -> str:
    """A value as Hydra's override grammar reads it back (JSON's null/true/[..] and {} fit)."""
    return json.dumps(value)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_option_field_is_overridable_and_defaults_live_once(backend: str) -> None:
    """Each field of the backend's options dataclass (but those the model group fills) is a
    key of `engine=<backend>`, with the dataclass default, and can be set on the command line;
    the YAML file sets no option (presets live in variant/ and experiment/)."""
    entry = BACKENDS[backend]
    defaults = {
        f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(entry.config)
        if f.name not in entry.model_fields
    }
    engine = composed(f"engine={backend}")["engine"]
    assert engine == {"backend": backend, **defaults}
    overrides = [f"engine.{name}={command_line_value(value)}" for name, value in defaults.items()]
    assert composed(f"engine={backend}", *overrides)["engine"] == engine
    shipped = yaml.safe_load((CONFIGS / "engine" / f"{backend}.yaml").read_text())
    assert set(shipped) == {"defaults"}, f"engine/{backend}.yaml sets options: {set(shipped)}"


def test_a_key_without_a_field_and_a_value_of_the_wrong_type_name_the_key() -> None:
    for override, key in [
        ("engine.no_such_option=1", "no_such_option"),
        ("engine.max_num_seqs=many", "engine.max_num_seqs"),
        ("engine.native_kernels=maybe", "engine.native_kernels"),
    ]:
        with pytest.raises(Exception, match=key):
            composed(override)
    assert composed("engine.native_kernels=false")["engine"]["native_kernels"] is False
    added = composed("+engine.no_such_option=1")  # '+' adds it; the backend refuses it
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['no_such_option'\]"):
        build_backend(added["engine"], added["model"])


def test_arrival_is_set_whole_or_key_by_key_as_the_docs_write_it() -> None:
    """`workload.arrival={...}` needed `++` (a mapping merged into {process: offline} may not
    add keys); every process's key is now in the YAML, null where unused."""
    whole = composed("workload.arrival={process: poisson, rate: 8}")["workload"]
    assert make_workload(whole).arrival == {**whole["arrival"], "process": "poisson", "rate": 8}
    assert make_workload(whole).concurrency is None
    keys = composed("workload.arrival.process=closed", "workload.arrival.concurrency=4")
    assert make_workload(keys["workload"]).concurrency == 4
    leftover = composed(
        "workload.arrival={process: gamma, rate: 8, burstiness: 0.5}",
        "workload.arrival={process: poisson, rate: 2}",
    )["workload"]
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['burstiness'\] for process poisson"):
        make_workload(leftover)
