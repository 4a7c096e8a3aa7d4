"""`inferlab kv-calc`: the seeds' memory arithmetic for any model shape, before running it.

    inferlab kv-calc model=llama3-8b engine.max_model_len=8192 engine.dtype=float16 \\
        device_memory_gib=80

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element; a
sequence of max_model_len tokens holds that many times it; what is left of the device's
memory (times gpu_memory_utilization) after the weights holds that many sequences.
"""

from __future__ import annotations

import sys
from typing import Any

from omegaconf import OmegaConf

import configs
import engines.registry  # noqa: F401  (the engine groups' schemas, for compose)
import workloads  # noqa: F401  (the workload groups' schemas, for compose)
from engines.base import ConfigError
from harness.measuring import hardware  # noqa: F401  (hardware=cpu's schema, for compose)
from models.config import kv_bytes_per_token, resolve_model
from models.dtypes import DTYPE_ALIASES

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30


def kv_calc(
    model: str,
    overrides: dict[str, Any] | None,
    max_model_len: int | None,
    dtype: str,
    device_memory_gib: float,
    gpu_memory_utilization: float = 0.9,
) -> dict[str, Any]:
    cfg = resolve_model(model, overrides)
    name = DTYPE_ALIASES.get(str(dtype).lower())
    if name is None:
        raise ConfigError(
            f"engine.dtype: {dtype!r} is invalid; allowed: "
            "auto|float32|bfloat16|float16 (aliases fp32|bf16|fp16)"
        )
    if name == "auto":
        name = "bfloat16"  # what the engine uses on a GPU for dtype=auto
    element = DTYPE_BYTES[name]
    max_len = max_model_len or cfg.max_position_embeddings
    per_token = kv_bytes_per_token(cfg, element)
    per_seq = per_token * max_len
    weights = cfg.num_parameters() * element
    device = int(device_memory_gib * GIB)
    usable = int(device * gpu_memory_utilization) - weights
    mha_per_token = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * element
    return {
        "model": model,
        "dtype": name,
        "max_model_len": max_len,
        "layers": cfg.num_layers,
        "kv_heads": cfg.num_kv_heads,
        "heads": cfg.num_heads,
        "head_dim": cfg.head_dim,
        "kv_bytes_per_token": per_token,
        "gqa_saving": mha_per_token / per_token,
        "kv_bytes_per_sequence": per_seq,
        "sliding_window": cfg.sliding_window,
        "weight_bytes": weights,
        "device_bytes": device,
        "gpu_memory_utilization": gpu_memory_utilization,
        "kv_budget_bytes": max(0, usable),
        "max_sequences": max(0, usable // per_seq),
    }


def format_report(r: dict[str, Any]) -> str:
    def gib(x: int) -> str:
        return f"{x / GIB:,.2f} GiB ({x:,} B)"

    window = (
        (
            f"\n  (sliding window {r['sliding_window']}: with paged KV a sequence holds at "
            f"most ~{r['sliding_window']} tokens of KV)"
        )
        if r["sliding_window"]
        else ""
    )
    return "\n".join(
        [
            f"{r['model']} in {r['dtype']}, max_model_len={r['max_model_len']}",
            f"  KV bytes per token     2 x {r['layers']} layers x {r['kv_heads']} kv_heads x "
            f"{r['head_dim']} x {DTYPE_BYTES[r['dtype']]} B = {r['kv_bytes_per_token']:,} B "
            f"({r['kv_bytes_per_token'] / 1024:,.0f} KiB; GQA {r['heads']}/{r['kv_heads']} heads "
            f"saves {r['gqa_saving']:.0f}x)",
            f"  KV bytes per sequence  {gib(r['kv_bytes_per_sequence'])}",
            f"  weight bytes           {gib(r['weight_bytes'])}",
            f"  device memory          {gib(r['device_bytes'])} x {r['gpu_memory_utilization']}",
            f"  left for KV            {gib(r['kv_budget_bytes'])}",
            f"  sequences that fit     {r['max_sequences']:,} of {r['max_model_len']} tokens each"
            + window,
        ]
    )


def main(args: list[str]) -> int:
    device_gib = 80.0
    rest = []
    try:
        for arg in args:
            key, _, value = arg.partition("=")
            if key.lstrip("+") == "device_memory_gib":
                device_gib = float(value)
                if not device_gib > 0:
                    raise ValueError
            else:
                rest.append(arg)
    except ValueError:
        print(
            f"error: device_memory_gib: {value!r} is invalid; allowed: a number > 0",
            file=sys.stderr,
        )
        return 2
    try:
        cfg = OmegaConf.to_container(configs.compose(rest), resolve=True)
    except configs.ComposeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    assert isinstance(cfg, dict)
    model, engine = cfg["model"], cfg["engine"]
    try:
        report = kv_calc(
            model.get("path") or model["name"],
            model.get("overrides"),
            engine.get("max_model_len"),
            engine.get("dtype", "auto"),
            device_gib,
            engine.get("gpu_memory_utilization", 0.9),
        )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(report))
    return 0
