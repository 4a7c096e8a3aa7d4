"""engine.launch: the server's command line from its template, params spelled in each server's
style, and the values refused with the key and what is allowed (docs/managed_servers.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

import configs
import engines.backends  # noqa: F401  (the engine groups' schemas)
from engines.openai.config import OpenAIConfig
from engines.openai.launch_config import (
    TEMPLATE_FIELDS,
    LaunchConfig,
    LaunchConfigError,
    flag_arguments,
    server_command,
)
from engines.openai.launched import template_fields

FIELDS = {
    "python": "/py",
    "host": "127.0.0.1",
    "port": 8123,
    "model": "tiny",
    "model_name": "tiny",
    "model_path": None,
    "model_file": None,
    "served_model_name": "tiny",
    "threads": 2,
}


def test_dashes_spell_vllm_flags_and_booleans_both_ways() -> None:
    params = {
        "max_num_seqs": 64,
        "enable_prefix_caching": False,
        "enforce_eager": True,
        "quantization": None,  # left out: the server's default
        "speculative_config": {"method": "ngram", "num_speculative_tokens": 4},
        "cuda_graph_sizes": [1, 2, 4],
    }
    assert flag_arguments(params, "dashes") == [
        "--max-num-seqs",
        "64",
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--speculative-config",
        '{"method": "ngram", "num_speculative_tokens": 4}',
        "--cuda-graph-sizes",
        "1",
        "2",
        "4",
    ]


def test_underscores_keep_names_and_write_booleans_as_values() -> None:
    assert flag_arguments({"n_batch": 64, "offload_kqv": False}, "underscores") == [
        "--n_batch",
        "64",
        "--offload_kqv",
        "false",
    ]


def test_hydra_style_flattens_nested_keys_into_overrides() -> None:
    params = {"engine": {"max_num_seqs": 4, "kv_cache": "paged"}, "variant": "int4_g32"}
    assert flag_arguments({**params, "run": {"x": [1, 2]}}, "hydra") == [
        "engine.max_num_seqs=4",
        "engine.kv_cache=paged",
        "variant=int4_g32",
        "run.x=[1,2]",
    ]


def test_template_fields_fill_arguments_and_an_empty_optional_one_is_left_out() -> None:
    launch = LaunchConfig.from_dict(
        {
            "command": ["{python}", "-m", "srv", "model={model_name}", "model.path={model_path}"],
            "params": {"max_num_seqs": 8},
            "args": ["--verbose"],
        }
    )
    assert server_command(launch, FIELDS) == [
        "/py",
        "-m",
        "srv",
        "model=tiny",
        "--max-num-seqs",
        "8",
        "--verbose",
    ]
    with_path = server_command(launch, {**FIELDS, "model_path": "/m"})
    assert "model.path=/m" in with_path


def test_an_argument_that_is_only_an_empty_field_is_an_error_naming_it() -> None:
    launch = LaunchConfig.from_dict({"command": ["llama-server", "--model", "{model_file}"]})
    with pytest.raises(LaunchConfigError, match=r"engine.launch.command: \{model_file\} has no"):
        server_command(launch, FIELDS)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"command": ["srv", "{modle}"]}, "engine.launch.command: .* fields in braces: python"),
        ({"command": ["srv", "{port"]}, "engine.launch.command"),
        ({"flag_style": "camel"}, "engine.launch.flag_style: 'camel' is invalid; allowed: dashes"),
        ({"port": 70000}, "engine.launch.port"),
        ({"health_path": "health"}, "engine.launch.health_path: 'health' is invalid; allowed: a"),
        ({"startup_timeout_s": 0}, "engine.launch.startup_timeout_s"),
        ({"threads": 0}, "engine.launch.threads"),
        ({"bogus": 1}, r"engine.launch: unknown option\(s\) \['bogus'\]"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(values: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OpenAIConfig.from_config({"launch": values}, {"name": "tiny"})


def test_every_field_the_template_may_name_is_filled_by_the_run() -> None:
    fields = template_fields("tiny", {"name": "smollm2-135m", "path": None})
    assert set(fields) | {"host", "port"} == set(TEMPLATE_FIELDS)
    assert fields["model_path"] is None  # inferlab serve gets the preset, not the file
    assert fields["threads"] >= 1


@pytest.mark.parametrize(
    "preset",
    sorted(p.stem for p in (configs.CONFIG_DIR / "engine").glob("serve_*.yaml")),
)
def test_every_server_preset_composes_and_builds_its_command(preset: str) -> None:
    """Each preset's YAML is a valid engine.launch, its command a full template; the swept
    flag lands on the command line in the server's own spelling."""
    style = yaml.safe_load(Path(configs.CONFIG_DIR / "engine" / f"{preset}.yaml").read_text())
    key = "engine.max_num_seqs" if style["launch"]["flag_style"] == "hydra" else "max_num_seqs"
    cfg = configs.compose([f"engine={preset}", f"engine.launch.params.{key}=7"])
    engine = OmegaConf.to_container(cfg.engine, resolve=True)
    assert isinstance(engine, dict)
    engine.pop("backend")
    config = OpenAIConfig.from_config(engine, {"name": "tiny", "path": "/m/x"})
    command = server_command(config.launch, {**FIELDS, "model_path": "/m", "model_file": "/m/f"})
    assert any("8123" in arg for arg in command)
    assert "7" in command or "engine.max_num_seqs=7" in command
    assert config.launch.health_path.startswith("/")


@pytest.mark.parametrize(
    "value",
    ["paged,contiguous", "a b", "it's", "ends\\", "ü", "", "a=b", "[x]", "back\\'q", "/m/x:1"],
)
def test_hydra_style_strings_reach_the_server_as_written(value: str) -> None:
    """A string param in flag_style=hydra is quoted where Hydra's override grammar would read
    it otherwise (a comma: a sweep, which `inferlab serve` refused as ambiguous)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (argument,) = flag_arguments({"engine": {"kv_cache": value}}, "hydra")
    override = OverridesParser.create().parse_override(argument)
    assert override.key_or_group == "engine.kv_cache"
    assert override.value() == value


def test_nested_lists_are_json_not_python() -> None:
    assert flag_arguments({"x": [1, [True, "a"]]}, "dashes") == ["--x", "1", '[true, "a"]']


def test_env_values_are_spelled_like_params_and_null_removes_the_variable() -> None:
    from engines.openai.launch_config import environment

    assert environment({"A": True, "B": False, "C": 1, "D": None, "E": [1, 2], "F": "x"}) == {
        "A": "true",
        "B": "false",
        "C": "1",
        "D": None,
        "E": "[1, 2]",
        "F": "x",
    }


def test_hydra_style_keeps_an_empty_mapping() -> None:
    """`{engine: {speculative_config: {}}}` is a value (an empty mapping), not nothing."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (argument,) = flag_arguments({"engine": {"speculative_config": {}}}, "hydra")
    assert argument == "engine.speculative_config={}"
    assert OverridesParser.create().parse_override(argument).value() == {}
