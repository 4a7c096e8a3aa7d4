"""Every backend, by its `engine.backend` name: one registry that the harness and the server
build backends from, and the schemas of the `engine` config group.

A backend registers its options dataclass (whose fields, defaults and types are the `engine`
group's keys: they live there once) and a function that builds the backend from those options
and the `model` group. Adding a backend is a package of its own plus one `@register_backend`
here (`BACKENDS`, a registry like every plug point's: engines/registry.py);
`configs/engine/<name>.yaml` then only names the schema, `<name>_schema`, and presets.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from configs.schema import schema_of
from engines.base import Backend
from engines.builtin.config import EngineConfig
from engines.hf.config import HFConfig
from engines.llamacpp.config import LlamaCppConfig
from engines.openai.config import OpenAIConfig
from engines.registry import Registry
from models.location import model_group_name, model_location

Options = dict[str, Any]
Builder = Callable[[Options, Options], Backend]

#: Options the `model` group fills in for backends that load the weights themselves.
MODEL_FIELDS = ("model", "model_overrides", "tokenizer")


@dataclass
class ModelChoice:
    """The `model` group: the model every backend runs; configs/model/*.yaml are its presets
    (the schema `model/model_schema`)."""

    # required: hf, or a model name (models/location.py, the one resolver): a preset
    # (models/config.py), a packaged model (models/packaged.py) or a trained one
    # (models/train_tiny.py TRAINED_MODELS: tiny-trained, tiny-trained-large, ...)
    name: str = "???"
    path: str | None = None  # model=hf: a local Hugging Face checkpoint folder or .gguf file
    tokenizer: str | None = None  # None: the checkpoint's tokenizer, else the built-in BPE
    # any ModelConfig field, e.g. {num_kv_heads: 1, sliding_window: 256}
    overrides: Any = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class BackendEntry:
    name: str
    config: type[Any]  # the options dataclass
    build: Builder  # (options without `backend`, the model group) -> an unloaded backend
    model_fields: tuple[str, ...]  # config fields taken from the model group, not `engine`

    def schema(self) -> type[Any]:
        """The `engine` group's schema for this backend: `backend` and every option field
        (with its type and default), but those the model group fills."""
        hints = typing.get_type_hints(self.config)
        entries: list[tuple[str, Any, Any]] = [("backend", str, self.name)]
        for f in dataclasses.fields(self.config):
            if f.name in self.model_fields:
                continue
            hint = hints[f.name]
            if dataclasses.is_dataclass(hint) and isinstance(hint, type):  # a nested section
                hint = schema_of(hint)  # mutable, so that overrides can set its keys
                default: Any = dataclasses.field(default_factory=hint)
            elif f.default is dataclasses.MISSING:
                default = dataclasses.field(default_factory=f.default_factory)
            else:
                default = f.default
            entries.append((f.name, hint, default))
        return dataclasses.make_dataclass(
            f"{self.config.__name__}Schema",
            [
                (n, t, d if isinstance(d, dataclasses.Field) else dataclasses.field(default=d))
                for n, t, d in entries
            ],
        )


BACKENDS = Registry[BackendEntry]("engine.backend")


def register_backend(
    name: str, config: type[Any], model_fields: tuple[str, ...] = ()
) -> Callable[[Builder], Builder]:
    def register(build: Builder) -> Builder:
        BACKENDS.add(name, BackendEntry(name, config, build, model_fields))
        return build

    return register


def build_backend(engine: Options, model: Options) -> Backend:
    """The backend `engine.backend` names (default builtin), not loaded yet, from the
    composed `engine` and `model` groups. Bad values raise ValueError naming the key."""
    options = dict(engine)
    entry = BACKENDS.get(options.pop("backend", "builtin"))
    known_model_keys = {f.name for f in dataclasses.fields(ModelChoice)}
    unknown = sorted(set(model) - known_model_keys)
    if unknown:
        raise ValueError(f"model: unknown key(s) {unknown}; allowed: {sorted(known_model_keys)}")
    return entry.build(options, model)


def _weights_from_model_group(options: Options, model: Options) -> Options:
    """The model group as the options of a backend that loads the weights itself."""
    options = dict(options)
    options["model"] = model_location(model_group_name(model))
    draft = options.get("speculative_config")
    if isinstance(draft, Mapping) and isinstance(draft.get("model"), str):
        options["speculative_config"] = {**draft, "model": model_location(draft["model"])}
    options["model_overrides"] = dict(model.get("overrides") or {})
    options["tokenizer"] = model.get("tokenizer")
    return options


@register_backend("builtin", EngineConfig, MODEL_FIELDS)
def _builtin(options: Options, model: Options) -> Backend:
    """This repository's engine."""
    from engines.builtin.backend import BuiltinBackend

    return BuiltinBackend(EngineConfig.from_dict(_weights_from_model_group(options, model)))


@register_backend("hf", HFConfig, MODEL_FIELDS)
def _hf(options: Options, model: Options) -> Backend:
    """Hugging Face transformers in process, on the very same weights."""
    from engines.hf.backend import HFBackend

    return HFBackend.from_config(_weights_from_model_group(options, model))


@register_backend("llamacpp", LlamaCppConfig, MODEL_FIELDS)
def _llamacpp(options: Options, model: Options) -> Backend:
    """llama.cpp in process (llama-cpp-python) on a GGUF file."""
    from engines.llamacpp.backend import LlamaCppBackend

    return LlamaCppBackend.from_config(_weights_from_model_group(options, model))


@register_backend("openai", OpenAIConfig)
def _openai(options: Options, model: Options) -> Backend:
    """Any OpenAI-compatible server (the model group names what it serves)."""
    from engines.openai.backend import OpenAIBackend

    return OpenAIBackend.from_config(options, model)


def _open_mappings(entry: BackendEntry) -> Any:
    """The schema as a config whose mappings of a server's flags take new keys from the
    command line without Hydra's `+` (engine.launch.params.max_num_seqs=64,256)."""
    from omegaconf import OmegaConf

    node = OmegaConf.structured(entry.schema())
    for key in OPEN_MAPPINGS.get(entry.name, ()):
        OmegaConf.set_struct(OmegaConf.select(node, key), False)
    return node


#: Mappings of a backend's schema whose keys are the user's (a server's own flags).
OPEN_MAPPINGS = {"openai": ("launch.params", "launch.env")}


def register_config_schemas() -> None:
    """Store each backend's schema in Hydra's ConfigStore as `engine/<name>_schema` (what
    configs/engine/<name>.yaml extends), and the model group's, `model/model_schema`; call
    before composing (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for entry in BACKENDS.values():
        store.store(group="engine", name=f"{entry.name}_schema", node=_open_mappings(entry))
    store.store(group="model", name="model_schema", node=ModelChoice)


register_config_schemas()
