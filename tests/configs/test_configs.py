"""Every shipped config composes and validates: presets, variants, models, workloads."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from unittest import mock

import pytest
import yaml
from omegaconf import OmegaConf

import configs
from engines.backends import BACKENDS, build_backend
from engines.builtin.config import EngineConfig
from engines.hf.config import HFConfig
from engines.llamacpp.config import LlamaCppConfig
from harness import train_tiny_cli
from harness.running.run_config import make_workload
from harness.running.window import WindowConfig
from models import location, train_tiny
from workloads import WORKLOAD_TYPES
from workloads.arrivals import _KEYS as ARRIVAL_KEYS
from workloads.arrivals import Arrival

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"


def composed(*overrides: str) -> dict:
    cfg = configs.compose(overrides)
    return OmegaConf.to_container(cfg, resolve=False)  # type: ignore[return-value]


def names(group: str) -> list[str]:
    return sorted(p.stem for p in (CONFIGS / group).glob("*.yaml"))


ENGINE_CONFIGS = {"builtin": EngineConfig, "hf": HFConfig, "llamacpp": LlamaCppConfig}


def untrained(name: str) -> str:
    return "tiny"


def check(cfg: dict) -> None:
    engine = dict(cfg["engine"])
    backend = engine.pop("backend")
    if backend in ENGINE_CONFIGS:  # in-process engines validate their options on their own
        ENGINE_CONFIGS[backend].from_dict({**engine, "model": "tiny"})
    if cfg["model"]["name"] != "hf":  # it needs a folder
        # validates without loading; trained models stand in as the preset of the same
        # architecture (training one takes minutes)
        with mock.patch.object(location, "trained_model_path", untrained):
            build_backend(cfg["engine"], cfg["model"])
    make_workload(cfg["workload"])
    WindowConfig.from_dict(cfg["run"]["window"])


@pytest.mark.parametrize("experiment", names("experiment"))
def test_experiment_presets_compose_and_validate(experiment: str) -> None:
    cfg = composed(f"experiment={experiment}")
    assert cfg["run"]["name"] == experiment
    check(cfg)


@pytest.mark.parametrize("experiment", names("experiment"))
def test_every_value_an_experiment_sweeps_composes_and_validates(experiment: str) -> None:
    """Each value of each of the experiment's `hydra.sweeper.params`, set alone on top of it,
    gives a valid job (a sweep whose jobs fail at their first check is caught here)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    spec = OmegaConf.load(Path(configs.__file__).parent / "experiment" / f"{experiment}.yaml")
    params = OmegaConf.select(spec, "hydra.sweeper.params") or {}
    parser = OverridesParser.create()
    for key, values in params.items():
        override = parser.parse_override(f"{key}={values}")
        for value in override.sweep_string_iterator():
            check(composed(f"experiment={experiment}", f"{key}={value}"))


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
    """A value as Hydra's override grammar reads it back: JSON's, but a mapping's keys bare."""
    if isinstance(value, dict):
        items = ", ".join(f"{key}: {command_line_value(item)}" for key, item in value.items())
        return "{" + items + "}"
    if isinstance(value, list):
        return "[" + ", ".join(map(command_line_value, value)) + "]"
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
    # a nested section (engine.launch) is a mapping of its own defaults
    defaults = {
        name: dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value
        for name, value in defaults.items()
    }
    engine = composed(f"engine={backend}")["engine"]
    assert engine == {"backend": backend, **defaults}
    overrides = [f"engine.{name}={command_line_value(value)}" for name, value in defaults.items()]
    assert composed(f"engine={backend}", *overrides)["engine"] == engine
    shipped = yaml.safe_load((CONFIGS / "engine" / f"{backend}.yaml").read_text())
    assert set(shipped) == {"defaults"}, f"engine/{backend}.yaml sets options: {set(shipped)}"


def test_a_key_without_a_field_and_a_value_of_the_wrong_type_name_the_key() -> None:
    for override, message in [
        ("engine.no_such_option=1", "engine.no_such_option: unknown key; allowed: attention_"),
        (
            "engine.max_num_seqs=many",
            "engine.max_num_seqs: 'many' is invalid; allowed: an integer$",
        ),
        (
            "engine.native_kernels=maybe",
            "engine.native_kernels: 'maybe' is invalid; allowed: true\\|false$",
        ),
        (
            "engine.num_threads=x",
            "engine.num_threads: 'x' is invalid; allowed: null or an integer$",
        ),
        (
            "workload.num_requests=1.5",
            "workload.num_requests: '1.5' is invalid; allowed: an integer$",
        ),
        ("model=nope", r"In 'config': Could not find 'model/nope' \(allowed 'model': gemma2-9b\|"),
        (
            "engine=nope",
            r"In 'config': .* \(allowed 'engine': builtin\|hf\|llamacpp\|openai\|serve_inferlab\|",
        ),
    ]:  # one line naming the key, not Hydra's "Error merging override ..."
        with pytest.raises(configs.ComposeError, match=f"^{message}") as error:
            composed(override)
        assert "\n" not in str(error.value) and "_schema" not in str(error.value)
    assert composed("engine.native_kernels=false")["engine"]["native_kernels"] is False
    added = composed("+engine.no_such_option=1")  # '+' adds it; the backend refuses it
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['no_such_option'\]"):
        build_backend(added["engine"], added["model"])


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("run.monitor.server_interval_s=abc", "'abc' is invalid; allowed: a number"),
        ("run.monitor.interval_s=1s", "'1s' is invalid; allowed: a number"),
        ("run.monitor.server_metrics=maybe", "'maybe' is invalid; allowed: true|false"),
        ("run.monitor.enabled=maybe", "'maybe' is invalid; allowed: true|false"),
        ("run.monitor.dcgm_gpu=x", "'x' is invalid; allowed: an integer"),
        ("run.monitor.dcgm_url=[1]", "'[1]' is invalid; allowed: null or a string"),
        ("run.window.skip_fraction=x", "'x' is invalid; allowed: a number"),
        ("run.slo.ttft_s=abc", "'abc' is invalid; allowed: null or a number"),
        ("run.quality.num_prompts=many", "'many' is invalid; allowed: an integer"),
        ("run.warmup_requests=1.5", "'1.5' is invalid; allowed: an integer"),
        ("repeats=two", "'two' is invalid; allowed: an integer"),
    ],
)
def test_a_run_value_of_the_wrong_type_is_one_line_naming_the_key(
    override: str, message: str
) -> None:
    """A wrongly typed `run.monitor.*` (or other nested run section) value was Hydra's
    multi-line "Error merging override" report, not the project's one line."""
    key = override.split("=", 1)[0]
    with pytest.raises(configs.ComposeError) as error:
        composed(override)
    assert str(error.value) == f"{key}: {message}"


@pytest.mark.parametrize(
    "override",
    [
        "run.allow_failed_jobs=2",
        "run.allow_failed_jobs=-1",
        "run.resume=yes",
        "run.monitor.enabled=off",
        "engine.native_kernels=1",
        "profile=y",
    ],
)
def test_a_flag_is_true_or_false_not_any_word_or_number(override: str) -> None:
    """OmegaConf reads 2, -1, yes, on, y and 1 as true and no, off, n and 0 as false, so
    `run.allow_failed_jobs=2` let a sweep with a failed job exit 0 and `run.resume=yes`, which
    docs/run_folder.md lists as refused, resumed; a flag is now true or false."""
    key, value = override.split("=", 1)
    with pytest.raises(configs.ComposeError) as error:
        composed(override)
    assert str(error.value) == f"{key}: {value!r} is invalid; allowed: true|false"


def test_hydra_s_own_composition_refuses_a_loose_flag_too() -> None:
    """`inferlab run`, the sweeper and a launcher plugin's workers compose with Hydra's loader,
    not configs.compose: the strict rule is global, not put on around compose."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import ConfigCompositionException

    with (
        initialize_config_dir(version_base="1.3", config_dir=str(configs.CONFIG_DIR)),
        pytest.raises(ConfigCompositionException) as error,
    ):
        compose(config_name="config", overrides=["engine.native_kernels=1"])
    assert "is not a valid bool" in str(error.value.__cause__)


def test_true_and_false_in_any_case_are_still_flags() -> None:
    assert composed("run.resume=True")["run"]["resume"] is True
    assert composed("run.allow_failed_jobs=FALSE")["run"]["allow_failed_jobs"] is False
    assert composed("run.resume='true'")["run"]["resume"] is True  # quoted: a string


def test_arrival_is_set_whole_or_key_by_key_as_the_docs_write_it() -> None:
    """`workload.arrival={...}` needed `++` (a mapping merged into {process: offline} may not
    add keys); every process's key is in the arrival block (Arrival), null where unused."""
    whole = composed("workload.arrival={process: poisson, rate: 8}")["workload"]
    assert make_workload(whole).arrival == {**whole["arrival"], "process": "poisson", "rate": 8}
    assert make_workload(whole).concurrency is None
    keys = composed("workload.arrival.process=closed", "workload.arrival.concurrency=4")
    assert make_workload(keys["workload"]).concurrency == 4
    capped = composed(
        "workload.arrival.process=constant",
        "workload.arrival.rate=8",
        "workload.arrival.max_concurrency=2",
    )
    assert make_workload(capped["workload"]).max_concurrency == 2
    leftover = composed(
        "workload.arrival={process: gamma, rate: 8, burstiness: 0.5}",
        "workload.arrival={process: poisson, rate: 2}",
    )["workload"]
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['burstiness'\] for process poisson"):
        make_workload(leftover)


# ---- the workload dataclasses are the workload groups' schemas ------------------------------

SONNETS = "models/data/sonnets.txt"

#: for every field of every workload type, a value other than its default (valid together)
# the keys every workload type shares (WorkloadBase), at values other than their defaults
SHARED_NON_DEFAULT: dict[str, object] = {
    "temperature": 0.5,
    "sampling": {"top_k": 5},
    "cancel_fraction": 0.25,
    "cancel_after_s": 1.5,
    "structured_fraction": 0.5,
    "structured_kinds": ["regex", "choice"],
    "structured_enforce": False,
    "lora_adapters": ["a", "b"],
    "lora_assignment": "zipf",
    "lora_fraction": 0.5,
    "lora_zipf_exponent": 1.5,
}
NON_DEFAULT: dict[str, dict[str, object]] = {
    "synthetic": {
        "num_requests": 3,
        "input_len": [10, 20],
        "output_len": 7,
        "prompt": "text",
        "corpus": SONNETS,
        "seed": 5,
        "ignore_eos": False,
        "id_prefix": "x",
        **SHARED_NON_DEFAULT,
        "arrival": {"process": "closed", "concurrency": 3},
        "shared_prefix": {"num_groups": 2, "prefix_len": 8},
        "sessions": {"num_turns": 2, "think_time_s": 0.5},
    },
    "prompts": {
        "path": str(TRACES / "mt_bench_questions.jsonl"),
        "format": "mt_bench",
        "num_requests": 3,
        "output_len": 9,
        "use_reference_output": False,
        "shuffle": True,
        "chat": True,
        "think_time_s": 0.5,
        "arrival": {"process": "poisson", "rate": 2.5, "max_concurrency": 2},
        "seed": 5,
        "ignore_eos": False,
        "id_prefix": "p",
        **SHARED_NON_DEFAULT,
    },
    "tool_calls": {
        "path": str(TRACES.parent / "structured" / "tool_conversations.jsonl"),
        "num_requests": 5,
        "shuffle": True,
        "tool_choice": "named",
        "answer_tool_choice": "none",
        "parallel_tool_calls": False,
        "call_output_len": 40,
        "answer_output_len": 20,
        "think_time_s": 0.25,
        "arrival": {"process": "poisson", "rate": 2.5, "max_concurrency": 2},
        "seed": 5,
        "ignore_eos": True,
        "id_prefix": "t",
        **SHARED_NON_DEFAULT,
    },
    "trace": {
        "path": str(TRACES / "AzureLLMInferenceTrace_conv.csv"),
        "format": "csv",
        "columns": {
            "timestamp": "TIMESTAMP",
            "input_len": "ContextTokens",
            "output_len": "GeneratedTokens",
            "timestamp_unit": "datetime",
        },
        "num_requests": 3,
        "time_scale": 2.0,
        "start_s": 1.0,
        "end_s": 100.0,
        "max_concurrency": 2,
        "input_scale": 0.5,
        "output_scale": 0.25,
        "max_input_len": 100,
        "max_output_len": 50,
        "prompt": "text",
        "corpus": SONNETS,
        "seed": 5,
        "ignore_eos": False,
        "id_prefix": "t",
        **SHARED_NON_DEFAULT,
    },
}


def field_defaults(cls: type) -> dict[str, object]:
    return {
        f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)
        for f in dataclasses.fields(cls)
    }


def restates(value: object, default: object) -> list[str]:
    """The keys of a preset's value that only repeat the default (a mapping key by key)."""
    if isinstance(value, dict) and isinstance(default, dict):
        return [
            f"{key}.{inner}" if inner else key
            for key, item in value.items()
            if key in default
            for inner in restates(item, default[key])
        ]
    return [""] if value == default else []


@pytest.mark.parametrize("kind", sorted(WORKLOAD_TYPES))
def test_every_workload_field_is_overridable_and_reaches_the_workload(kind: str) -> None:
    """Each field of the workload type's dataclass is a key of its config group, set on the
    command line to a value other than its default, and that value reaches the validated
    workload (a field added without a value in NON_DEFAULT fails here)."""
    defaults = field_defaults(WORKLOAD_TYPES[kind])
    values = NON_DEFAULT[kind]
    assert set(values) == set(defaults)
    overrides = [f"workload={kind}"]
    for name, value in values.items():
        assert value != defaults[name], name
        # a mapping adds keys to an empty one only with `++` (docs/workloads.md, Hydra note)
        force = "++" if defaults[name] == {} else ""
        overrides.append(f"{force}workload.{name}={command_line_value(value)}")
    workload = make_workload(composed(*overrides)["workload"])
    assert isinstance(workload, WORKLOAD_TYPES[kind])
    for name, value in values.items():
        got = getattr(workload, name)
        if name == "arrival":  # the block: every process's key, null where unused
            got = {key: item for key, item in got.items() if item is not None}
        assert got == value, name


@pytest.mark.parametrize("preset", names("workload"))
def test_workload_presets_extend_a_schema_and_set_only_what_they_choose(preset: str) -> None:
    """A preset names its type's schema and sets only fields of that type, each to a value
    other than the dataclass default (the defaults live once, in the dataclass)."""
    shipped = yaml.safe_load((CONFIGS / "workload" / f"{preset}.yaml").read_text())
    schema = shipped.pop("defaults")[0]
    kind = schema.removesuffix("_schema")
    assert kind in WORKLOAD_TYPES, schema
    defaults = {"type": kind, **field_defaults(WORKLOAD_TYPES[kind])}
    assert set(shipped) <= set(defaults), f"keys without a field: {set(shipped) - set(defaults)}"
    for key, value in shipped.items():
        assert not restates(value, defaults[key]), f"workload/{preset}.yaml restates {key}"
    expected = {
        **defaults,
        **{
            key: {**defaults[key], **value} if isinstance(defaults[key], dict) else value
            for key, value in shipped.items()
        },
    }
    assert composed(f"workload={preset}")["workload"] == expected


def test_the_arrival_block_holds_every_process_key() -> None:
    assert {f.name for f in dataclasses.fields(Arrival)} == {
        key for keys in ARRIVAL_KEYS.values() for key in keys
    }


def test_a_workload_key_without_a_field_and_a_value_of_the_wrong_type_name_the_key() -> None:
    for override, key in [
        ("workload.no_such_key=1", "workload.no_such_key"),
        ("workload.time_scale=2", "workload.time_scale"),  # trace's, not synthetic's
        ("workload.num_requests=many", "workload.num_requests"),
        ("workload.arrival.rate=fast", "workload.arrival.rate"),
        ("workload.arrival.no_such_key=1", "workload.arrival.no_such_key"),
        ("workload.arrival.max_concurrency=x", "workload.arrival.max_concurrency"),
    ]:
        with pytest.raises(configs.ComposeError, match=f"^{key}: "):
            composed(override)
    with pytest.raises(ValueError, match=r"workload\.arrival\.rate: 0\.0 is invalid"):
        make_workload(composed("workload.arrival={process: poisson, rate: 0}")["workload"])


def leaves(value: object, prefix: str = "") -> dict[str, object]:
    if isinstance(value, dict):
        return {
            k: v for key, item in value.items() for k, v in leaves(item, f"{prefix}{key}.").items()
        }
    return {prefix.rstrip("."): value}


def other_value(key: str, default: object) -> object:
    """A valid value that is not the default, for the run and profiling keys."""
    if isinstance(default, bool):
        return not default
    if isinstance(default, int):
        return default + 1
    if isinstance(default, float):
        return default + 0.25
    if key == "run.quality.text":
        return str(CONFIGS / "config.yaml")  # a path: any text file
    if key == "run.quality.prompt_sets":
        return ["data/traces/mt_bench_questions.jsonl"]
    if key == "run.clients_on":
        return "ray"
    if key == "run.percentiles":
        return [50.0, 75.0, 99.9]
    if key == "run.search.slo":
        return ["ttft_p99_s <= 2.0"]
    if key == "run.search.over":
        return "concurrency"
    if key == "run.monitor.dcgm_url":
        return "http://gpu-host:9400/metrics"
    if key == "run.accuracy.task":
        return "inferlab_mc"
    if key == "run.accuracy.limit":
        return 4
    if key == "run.quality.reference_model":
        return "smollm2-135m-f16"
    if default is None:  # the SLO bounds
        return 0.5
    assert isinstance(default, str), key
    return default + "-other"


def test_every_run_and_profiling_key_is_overridable_and_defaults_live_once() -> None:
    """The primary config's own sections are the dataclasses that validate them (RunConfig
    and its window/monitor/quality/slo, ProfileConfig; harness.running.config_schema): every
    field is a key with the dataclass default, a non-default value on the command line reaches
    the validated dataclass, and config.yaml sets only keys that have a field, to values that
    differ from the default (its presets)."""
    from harness.measuring.profiling import ProfileConfig
    from harness.running.config_schema import ExperimentSchema
    from harness.running.run_config import RunConfig

    schema = OmegaConf.to_container(OmegaConf.structured(ExperimentSchema))
    assert isinstance(schema, dict)
    plain = composed()
    expected = leaves({k: schema[k] for k in ("repeats", "profile", "run", "profiling")})
    shipped = yaml.safe_load((CONFIGS / "config.yaml").read_text())
    presets = leaves({k: v for k, v in shipped.items() if k not in ("defaults", "hydra")})
    assert set(presets) <= set(expected), (
        f"config.yaml keys without a field: {set(presets) - set(expected)}"
    )
    restated = [key for key, value in presets.items() if value == expected[key]]
    assert not restated, f"config.yaml restates the dataclass defaults of {restated}"
    composed_leaves = leaves({k: plain[k] for k in ("repeats", "profile", "run", "profiling")})
    assert composed_leaves == {**expected, **presets}
    for key, default in expected.items():
        value = other_value(key, default)
        cfg = composed(f"{key}={command_line_value(value)}")
        section, _, rest = key.partition(".")
        if section == "run":
            validated: object = dataclasses.asdict(RunConfig.from_dict(cfg["run"]))
        elif section == "profiling":
            validated = dataclasses.asdict(ProfileConfig.from_dict(cfg["profiling"]))
        else:
            validated = {rest: cfg[section]} if rest else cfg[section]
        got = leaves(validated).get(rest, validated) if rest else validated
        assert got == value, (key, got, value)


def test_hardware_cpu_options_live_once_in_their_dataclass() -> None:
    """hardware=cpu's probe options are CpuProbeConfig's fields (cpu.yaml sets none), each
    overridable, and what the probe is run with."""
    from harness.measuring.hardware import CpuProbeConfig, validate_config

    defaults = dataclasses.asdict(CpuProbeConfig())
    assert composed("hardware=cpu")["hardware"] == defaults
    shipped = yaml.safe_load((CONFIGS / "hardware" / "cpu.yaml").read_text())
    assert set(shipped) == {"defaults"}, f"hardware/cpu.yaml sets {set(shipped) - {'defaults'}}"
    changed = {"probe_bytes": 1 << 20, "matmul_size": 64, "reprobe": True}
    overrides = [f"hardware.{key}={command_line_value(value)}" for key, value in changed.items()]
    hardware = composed("hardware=cpu", *overrides)["hardware"]
    assert validate_config(hardware) == {**defaults, **changed}
    with pytest.raises(
        configs.ComposeError,
        match=r"^hardware\.matmul_size: 'big' is invalid; allowed: an integer$",
    ):
        composed("hardware=cpu", "hardware.matmul_size=big")


@pytest.mark.parametrize("model", names("model"))
def test_model_presets_set_only_what_they_choose(model: str) -> None:
    """The model group's keys and defaults are ModelChoice's (engines/backends.py); a preset
    names its model (model=hf also requires a path) and restates no default."""
    from engines.backends import ModelChoice

    defaults = dataclasses.asdict(ModelChoice())
    shipped = yaml.safe_load((CONFIGS / "model" / f"{model}.yaml").read_text())
    chosen = {k: v for k, v in shipped.items() if k != "defaults"}
    assert set(chosen) <= set(defaults) and chosen["name"] == model
    assert not [k for k, v in chosen.items() if v == defaults[k]], chosen
    if model != "hf":
        assert composed(f"model={model}")["model"] == {**defaults, **chosen}
    overrides = ["model.path=/some/folder", "model.tokenizer=/some/tokenizer.json"]
    assert composed(f"model={model}", *overrides)["model"]["tokenizer"] == "/some/tokenizer.json"


def test_trained_models_resolve_to_their_folders_as_target_and_as_draft() -> None:
    from engines.backends import _weights_from_model_group

    def folder(name: str) -> str:
        return f"/cache/{name}"

    spec = {"method": "draft_model", "num_speculative_tokens": 2, "model": "tiny-trained"}
    with mock.patch.object(location, "trained_model_path", folder):
        options = _weights_from_model_group(
            {"speculative_config": spec}, {"name": "tiny-trained-large"}
        )
        assert options["model"] == "/cache/tiny-trained-large"
        assert options["speculative_config"] == {**spec, "model": "/cache/tiny-trained"}
        other = _weights_from_model_group(
            {"speculative_config": {**spec, "model": "tiny"}}, {"name": "tiny"}
        )
        assert (other["model"], other["speculative_config"]["model"]) == ("tiny", "tiny")


def test_train_tiny_refuses_a_step_count_below_one() -> None:
    with pytest.raises(ValueError, match=r"train-tiny: steps=0 is invalid; allowed: an integer"):
        train_tiny.train_tiny(None, "/nonexistent", steps=0)
    with pytest.raises(SystemExit):
        train_tiny_cli.main(["--model", "tiny-trained-draft", "--steps", "-5"])


@pytest.mark.parametrize(
    ("override", "key", "value"),
    [
        ("hydra.run.dir=/tmp/résultats/run", "hydra.run.dir", "/tmp/résultats/run"),
        ("model.path=/models/[v2]x", "model.path", "/models/[v2]x"),
    ],
)
def test_a_value_hydra_cannot_parse_names_the_key_and_how_to_quote_it(
    override: str, key: str, value: str
) -> None:
    """A path with a letter outside ASCII was 'LexerNoViableAltException: hydra.run.dir=... ^
    See https://hydra.cc/...', a parser's message naming neither the key nor the fix."""
    with pytest.raises(configs.ComposeError) as error:
        composed(override)
    assert str(error.value) == (
        f"{key}: {value!r} cannot be read unquoted (Hydra's override grammar); quote it: "
        f"'{key}=\"{value}\"'"
    )
    quoted = composed(f'model.path="{value}"')  # the fix it names works
    assert quoted["model"]["path"] == value


def test_a_list_typed_wrong_is_not_told_to_be_quoted() -> None:
    """Quoting '[1,2,4' would turn a list with a missing bracket into a string: the message
    names the brackets instead of suggesting quotes."""
    with pytest.raises(configs.ComposeError) as error:
        composed("engine.cuda_graph_batch_sizes=[1,2,4")
    assert str(error.value) == (
        "engine.cuda_graph_batch_sizes: '[1,2,4' cannot be read (Hydra's override grammar); "
        "allowed: a value, a [list] or a {dict} with matching brackets, or a quoted string"
    )
