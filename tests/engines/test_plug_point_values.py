"""Past the config, in the engine and the harness alike, a plug point's value is asked
through the entry its registry resolved (the KV manager's `retains_kv` / `pages_blocks`, the
linear method's `groups_inputs`, the attention backend's `fixed_shapes` / `kv_cache_class`),
never compared as a string: a new entry then works everywhere by saying what it is."""

from __future__ import annotations

import re
from pathlib import Path

from engines.builtin.config import EngineConfig

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("engines", "harness", "serving", "workloads", "models", "hydra_plugins")
RAW_COMPARE = re.compile(
    r"(kv_cache|quantization|attention_backend)\)?\s*(==|!=)\s*['\"]"
    r"|['\"]\s*(==|!=)\s*\S*(kv_cache|quantization|attention_backend)\b"
)


def test_no_module_compares_a_plug_point_value_as_a_string() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if RAW_COMPARE.search(line) and "lm_head_quantization" not in line
    ]
    assert found == []


def test_the_resolved_entries_say_what_they_keep() -> None:
    def plugged(name: str, **options: str) -> object:
        return EngineConfig(**options).plugged(name)

    kinds = {v: plugged("kv_cache", kv_cache=v).manager for v in ("none", "contiguous", "paged")}  # type: ignore[attr-defined]
    assert [k.retains_kv for k in kinds.values()] == [False, True, True]
    assert [k.pages_blocks for k in kinds.values()] == [False, False, True]
    values = ("none", "int8", "int4", "auto")
    methods = [plugged("quantization", quantization=v) for v in values]
    assert [m.groups_inputs for m in methods] == [False, False, True, False]  # type: ignore[attr-defined]
    assert [m.dense for m in methods] == [True, False, False, True]  # type: ignore[attr-defined]
    assert [m.takes_quantized for m in methods] == [False, False, False, True]  # type: ignore[attr-defined]
