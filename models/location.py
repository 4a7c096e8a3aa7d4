"""What a model name names: the one resolver of `model=` (and of a speculative draft's
`model`), which every backend, `resolve_model` (here: the name's ModelConfig) and `inferlab
kv-calc` use, so that a name means the same wherever it is given.

A name is a trained model (models/train_tiny.py `TRAINED_MODELS`: its checkpoint folder in the
cache, trained on first use), a packaged model (models/packaged.py `PACKAGED_MODELS`: the file
its installed package ships; `DERIVED_MODELS`: that file re-encoded, or as a quantized Hugging
Face folder, built once), or anything else, as given: a preset (models/config.py `PRESETS`), a
checkpoint folder or a .gguf file, which `resolve_model` reads. The model group names its model
by `model.name`, or with model=hf by `model.path`.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from models.config import PRESETS, ModelConfig, from_hf_config, from_hf_dict
from models.gguf import gguf_hf_config, gguf_source_keys
from models.gguf_quantize import derived_gguf
from models.hf_quantize import derived_folder
from models.packaged import (
    DERIVED_FOLDER_KINDS,
    DERIVED_MODELS,
    PACKAGED_MODELS,
    packaged_model_path,
)
from models.train_tiny import TRAINED_MODELS, trained_model_path


def model_location(name: str) -> str:
    """Where the model `name` is: a trained model's checkpoint folder, a packaged model's
    installed file, else `name` as given (a preset, a checkpoint folder or a file). A value
    that is no name (a list or mapping from YAML) is returned as given too, for the options'
    checker to refuse naming the field (looking it up would raise a TypeError)."""
    if not isinstance(name, str):
        return name
    if name in TRAINED_MODELS:
        return str(trained_model_path(name))
    if name in PACKAGED_MODELS:
        return str(packaged_model_path(name))
    if name in DERIVED_MODELS:
        base, kind = DERIVED_MODELS[name]
        if kind in DERIVED_FOLDER_KINDS:
            return str(derived_folder(packaged_model_path(base), kind))
        return str(derived_gguf(packaged_model_path(base), kind))
    return name


def resolve_model(model: str | Path, overrides: dict[str, Any] | None = None) -> ModelConfig:
    """A preset name, a trained or packaged model, a checkpoint folder or a GGUF file ->
    ModelConfig."""
    name = str(model)
    if name in PRESETS:
        return PRESETS[name].with_overrides(overrides)
    name = model_location(name)
    if name.endswith(".gguf") and Path(name).is_file():
        config = gguf_hf_config(name)
        return from_hf_dict(config, name, gguf_source_keys(name)).with_overrides(overrides)
    if Path(name).exists():
        return from_hf_config(name).with_overrides(overrides)
    known = "|".join([*PRESETS, *PACKAGED_MODELS, *DERIVED_MODELS])
    raise ValueError(
        f"model: {name!r} is neither a preset ({known}), an existing checkpoint folder nor a "
        ".gguf file"
    )


def require_model_path(model: Mapping[str, Any]) -> None:
    """model=hf names no model by itself: its model.path must be given."""
    if model.get("name") == "hf" and not model.get("path"):
        raise ValueError(
            "model.path: required for model=hf (a local Hugging Face checkpoint "
            "folder with config.json and *.safetensors)"
        )


def model_group_name(model: Mapping[str, Any]) -> str:
    """The model the `model` group names: model.path (required for model=hf), else model.name."""
    require_model_path(model)
    return str(model.get("path") or model["name"])
