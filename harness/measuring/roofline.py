"""The roofline per engine step: FLOPs, the bytes that must move, predicted time, MBU and MFU.

For each step (a `steps` row) and the model's shape (the engine's `describe()`):

    flops            = 2 * block_linear_params * tokens + 2 * lm_head_params * logits_tokens
                       + attention_flops_per_pair * attention_pairs
                       + 2 * lora_params_per_adapter * lora_rows (LoRA: each row's shrink
                       and expand)
                       + 2 * moe_expert_params * (token, expert) pairs (mixture of experts;
                       block_linear_params then holds the other layers)
    weight_bytes_read = linear weights of the blocks as stored (quantized bytes and scales)
                       + the LM head when any logits are computed; never the embedding table
                       + each adapter the step runs, its A and B once (LoRA)
                       + each (layer, expert) pair the step touches, its weights once (MoE)
    kv_bytes_read    = kv_tokens_read * kv_bytes_per_token
    kv_bytes_written = kv_tokens_written * kv_bytes_per_token
    predicted_s      = max(compute_s, memory_s) + (1 - overlap[dtype]) * min(compute_s, memory_s)
                       + predicted_comm_s
                       compute_s = flops / peak_flops[dtype]; memory_s = bytes / memory_bandwidth
    predicted_comm_s = under tensor parallelism (N ranks), the step's collectives on the spec's
                       link, not overlapped: (2 x layers + 1) all-reduces of tokens x hidden
                       and the gather of logits_tokens x padded vocab (harness/measuring/comm.py)
    mbu              = bytes / measured_s / memory_bandwidth
    mfu              = flops / measured_s / peak_flops[dtype]

where tokens = prefill + decode + padding tokens computed, bytes = the three byte columns (per
rank under tensor parallelism: each rank's shard, and its FLOPs), and
measured_s = end_s - start_s, the whole step as the engine's clock saw it (scheduling, input
preparation, forward, sampling, detokenization). docs/roofline.md explains each choice.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.measuring.comm import allreduce_seconds, gather_seconds
from harness.run_folder import table_path, write_parquet_atomic

ROOFLINE_COLUMNS = (
    "flops",
    "weight_bytes_read",
    "kv_bytes_read",
    "kv_bytes_written",
    "predicted_s",
    "mbu",
    "mfu",
    "predicted_comm_s",
)


@dataclass(frozen=True)
class ModelShape:
    """The per-token constants of one loaded model, as the engine describes it."""

    block_linear_params: int  # matmul weights of the decoder blocks (q/k/v/o, gate/up/down)
    lm_head_params: int  # hidden x vocab (the tied embedding, when tied)
    attention_flops_per_pair: int  # 4 x layers x heads x head_dim (QK^T and PV)
    block_linear_bytes: int  # the blocks' linear weights as stored, scales and biases included
    lm_head_bytes: int  # as stored
    kv_bytes_per_token: float  # all layers, K and V, scales included
    dtype: str  # the compute dtype, e.g. "float32"
    # tensor parallelism: N ranks, each step's all-reduces of tokens x hidden_bytes_per_token
    # and the gather of logits rows x logits_bytes_per_row (the assembled row)
    tensor_parallel_size: int = 1
    allreduces_per_step: int = 0
    hidden_bytes_per_token: int = 0
    logits_bytes_per_row: int = 0
    # LoRA: an adapter's A and B parameters (this rank's), in the compute dtype
    lora_params_per_adapter: float = 0.0
    lora_bytes_per_param: int = 4
    # mixture of experts: one expert's parameters and bytes as stored (its block's experts are
    # out of block_linear_params and block_linear_bytes)
    moe_expert_params: float = 0.0
    moe_expert_bytes: float = 0.0
    moe_all_expert_bytes: float = 0.0  # every expert of every layer: out of linear_weight_bytes

    @classmethod
    def from_engine_info(cls, engine: dict[str, Any] | None) -> ModelShape | None:
        """None for a backend that does not describe its shape (HTTP servers, HF)."""
        engine = engine or {}
        shape = engine.get("roofline_shape")
        keys = ("linear_weight_bytes", "lm_head_bytes", "kv_bytes_per_token", "dtype")
        if not shape or any(engine.get(k) is None for k in keys):
            return None
        return cls(
            block_linear_params=int(shape["block_linear_params"]),
            lm_head_params=int(shape["lm_head_params"]),
            attention_flops_per_pair=int(shape["attention_flops_per_pair"]),
            block_linear_bytes=int(engine["linear_weight_bytes"])
            - int(shape.get("moe_all_expert_bytes", 0)),
            lm_head_bytes=int(engine["lm_head_bytes"]),
            kv_bytes_per_token=float(engine["kv_bytes_per_token"]),
            dtype=str(engine["dtype"]),
            tensor_parallel_size=int(engine.get("tensor_parallel_size") or 1),
            allreduces_per_step=int(shape.get("allreduces_per_step", 0)),
            hidden_bytes_per_token=int(shape.get("hidden_bytes_per_token", 0)),
            logits_bytes_per_row=int(shape.get("logits_bytes_per_row", 0)),
            lora_params_per_adapter=float(shape.get("lora_params_per_adapter", 0.0)),
            lora_bytes_per_param=_element_bytes(str(engine["dtype"])),
            moe_expert_params=float(shape.get("moe_expert_params", 0.0)),
            moe_expert_bytes=float(shape.get("moe_expert_bytes", 0.0)),
            moe_all_expert_bytes=float(shape.get("moe_all_expert_bytes", 0.0)),
        )


def _element_bytes(dtype: str) -> int:
    return 2 if dtype in ("bfloat16", "float16") else 4


def measured_step_s(steps: pd.DataFrame) -> pd.Series:
    """The denominator of MBU and MFU: the step's wall time, NaN where not positive."""
    seconds = (steps["end_s"] - steps["start_s"]).astype(float)
    return seconds.where(seconds > 0)


def step_costs(steps: pd.DataFrame, shape: ModelShape) -> pd.DataFrame:
    """FLOPs and bytes per step (float columns; NaN where the step lacks the counts)."""

    def col(name: str) -> pd.Series:
        return steps[name].astype(float) if name in steps else pd.Series(np.nan, steps.index)

    tokens = col("prefill_tokens") + col("decode_tokens") + col("padding_tokens").fillna(0)
    logits = col("logits_tokens")
    lora_rows = col("lora_rows").fillna(0)
    lora_adapters = col("lora_adapters").fillna(0)
    expert_pairs = (
        steps["moe_expert_tokens"].map(lambda v: float(sum(v)) if v is not None else 0.0)
        if "moe_expert_tokens" in steps
        else pd.Series(0.0, steps.index)
    )
    flops = (
        2.0 * shape.block_linear_params * tokens
        + 2.0 * shape.lm_head_params * logits
        + float(shape.attention_flops_per_pair) * col("attention_pairs")
        + 2.0 * shape.lora_params_per_adapter * lora_rows
        + 2.0 * shape.moe_expert_params * expert_pairs
    )
    weights = (
        shape.block_linear_bytes * (tokens > 0)
        + shape.lm_head_bytes * (logits > 0)
        + shape.lora_params_per_adapter * shape.lora_bytes_per_param * lora_adapters
        + shape.moe_expert_bytes * col("moe_experts_touched").fillna(0)
    )
    out = pd.DataFrame(index=steps.index)
    out["flops"] = flops
    out["weight_bytes_read"] = weights.astype(float).where(logits.notna())
    out["kv_bytes_read"] = col("kv_tokens_read") * shape.kv_bytes_per_token
    out["kv_bytes_written"] = col("kv_tokens_written") * shape.kv_bytes_per_token
    return out


def comm_seconds(
    steps: pd.DataFrame, shape: ModelShape, link_bandwidth: float, link_latency: float
) -> pd.Series:
    """Each step's collectives on the link, one after the other (0 with one rank)."""
    n = shape.tensor_parallel_size
    if n == 1:
        return pd.Series(0.0, steps.index)
    tokens = (
        steps["prefill_tokens"] + steps["decode_tokens"] + steps["padding_tokens"].fillna(0)
    ).astype(float)
    logits = steps["logits_tokens"].astype(float)
    return pd.Series(
        [
            (t > 0)
            * shape.allreduces_per_step
            * allreduce_seconds(t * shape.hidden_bytes_per_token, n, link_bandwidth, link_latency)
            + (r > 0)
            * gather_seconds(r * shape.logits_bytes_per_row, n, link_bandwidth, link_latency)
            for t, r in zip(tokens.fillna(0), logits.fillna(0), strict=True)
        ],
        steps.index,
    ).where(tokens.notna() & logits.notna())


def predicted_time(compute_s: Any, memory_s: Any, overlap: float) -> Any:
    """The roofline's time for work needing `compute_s` at peak FLOP/s and `memory_s` at peak
    bandwidth: max of the two plus the part of the smaller one the machine does not overlap
    (overlap 1: the standard max(); 0: their sum). Scalars or arrays."""
    return compute_s + memory_s - overlap * np.fmin(compute_s, memory_s)


def attainable_flops(
    intensity: Any, peak_flops: float, bandwidth: float, overlap: float = 1.0
) -> Any:
    """FLOP/s the roofline allows at an arithmetic intensity (FLOP per byte moved): the curve a
    roofline plot draws; min(peak, bandwidth x intensity) when overlap is 1."""
    intensity = np.asarray(intensity, dtype=float)
    return intensity / predicted_time(intensity / peak_flops, 1.0 / bandwidth, overlap)


def add_roofline(
    steps: pd.DataFrame,
    shape: ModelShape,
    peak_flops: float | None,
    memory_bandwidth: float,
    overlap: float = 1.0,
    link: tuple[float, float] | None = None,
) -> pd.DataFrame:
    """`steps` with the roofline columns set (MFU and predicted_s NaN without a FLOP/s peak).

    `overlap` (the hardware spec's, 0..1): 1 is the standard roofline, max(compute, memory);
    0 adds them, for a machine that does one after the other. `link`: the spec's (bandwidth,
    latency), for a tensor-parallel run's collectives (predicted_s NaN without it)."""
    out = steps.copy()
    costs = step_costs(steps, shape)
    for column in costs:
        out[column] = costs[column]
    total_bytes = costs["weight_bytes_read"] + costs["kv_bytes_read"] + costs["kv_bytes_written"]
    memory_s = total_bytes / memory_bandwidth
    measured = measured_step_s(steps)
    out["mbu"] = total_bytes / measured / memory_bandwidth
    comm_s = pd.Series(np.nan if shape.tensor_parallel_size > 1 else 0.0, steps.index)
    if link is not None and shape.tensor_parallel_size > 1:
        comm_s = comm_seconds(steps, shape, *link)
    out["predicted_comm_s"] = comm_s
    if peak_flops:
        compute_s = costs["flops"] / peak_flops
        out["predicted_s"] = (predicted_time(compute_s, memory_s, overlap) + comm_s).where(
            compute_s.notna() & memory_s.notna()
        )
        out["mfu"] = costs["flops"] / measured / peak_flops
    else:
        out["predicted_s"] = np.nan
        out["mfu"] = np.nan
    return out


@dataclass(frozen=True)
class Roof:
    """A recorded hardware spec (HardwareSpec.to_dict(), as summary.json holds it) read for one
    compute dtype: the one spelling of its keys, for the run's annotation and for reports."""

    name: str | None
    peak_flops: float | None  # FLOP/s for the dtype; None when the spec has no figure for it
    memory_bandwidth: float | None  # bytes/s
    overlap: float  # 1 (the standard roofline) when the spec measured none for the dtype
    link: tuple[float, float] | None = None  # (bytes/s, s per hop) between devices, if known

    @classmethod
    def of(cls, spec: Any, dtype: str) -> Roof | None:
        if not isinstance(spec, dict):
            return None
        dtype = dtype.removeprefix("torch.")
        peaks = spec.get("peak_flops")
        overlaps = spec.get("overlap")
        return cls(
            name=spec.get("name"),
            peak_flops=_positive(peaks.get(dtype) if isinstance(peaks, dict) else None),
            memory_bandwidth=_positive(spec.get("memory_bandwidth")),
            overlap=float(overlaps.get(dtype, 1.0)) if isinstance(overlaps, dict) else 1.0,
            link=_link(spec),
        )


def _link(spec: dict[str, Any]) -> tuple[float, float] | None:
    bandwidth, latency = _positive(spec.get("link_bandwidth")), spec.get("link_latency")
    if bandwidth is None or isinstance(latency, bool) or not isinstance(latency, int | float):
        return None
    return (bandwidth, float(latency)) if latency >= 0 else None


def _positive(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and value > 0
    return float(value) if ok else None


def annotate_run(run_dir: str | Path, steps: pd.DataFrame, info: dict[str, Any]) -> pd.DataFrame:
    """Add the roofline columns to a finished run's steps and rewrite its steps.parquet.

    Needs the engine's shape (`info["engine"]`) and the hardware spec (`info["hardware"]`);
    without either, or without steps, the columns stay NaN and nothing is rewritten."""
    shape = ModelShape.from_engine_info(info.get("engine"))
    roof = None if shape is None else Roof.of(info.get("hardware"), shape.dtype)
    if shape is None or roof is None or roof.memory_bandwidth is None or steps.empty:
        return steps
    steps = add_roofline(
        steps, shape, roof.peak_flops, roof.memory_bandwidth, roof.overlap, roof.link
    )
    write_parquet_atomic(steps, table_path(Path(run_dir), "steps", "parquet"))
    return steps


def decode_only(steps: pd.DataFrame) -> pd.Series:
    return (steps["num_prefill_seqs"] == 0) & (steps["num_decode_seqs"] > 0)


def verifying(steps: pd.DataFrame) -> pd.Series:
    """Steps that verified speculative drafts (whose rows count as prefill tokens)."""
    if "spec_draft_tokens" not in steps:
        return pd.Series(False, index=steps.index)
    return steps["spec_draft_tokens"].fillna(0) > 0


def prefill_only(steps: pd.DataFrame) -> pd.Series:
    return (steps["num_decode_seqs"] == 0) & (steps["prefill_tokens"] > 0) & ~verifying(steps)


def roofline_summary(steps: pd.DataFrame) -> dict[str, float]:
    """Run metrics from the per-step columns (registered in harness/measuring/metrics.py)."""
    if steps.empty or "mbu" not in steps or not steps["mbu"].notna().any():
        return {}
    out: dict[str, float] = {}

    def put(name: str, values: pd.Series, how: str) -> None:
        values = values.dropna()
        if len(values):
            out[name] = float(values.mean() if how == "mean" else values.median())

    ratio = measured_step_s(steps) / steps["predicted_s"]
    decodes, prefills = decode_only(steps), prefill_only(steps)
    put("mbu_decode_mean", steps.loc[decodes, "mbu"], "mean")
    put("mbu_mean", steps["mbu"], "mean")
    put("mfu_prefill_mean", steps.loc[prefills, "mfu"], "mean")
    put("mfu_mean", steps["mfu"], "mean")
    put("roofline_decode_ratio_p50", ratio[decodes], "median")
    put("roofline_ratio_p50", ratio, "median")
    verifies = verifying(steps)
    put("mbu_verify_mean", steps.loc[verifies, "mbu"], "mean")
    put("roofline_verify_ratio_p50", ratio[verifies], "median")
    if set(ROOFLINE_COLUMNS[:4]) <= set(steps.columns):  # flops and the three byte terms
        moved = steps["weight_bytes_read"] + steps["kv_bytes_read"] + steps["kv_bytes_written"]
        intensity = steps["flops"] / moved.where(moved > 0)
        put("flops_per_byte_decode_mean", intensity[decodes], "mean")
        put("flops_per_byte_verify_mean", intensity[verifies], "mean")
    # Time-weighted over the run: what a workload's throughput reached, where the per-step
    # means above weigh a 5 ms step like a 2 s one.
    measured = measured_step_s(steps)
    timed = steps["mfu"].notna() & measured.notna()
    if timed.any():
        out["mfu_overall"] = float((steps["mfu"] * measured)[timed].sum() / measured[timed].sum())
    predicted = steps["predicted_s"].notna() & measured.notna()
    if predicted.any():
        out["roofline_fraction"] = float(
            steps.loc[predicted, "predicted_s"].sum() / measured[predicted].sum()
        )
    return out
