"""Workloads: what requests arrive, when, and how long they are (see docs/workloads.md).

`WORKLOAD_TYPES` (a registry, engines/plugins.py) maps the config's `workload.type` to a
dataclass whose fields are exactly the config keys. Each has `validate() -> self`,
`build(tokenizer, context_len=None) -> list[WorkloadRequest]`, an `info` dict filled by build,
and `concurrency` (C for a closed loop, else None).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from engines.plugins import Registry
from workloads.arrivals import arrival_times
from workloads.lengths import clip_to_context, parse_length
from workloads.prompt_workload import PromptsWorkload
from workloads.request import WorkloadRequest
from workloads.synthetic import SyntheticWorkload
from workloads.trace_replay import TraceWorkload

Workload = SyntheticWorkload | TraceWorkload | PromptsWorkload

WORKLOAD_TYPES = Registry[type[Any]]("workload.type")
WORKLOAD_TYPES.add("synthetic", SyntheticWorkload)
WORKLOAD_TYPES.add("trace", TraceWorkload)
WORKLOAD_TYPES.add("prompts", PromptsWorkload)


def config_keys(cls: type[Any]) -> list[str]:
    """The config keys a workload type accepts (its dataclass fields)."""
    return [f.name for f in dataclasses.fields(cls)]


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


__all__ = [
    "WORKLOAD_TYPES",
    "PromptsWorkload",
    "SyntheticWorkload",
    "TraceWorkload",
    "Workload",
    "WorkloadRequest",
    "arrival_times",
    "clip_to_context",
    "config_keys",
    "from_config",
    "parse_length",
]
