"""`inferlab list`: every plug point, by the config key that picks from it, and what is
registered there (engines/registry.py)."""

from __future__ import annotations

import importlib

from engines.registry import REGISTRIES

#: the modules whose import registers the entries
REGISTERING_MODULES = (
    "engines.backends",
    "engines.builtin.attention",
    "engines.builtin.layers",
    "engines.builtin.kv_cache.sizing",
    "workloads",
)


def listing() -> str:
    for module in REGISTERING_MODULES:
        importlib.import_module(module)
    width = max(len(key) for key in REGISTRIES)
    return "\n".join(
        f"{key:<{width}}  {'|'.join(registry.names())}"
        for key, registry in sorted(REGISTRIES.items())
    )
