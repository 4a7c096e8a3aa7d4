"""Workloads: what requests arrive, when, and how long they are (see docs/workloads.md).

`WORKLOAD_TYPES` (a registry, engines/registry.py) maps the config's `workload.type` to a
dataclass whose fields are exactly the config keys. Each has `validate() -> self`,
`build(tokenizer, context_len=None) -> list[WorkloadRequest]`, an `info` dict filled by build,
`concurrency` (C for a closed loop, else None) and `max_concurrency` (an open loop's cap on the
requests in flight, else None).

The dataclass is also the schema of its `workload` config group: importing this package puts
`workload/<type>_schema` in Hydra's ConfigStore, which configs/workload/*.yaml extend, so the
defaults and types live in the dataclass once and the YAML files hold presets.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from engines.registry import Registry
from workloads.arrivals import arrival_times
from workloads.lengths import clip_to_context, parse_length
from workloads.prompt_workload import PromptsWorkload
from workloads.request import WorkloadRequest
from workloads.synthetic import SyntheticWorkload
from workloads.tool_conversations import ToolCallsWorkload
from workloads.trace_replay import TraceWorkload

Workload = SyntheticWorkload | TraceWorkload | PromptsWorkload | ToolCallsWorkload

WORKLOAD_TYPES = Registry[type[Any]]("workload.type")
WORKLOAD_TYPES.add("synthetic", SyntheticWorkload)
WORKLOAD_TYPES.add("trace", TraceWorkload)
WORKLOAD_TYPES.add("prompts", PromptsWorkload)
WORKLOAD_TYPES.add("tool_calls", ToolCallsWorkload)


def config_keys(cls: type[Any]) -> list[str]:
    """The config keys a workload type accepts (its dataclass fields)."""
    return [f.name for f in dataclasses.fields(cls)]


def schema(kind: str) -> type[Any]:
    """The `workload` group's schema for type `kind`: `type` (defaulting to `kind`) and every
    field of its dataclass with its type and default, but for two kinds of field:
    - one whose metadata names a `schema` dataclass (the arrival block, a mapping in Python)
      is that block or null, defaulting to the block's defaults (which the field's own default
      is made from);
    - a mapping (`sampling`, `shared_prefix`, ...) is Any: OmegaConf cannot set a null
      Dict-typed node to a mapping (`workload.shared_prefix={num_groups: 4, prefix_len: 32}`
      fails inside its merge), and the workload's validate checks every key, naming it."""
    cls = WORKLOAD_TYPES.get(kind)
    hints = typing.get_type_hints(cls)
    entries: list[tuple[str, Any, Any]] = [("type", str, dataclasses.field(default=kind))]
    for f in dataclasses.fields(cls):
        block = f.metadata.get("schema")
        if block is not None:
            entries.append((f.name, block | None, dataclasses.field(default_factory=block)))
            continue
        hint = Any if _is_mapping(hints[f.name]) else hints[f.name]
        if f.default is dataclasses.MISSING:
            entries.append((f.name, hint, dataclasses.field(default_factory=f.default_factory)))
        else:
            entries.append((f.name, hint, dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass(f"{cls.__name__}Schema", entries)


def _is_mapping(hint: Any) -> bool:
    """dict[...], or a union holding one (dict[str, Any] | None)."""
    return typing.get_origin(hint) is dict or any(map(_is_mapping, typing.get_args(hint)))


def register_config_schemas() -> None:
    """Store each workload type's schema in Hydra's ConfigStore as `workload/<type>_schema`
    (what configs/workload/*.yaml extend); call before composing (idempotent)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    for kind in WORKLOAD_TYPES:
        store.store(group="workload", name=f"{kind}_schema", node=schema(kind))


def from_config(options: Mapping[str, Any]) -> Any:
    """A validated workload from a config mapping (`type` picks the class; default synthetic).

    Unknown keys and bad values raise ValueError naming `workload.<key>`.
    """
    options = dict(options)
    kind = options.pop("type", "synthetic")
    cls = WORKLOAD_TYPES.get(kind)
    known = config_keys(cls)
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ValueError(
            f"workload: unknown key(s) {unknown} for type {kind}; allowed: {sorted(known)}"
        )
    return cls(**options).validate()


register_config_schemas()


__all__ = [
    "WORKLOAD_TYPES",
    "PromptsWorkload",
    "SyntheticWorkload",
    "ToolCallsWorkload",
    "TraceWorkload",
    "Workload",
    "WorkloadRequest",
    "arrival_times",
    "clip_to_context",
    "config_keys",
    "from_config",
    "parse_length",
    "register_config_schemas",
    "schema",
]
