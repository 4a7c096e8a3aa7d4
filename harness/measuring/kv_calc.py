"""`inferlab kv-calc`: the seeds' memory arithmetic for any model shape, before running it, and
with `engine.tensor_parallel_size` and `hardware=`, a plan per GPU with a predicted decode step.

    inferlab kv-calc model=llama3-8b engine.max_model_len=8192 engine.dtype=float16 \\
        device_memory_gib=80
    inferlab kv-calc model=llama3-70b hardware=h100 engine.dtype=bf16 \\
        engine.tensor_parallel_size=1,2,4,8      # one row per size (and per hardware=a,b)

KV bytes per token = 2 (K and V) x layers x kv_heads x head_dim x bytes per element (the
dtype's, or engine.kv_cache_dtype's: 1 for FP8, 1 + 2 / head_dim for INT8 and its scales); a
sequence of max_model_len tokens holds that many times it; what is left of the device's
memory (times gpu_memory_utilization) after the weights holds that many sequences.

Over N GPUs (models/tensor_parallel.py: Megatron's layout) each device holds its share of the
weights (the split layers / N, the norms whole, the embedding and LM head split by vocabulary
padded to a multiple of N) and of every token's KV (its kv_heads: num_kv_heads / N, or one
replicated head when N exceeds num_kv_heads). With a hardware spec, the decode step at the
largest batch that fits (sequences of `context_len` tokens, at most engine.max_num_seqs) is
predicted per device by the roofline's own cost formulas (harness/measuring/roofline.py: the
FLOPs and bytes a step of that batch and context has, max(compute, memory) with the spec's
overlap), plus the step's collectives (harness/measuring/comm.py: 2 all-reduces per layer and 1
after the embedding, the logits gather), not overlapped with the compute or each other.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pandas as pd
import torch
from omegaconf import OmegaConf

import configs
import engines.backends  # noqa: F401  (the engine groups' schemas, for compose)
import workloads  # noqa: F401  (the workload groups' schemas, for compose)
from engines.base import ConfigError
from engines.builtin.kv_cache.storage import KV_CACHE_DTYPES, kv_element_bytes
from engines.builtin.layers import LINEAR_METHODS
from harness.measuring import hardware  # (also hardware=cpu's schema, for compose)
from harness.measuring.comm import tp_decode_comm_bytes, tp_decode_comm_seconds
from harness.measuring.hardware import HardwareSpec
from harness.measuring.roofline import ModelShape, predicted_time, step_costs
from models.config import ModelConfig, kv_bytes_per_token
from models.dtypes import DTYPE_ALIASES
from models.location import model_group_name, resolve_model
from models.tensor_parallel import (
    TP_KEY,
    TPShard,
    allowed_tp_sizes,
    kv_bytes_per_token_per_rank,
    rank_params,
    tp_shard,
)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
GIB = 1 << 30
DEFAULT_DEVICE_GIB = 80.0  # without device_memory_gib= or a spec that states its memory
MAX_DEVICE_GIB = float(1 << 20)  # 1 PiB: past any device's or host's memory
# the command's own keys (not config keys), and the keys that take a comma-separated list
OWN_KEYS = ("device_memory_gib", "context_len")
LIST_KEYS = ("hardware", TP_KEY)


def kv_calc(
    model: str,
    overrides: dict[str, Any] | None,
    max_model_len: int | None,
    dtype: str,
    device_memory_gib: float | None = None,
    gpu_memory_utilization: float = 0.9,
    tensor_parallel_size: int = 1,
    spec: HardwareSpec | None = None,
    context_len: int | None = None,
    max_num_seqs: int | None = None,
    expert_parallel: bool = False,
    kv_cache_dtype: str = "auto",
) -> dict[str, Any]:
    """The memory plan (and with `spec`, the predicted decode step) as a flat dict; K/V in
    `kv_cache_dtype` (engine.kv_cache_dtype: INT8's scale planes and FP8's byte counted).

    Device memory: `device_memory_gib` when given, else the spec's `memory_bytes`, else 80 GiB.
    Every per-device figure is for one of `tensor_parallel_size` GPUs; at 1 they are the
    model's own."""
    cfg = resolve_model(model, overrides)
    name = _dtype_name(dtype)
    element = DTYPE_BYTES[name]
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(
            f"engine.kv_cache_dtype: {kv_cache_dtype!r} is invalid; allowed: "
            + "|".join(KV_CACHE_DTYPES)
        )
    kv_element = kv_element_bytes(getattr(torch, name), cfg.head_dim, kv_cache_dtype)
    _check_engine_options(cfg, max_model_len, gpu_memory_utilization, max_num_seqs)
    max_len = max_model_len or cfg.max_positions
    context = _checked_context_len(context_len, max_len)
    shard = tp_shard(cfg, tensor_parallel_size, expert_parallel=expert_parallel)
    device = _device_bytes(device_memory_gib, spec)
    report: dict[str, Any] = {
        "model": model,
        "dtype": name,
        "kv_cache_dtype": kv_cache_dtype,
        "kv_element_bytes": kv_element,
        "max_model_len": max_len,
        **_model_figures(cfg, element, kv_element, max_len),
        **_device_figures(
            cfg,
            shard,
            element,
            kv_element,
            max_len,
            device,
            gpu_memory_utilization,
            expert_parallel,
        ),
        "context_len": context,
        "hardware": None if spec is None else spec.name,
        "expert_parallel": expert_parallel,
        "experts_per_device": shard.experts,
    }
    report.update(
        _decode_batch(report["kv_capacity_tokens"], held_tokens(cfg, context), max_num_seqs)
    )
    report.update(_predict(cfg, shard, element, name, spec, report))
    return report


def _dtype_name(dtype: str) -> str:
    name = DTYPE_ALIASES.get(str(dtype).lower())
    if name is None:
        raise ConfigError(
            f"engine.dtype: {dtype!r} is invalid; allowed: "
            "auto|float32|bfloat16|float16 (aliases fp32|bf16|fp16)"
        )
    if name == "auto":
        name = "bfloat16"  # what the engine uses on a GPU for dtype=auto
    return name


def _check_engine_options(
    cfg: ModelConfig,
    max_model_len: int | None,
    gpu_memory_utilization: float,
    max_num_seqs: int | None,
) -> None:
    # checked here, not left to context_len's check: a bad max_model_len (0 or negative) was
    # silently replaced, or reported as a bad context_len the user never gave
    if max_model_len is not None and (
        isinstance(max_model_len, bool) or not isinstance(max_model_len, int) or max_model_len < 1
    ):
        raise ValueError(
            f"engine.max_model_len: {max_model_len!r} is invalid; allowed: an integer >= 1 "
            "(or null: the model's max_position_embeddings)"
        )
    if max_model_len is not None and max_model_len > cfg.max_positions:
        raise ValueError(
            f"engine.max_model_len: {max_model_len} is invalid; allowed: an integer in [1, "
            f"{cfg.max_positions}] (the positions the model takes)"
        )
    if (
        isinstance(gpu_memory_utilization, bool)
        or not isinstance(gpu_memory_utilization, int | float)
        or not 0 < gpu_memory_utilization <= 1  # also refuses NaN
    ):
        raise ValueError(
            f"engine.gpu_memory_utilization: {gpu_memory_utilization!r} is invalid; allowed: "
            "a number in (0, 1]"
        )
    if max_num_seqs is not None and (
        isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int) or max_num_seqs < 1
    ):
        raise ValueError(
            f"engine.max_num_seqs: {max_num_seqs!r} is invalid; allowed: an integer >= 1"
        )


def _checked_context_len(context_len: int | None, max_len: int) -> int:
    context = max_len if context_len is None else context_len
    if isinstance(context, bool) or not isinstance(context, int) or not 1 <= context <= max_len:
        raise ValueError(
            f"context_len: {context_len!r} is invalid; allowed: an integer in [1, {max_len}] "
            "(at most max_model_len)"
        )
    return context


def _device_bytes(device_memory_gib: float | None, spec: HardwareSpec | None) -> int:
    if device_memory_gib is not None:
        return int(device_memory_gib * GIB)
    if spec is not None and spec.memory_bytes:
        return spec.memory_bytes
    return int(DEFAULT_DEVICE_GIB * GIB)


def _model_figures(
    cfg: ModelConfig, element: int, kv_element: float, max_len: int
) -> dict[str, Any]:
    """The model's own shape and bytes, on one device (weights of `element` bytes, K/V of
    `kv_element`)."""
    per_token = kv_bytes_per_token(cfg, kv_element)
    mha_per_token = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * kv_element
    return {
        "layers": cfg.num_layers,
        "kv_heads": cfg.num_kv_heads,
        "heads": cfg.num_heads,
        "head_dim": cfg.head_dim,
        "kv_bytes_per_token": per_token,
        "gqa_saving": mha_per_token / per_token,
        "kv_bytes_per_sequence": per_token * max_len,
        "sliding_window": cfg.sliding_window,
        "global_layers": len(cfg.full_attention_layers) if cfg.sliding_window else cfg.num_layers,
        "weight_bytes": cfg.num_parameters() * element,
        "active_weight_bytes": cfg.num_parameters(active=True) * element,
    }


def _device_figures(
    cfg: ModelConfig,
    shard: TPShard,
    element: int,
    kv_element: float,
    max_len: int,
    device: int,
    gpu_memory_utilization: float,
    expert_parallel: bool = False,
) -> dict[str, Any]:
    """One device's share of the weights and of every token's KV, and the KV it holds."""
    weights_device = rank_params(cfg, shard).total * element
    per_token_device = kv_bytes_per_token_per_rank(cfg, shard, kv_element)
    usable = int(device * gpu_memory_utilization) - weights_device
    budget = max(0, usable)
    capacity = int(budget // per_token_device)
    return {
        "device_bytes": device,
        "gpu_memory_utilization": gpu_memory_utilization,
        "kv_budget_bytes": budget,  # per device
        "max_sequences": int(capacity // held_tokens(cfg, max_len)),
        # tensor parallelism: one device's share
        "tensor_parallel_size": shard.world_size,
        "allowed_tensor_parallel_sizes": allowed_tp_sizes(cfg, expert_parallel),
        "heads_per_device": shard.heads,
        "kv_heads_per_device": shard.kv_heads,
        "kv_replicas": shard.kv_replicas,
        "intermediate_per_device": shard.intermediate,
        "vocab_per_device": shard.vocab,
        "padded_vocab": shard.padded_vocab,
        "vocab_size": cfg.vocab_size,
        "weight_bytes_per_device": weights_device,
        "kv_bytes_per_token_per_device": per_token_device,
        "weights_fit": usable > 0,
        "usable_bytes": int(device * gpu_memory_utilization),
        "kv_capacity_tokens": capacity,  # per device, and so for the whole group
    }


def _moe_step(cfg: ModelConfig, shard: TPShard, batch: int) -> dict[str, Any]:
    """A decode step's experts on one device: one expert's parameters, the device's experts'
    (out of the blocks' weights), the step's (token, expert) pairs it computes, and the
    (layer, expert) pairs it touches if routing is uniform: each expert is missed by all
    `batch` tokens' k choices with probability (1 - k/E)^batch. Under expert parallelism a
    device holds E/N experts and computes the pairs routed to them, 1/N of all."""
    layers = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
    if not layers:
        return {"expert_params": 0, "all_expert_params": 0}
    experts, chosen, held = cfg.num_experts, cfg.num_experts_per_tok, shard.experts
    expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size
    touched = held * (1.0 - (1.0 - chosen / experts) ** batch)
    return {
        "expert_params": expert,
        "all_expert_params": layers * held * expert,
        "moe_expert_tokens": [float(layers * batch * chosen * held / experts)],
        "moe_experts_touched": layers * touched,
    }


def held_tokens(cfg: ModelConfig, length: int) -> float:
    """What paged KV holds of one sequence of `length` tokens, in tokens of every layer: each
    windowed layer keeps its window (a uniformly windowed model's table, or its group's in a
    hybrid cache: engines/builtin/kv_cache/groups.py), each global layer every token."""
    layers = range(cfg.num_layers)
    return sum(min(length, cfg.layer_window(i) or length) for i in layers) / cfg.num_layers


def _decode_batch(capacity: int, held: float, max_num_seqs: int | None) -> dict[str, Any]:
    """The sequences a decode step runs, each holding `held` tokens of KV (held_tokens): as
    many as the KV capacity holds, at most max_num_seqs."""
    fits = int(capacity // held)
    batch = fits if max_num_seqs is None else min(fits, max_num_seqs)
    return {
        "batch": batch,
        "batch_bound": "max_num_seqs" if batch < fits else "kv",
        "max_num_seqs": max_num_seqs,
    }


def _predict(
    cfg: ModelConfig,
    shard: TPShard,
    element: int,
    dtype: str,
    spec: HardwareSpec | None,
    r: dict[str, Any],
) -> dict[str, Any]:
    """The decode step of r["batch"] sequences of r["context_len"] tokens on one device: the
    roofline's FLOPs and bytes for it, its predicted time, and the collectives; empty without
    a spec or a batch."""
    batch, context = r["batch"], r["context_len"]
    if spec is None or batch < 1:
        return {}
    # each sequence has `context` tokens cached and decodes one more: in each layer it reads
    # them (at most window - 1 in a windowed layer), attends to them and itself, and writes
    # its own K/V; the counts are per layer on average (the step's columns are all layers')
    windows = [cfg.layer_window(i) for i in range(cfg.num_layers)]
    read = sum(context if w is None else min(context, w - 1) for w in windows) / len(windows)
    pairs = sum(context + 1 if w is None else min(context + 1, w) for w in windows) / len(windows)
    step = {
        "prefill_tokens": 0,
        "decode_tokens": batch,
        "logits_tokens": batch,
        "attention_pairs": batch * pairs,
        "kv_tokens_read": batch * read,
        "kv_tokens_written": batch,
    }
    predicted = predict_step(cfg, shard, element, dtype, spec, r, step)
    return {**predicted, "tokens_per_s": batch / predicted["step_s"]}


def predict_step(
    cfg: ModelConfig,
    shard: TPShard,
    element: int,
    dtype: str,
    spec: HardwareSpec,
    r: dict[str, Any],
    step: dict[str, float],
) -> dict[str, Any]:
    """One step's predicted time on one device of r's plan (kv_calc's report): `step` holds
    its token counts as a step row does (prefill_tokens, decode_tokens, logits_tokens,
    attention_pairs, kv_tokens_read, kv_tokens_written); the roofline's FLOPs and bytes for it
    (roofline.step_costs over a one-row step), max(compute, memory) with the spec's overlap,
    plus the collectives (harness/measuring/comm.py), not overlapped."""
    tokens = int(step["prefill_tokens"] + step["decode_tokens"])
    params = rank_params(cfg, shard)
    moe = _moe_step(cfg, shard, tokens)
    expert_params = moe.pop("expert_params")
    experts = moe.pop("all_expert_params")
    shape = ModelShape(
        block_linear_params=params.block_linear - experts,
        lm_head_params=params.lm_head_rows,
        attention_flops_per_pair=4 * cfg.num_layers * shard.heads * cfg.head_dim,
        block_linear_bytes=(params.block_linear - experts + params.block_bias) * element,
        lm_head_bytes=params.lm_head_rows * element,
        kv_bytes_per_token=r["kv_bytes_per_token_per_device"],
        dtype=dtype,
        moe_expert_params=expert_params,
        moe_expert_bytes=expert_params * element,
    )
    costs = step_costs(pd.DataFrame([{"padding_tokens": 0, **step, **moe}]), shape).iloc[0]
    moved = costs["weight_bytes_read"] + costs["kv_bytes_read"] + costs["kv_bytes_written"]
    memory_s = float(moved / spec.memory_bandwidth)
    peak = spec.flops_for(dtype)
    compute_s = None if peak is None else float(costs["flops"] / peak)
    compute_memory_s = (
        memory_s
        if compute_s is None
        else float(predicted_time(compute_s, memory_s, spec.overlap_for(dtype)))
    )
    comm = tp_decode_comm_bytes(cfg, tokens, element, shard.world_size, r["expert_parallel"])
    if tokens:  # the logits gathered are the rows sampled, not every token's
        comm = replace(comm, gather_bytes=comm.gather_bytes // tokens * int(step["logits_tokens"]))
    has_link = spec.link_bandwidth is not None and spec.link_latency is not None
    comm_s: float | None = 0.0
    if comm.total_bytes and has_link:
        assert spec.link_bandwidth is not None and spec.link_latency is not None
        comm_s = tp_decode_comm_seconds(comm, spec.link_bandwidth, spec.link_latency)
    elif comm.total_bytes:
        comm_s = None  # the spec states no link: communication is not counted
    return {
        "flops_per_device": float(costs["flops"]),
        "weight_bytes_read_per_device": float(costs["weight_bytes_read"]),
        "kv_bytes_moved_per_device": float(costs["kv_bytes_read"] + costs["kv_bytes_written"]),
        "memory_bandwidth": spec.memory_bandwidth,
        "peak_flops": peak,
        "overlap": spec.overlap_for(dtype),
        "link_bandwidth": spec.link_bandwidth,
        "link_latency": spec.link_latency,
        "memory_s": memory_s,
        "compute_s": compute_s,
        "allreduces": comm.allreduces,
        "allreduce_bytes": comm.allreduce_bytes,
        "gather_bytes": comm.gather_bytes,
        "comm_s": comm_s,
        "step_s": compute_memory_s + (comm_s or 0.0),
    }


# ---- output ---------------------------------------------------------------------------------


def _gib(x: float) -> str:
    return f"{x / GIB:,.2f} GiB ({int(x):,} B)"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:,.2f} ms"


def _rate(x: float) -> str:
    return f"{x / 1e12:,.2f} TB/s" if x >= 1e12 else f"{x / 1e9:,.1f} GB/s"


def _kv_heads(r: dict[str, Any]) -> str:
    if r["kv_replicas"] > 1:
        return f"{r['kv_heads_per_device']} (replicated on {r['kv_replicas']})"
    return f"{r['kv_heads_per_device']}"


def _no_fit(r: dict[str, Any]) -> str:
    larger = [n for n in r["allowed_tensor_parallel_sizes"] if n > r["tensor_parallel_size"]]
    return (
        f"none: the weights per device ({r['weight_bytes_per_device'] / GIB:,.2f} GiB) do not "
        f"fit in {r['gpu_memory_utilization']} x {r['device_bytes'] / GIB:,.2f} GiB"
        + (f"; try {TP_KEY}={'|'.join(map(str, larger))}" if larger else "")
    )


def format_report(r: dict[str, Any]) -> str:
    lines = [_title(r), *_model_lines(r)]
    if r["tensor_parallel_size"] > 1:
        lines += _per_device_lines(r)
    lines.append(
        f"  device memory          {_gib(r['device_bytes'])} x {r['gpu_memory_utilization']}"
    )
    if not r["weights_fit"]:
        lines.append(f"  left for KV            {_no_fit(r)}")
        return "\n".join(lines)
    lines += _kv_lines(r)
    if r["tensor_parallel_size"] == 1 and not r["hardware"]:
        return "\n".join(lines)  # the seeds' arithmetic, as it always printed
    lines += _decode_step_lines(r)
    return "\n".join(lines)


def _title(r: dict[str, Any]) -> str:
    n = r["tensor_parallel_size"]
    title = f"{r['model']} in {r['dtype']}, max_model_len={r['max_model_len']}"
    if r["kv_cache_dtype"] != "auto":
        title += f", kv_cache_dtype={r['kv_cache_dtype']}"
    if n > 1:
        title += f", {TP_KEY}={n}"
    if r["hardware"]:
        title += f", hardware={r['hardware']}"
    return title


def _model_lines(r: dict[str, Any]) -> list[str]:
    return [
        f"  KV bytes per token     2 x {r['layers']} layers x {r['kv_heads']} kv_heads x "
        f"{r['head_dim']} x {r['kv_element_bytes']:g} B = {r['kv_bytes_per_token']:,} B "
        f"({r['kv_bytes_per_token'] / 1024:,.0f} KiB; GQA {r['heads']}/{r['kv_heads']} heads "
        f"saves {r['gqa_saving']:.0f}x)",
        f"  KV bytes per sequence  {_gib(r['kv_bytes_per_sequence'])}",
        f"  weight bytes           {_gib(r['weight_bytes'])}",
    ]


def _per_device_lines(r: dict[str, Any]) -> list[str]:
    n = r["tensor_parallel_size"]
    per_token = r["kv_bytes_per_token_per_device"]
    vocab = f"vocab {r['vocab_per_device']:,} of {r['padded_vocab']:,}" + (
        f" (padded from {r['vocab_size']:,})" if r["padded_vocab"] != r["vocab_size"] else ""
    )
    mlp = (  # experts whole, split by expert parallelism; a dense MLP by its width
        f"{r['experts_per_device']} experts"
        if r["experts_per_device"]
        else f"intermediate {r['intermediate_per_device']:,}"
    )
    return [
        f"  per device (1 of {n})    {r['heads_per_device']} heads, {_kv_heads(r)} kv_heads, "
        f"{mlp}, {vocab}",
        f"    weight bytes         {_gib(r['weight_bytes_per_device'])}",
        f"    KV bytes per token   2 x {r['layers']} layers x {r['kv_heads_per_device']} "
        f"kv_heads x {r['head_dim']} x {r['kv_element_bytes']:g} B = {per_token:,} B "
        f"({per_token / 1024:,.0f} KiB)",
    ]


def _kv_lines(r: dict[str, Any]) -> list[str]:
    """What is left for KV and the sequences it holds; with tensor parallelism or a hardware
    spec, its capacity in tokens too."""
    n = r["tensor_parallel_size"]
    lines = [f"  left for KV            {_gib(r['kv_budget_bytes'])}"]
    if n > 1 or r["hardware"]:
        lines.append(
            f"  KV capacity            {r['kv_capacity_tokens']:,} tokens"
            + (" (each device holds its share of every token)" if n > 1 else "")
        )
    lines.append(
        f"  sequences that fit     {r['max_sequences']:,} of {r['max_model_len']} tokens each"
        + _window_note(r)
    )
    return lines


def _window_note(r: dict[str, Any]) -> str:
    if not r["sliding_window"]:
        return ""
    if r["global_layers"]:  # windowed layers between global ones (Gemma)
        windowed = r["layers"] - r["global_layers"]
        return (
            f"\n  (sliding window {r['sliding_window']} in {windowed} of {r['layers']} layers: "
            "paged KV keeps the window in those and every token in the global ones, one block "
            "table per kind (engine.hybrid_kv_cache); a decode reads at most the window in the "
            "windowed ones)"
        )
    return (
        f"\n  (sliding window {r['sliding_window']}: with paged KV a sequence holds at "
        f"most ~{r['sliding_window']} tokens of KV)"
    )


def _decode_step_lines(r: dict[str, Any]) -> list[str]:
    """The predicted decode step, or why there is none."""
    n = r["tensor_parallel_size"]
    if not r["hardware"]:
        return ["  (pick hardware=h100|h200|a100|l4|cpu for the predicted decode step)"]
    if r["batch"] < 1:
        return [f"  decode step            no sequence of {r['context_len']} tokens fits"]
    bound = (
        f"engine.max_num_seqs={r['max_num_seqs']}"
        if r["batch_bound"] == "max_num_seqs"
        else "the KV capacity"
    )
    lines = [
        f"  decode step            batch {r['batch']:,} (by {bound}) x {r['context_len']:,} "
        "tokens of context, per device:",
        f"    memory               {_ms(r['memory_s'])}  (weights "
        f"{r['weight_bytes_read_per_device'] / GIB:,.2f} GiB + KV "
        f"{r['kv_bytes_moved_per_device'] / GIB:,.2f} GiB at {_rate(r['memory_bandwidth'])})",
        f"    compute              {_ms(r['compute_s'])}"
        + (
            f"  ({r['flops_per_device'] / 1e12:,.2f} TFLOP at "
            f"{r['peak_flops'] / 1e12:,.1f} TFLOP/s {r['dtype']})"
            if r["peak_flops"]
            else f"  (the spec has no peak for {r['dtype']}: not counted)"
        ),
    ]
    if n > 1:
        lines.append(f"    communication        {_communication(r)}")
    return [
        *lines,
        f"    step                 {_ms(r['step_s'])} = {_step_formula([r])}"
        + (" + communication" if n > 1 else "")
        + (f" (overlap {r['overlap']:.2f})" if r["overlap"] != 1 else ""),
        f"    throughput           {r['tokens_per_s']:,.0f} tokens/s "
        f"({r['tokens_per_s'] / n:,.0f} per GPU)",
    ]


def _communication(r: dict[str, Any]) -> str:
    if r["comm_s"] is None:
        return "-  (the spec states no link_bandwidth / link_latency: not counted)"
    return (
        f"{_ms(r['comm_s'])}  ({r['allreduces']} all-reduces of "
        f"{r['allreduce_bytes'] / 2**20:,.2f} MiB + the logits gather, "
        f"{r['gather_bytes'] / 2**20:,.2f} MiB, at {_rate(r['link_bandwidth'])}, "
        f"{r['link_latency'] * 1e6:,.2f} us per hop; not overlapped)"
    )


TABLE_COLUMNS = (
    "hardware",
    "tp",
    "kv heads/GPU",
    "weights/GPU",
    "KV/token/GPU",
    "KV tokens",
    "seqs fit",
    "batch",
    "memory",
    "compute",
    "comm",
    "step",
    "tokens/s",
    "tokens/s/GPU",
)


def _row(r: dict[str, Any]) -> tuple[list[str], str]:
    """A table row's cells, and the message that stands for the rest when there are none."""
    n = r["tensor_parallel_size"]
    kv_heads = str(r["kv_heads_per_device"]) + (
        f" (x{r['kv_replicas']})" if r["kv_replicas"] > 1 else ""
    )
    cells = [
        r["hardware"] or "-",
        str(n),
        kv_heads,
        f"{r['weight_bytes_per_device'] / GIB:,.2f} GiB",
        f"{r['kv_bytes_per_token_per_device'] / 1024:,.0f} KiB",
    ]
    if not r["weights_fit"]:
        return cells, "weights do not fit"
    cells += [
        f"{r['kv_capacity_tokens']:,}",
        f"{r['max_sequences']:,}",
        f"{r['batch']:,}" + ("*" if r["batch_bound"] == "max_num_seqs" else ""),
    ]
    if "step_s" not in r:
        return cells, ("" if r["hardware"] else "(no hardware: no step time)")
    cells += [
        _ms(r["memory_s"]),
        _ms(r["compute_s"]),
        _ms(r["comm_s"] if n > 1 else 0.0),
        _ms(r["step_s"]),
        f"{r['tokens_per_s']:,.0f}",
        f"{r['tokens_per_s'] / n:,.0f}",
    ]
    return cells, ""


def _step_formula(reports: list[dict[str, Any]]) -> str:
    if all(r.get("overlap", 1.0) == 1.0 for r in reports):
        return "max(memory, compute)"
    # a measured spec (cpu) that does not hide one under the other: the roofline's own formula
    return "max(memory, compute) + (1 - overlap) x min(memory, compute)"


def format_table(reports: list[dict[str, Any]]) -> str:
    """One row per (hardware, tensor_parallel_size); a row whose weights do not fit says so
    in place of its remaining columns."""
    first = reports[0]
    rows = [(list(TABLE_COLUMNS), ""), *(_row(r) for r in reports)]
    widths = [max(len(c[i]) for c, _ in rows if i < len(c)) for i in range(len(TABLE_COLUMNS))]

    def line(cells: list[str], message: str) -> str:
        padded = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(cells)]
        return "  ".join([*padded, message] if message else padded).rstrip()

    capped = any(r["batch_bound"] == "max_num_seqs" for r in reports if r["weights_fit"])
    notes = [
        f"{first['model']} in {first['dtype']}, context {first['context_len']:,} tokens "
        f"(max_model_len {first['max_model_len']:,}), gpu_memory_utilization "
        f"{first['gpu_memory_utilization']}, max_num_seqs {first['max_num_seqs']}",
        "per GPU; batch: the sequences of that context the KV capacity holds"
        + (" (* capped by engine.max_num_seqs)" if capped else "")
        + f"; step = {_step_formula(reports)} + comm, not overlapped",
    ]
    return "\n".join([*notes, "", *(line(cells, message) for cells, message in rows)])


# ---- the command ----------------------------------------------------------------------------


def _split_args(args: list[str]) -> tuple[dict[str, Any], dict[str, list[str]], list[str]]:
    """(the command's own values, the list-valued keys' values, the remaining overrides)."""
    own: dict[str, Any] = {"device_memory_gib": None, "context_len": None}
    lists: dict[str, list[str]] = {}
    rest = []
    for arg in args:
        key, _, value = arg.partition("=")
        bare = key.lstrip("+")
        if bare == "device_memory_gib":
            try:
                own[bare] = float(value)
            except ValueError:
                own[bare] = float("nan")
            if not 0 < own[bare] <= MAX_DEVICE_GIB:  # also refuses NaN and inf (1e309)
                raise ValueError(
                    f"device_memory_gib: {value!r} is invalid; allowed: a number in "
                    f"(0, {MAX_DEVICE_GIB:.0f}]"
                )
        elif bare == "context_len":
            # ASCII digits, and few enough that int() takes them (it refuses 4300 and more)
            if not (value.isascii() and value.isdigit() and len(value) <= 18) or int(value) < 1:
                raise ValueError(
                    f"context_len: {value!r} is invalid; allowed: an integer in [1, max_model_len]"
                )
            own[bare] = int(value)
        elif bare in LIST_KEYS and "," in value:
            lists[key] = [v.strip() for v in value.split(",") if v.strip()]
        else:
            rest.append(arg)
    return own, lists, rest


#: engine options that change the bytes of weights, which kv-calc does not model: a quantized
#: value was planned as unquantized, a silently wrong plan (each with its plain value and
#: whether a value is plain). `auto` is plain: on a GPU it keeps a quantized file's integer
#: weights dequantized to engine.dtype, as planned (the CPU's C kernels keep them quantized, and
#: the Triton kernel an FP8 folder's: fewer bytes than planned, which a run reports as
#: weight_bytes). kv_cache_dtype is planned.
UNMODELLED: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "quantization": ("none", lambda value: LINEAR_METHODS.get(value).dense),
}


def _refuse_unmodelled(engine: dict[str, Any]) -> None:
    for key, (plain, is_plain) in UNMODELLED.items():
        value = engine.get(key, plain)
        if not is_plain(value):
            raise ValueError(
                f"engine.{key}: {value!r} is not planned by kv-calc, which counts weights and "
                f"KV in engine.dtype; allowed: {plain} (a run reports the bytes of a "
                "quantized model or KV cache: weight_bytes and kv_bytes_per_token in "
                "summary.json)"
            )


def composed(overrides: list[str]) -> tuple[dict[str, Any], dict[str, Any], HardwareSpec | None]:
    """The model and engine groups of one composed config, and its hardware spec (None for
    hardware=auto)."""
    cfg = OmegaConf.to_container(configs.compose(overrides), resolve=True)
    assert isinstance(cfg, dict)
    model, engine = cfg["model"], cfg["engine"]
    _refuse_unmodelled(engine)
    hw = hardware.validate_config(cfg.get("hardware"))
    spec = None if hw["name"] == "auto" else hardware.resolve(hw, None)[0]
    return model, engine, spec


def plan(overrides: list[str], own: dict[str, Any]) -> dict[str, Any]:
    """kv_calc for one composed config (`inferlab kv-calc`'s overrides)."""
    model, engine, spec = composed(overrides)
    return kv_calc(
        model_group_name(model),
        model.get("overrides"),
        engine.get("max_model_len"),
        engine.get("dtype", "auto"),
        own["device_memory_gib"],
        engine.get("gpu_memory_utilization", 0.9),
        # the field of engines/builtin/config.py's EngineConfig; 1 for a backend without it
        tensor_parallel_size=engine.get("tensor_parallel_size", 1),
        spec=spec,
        context_len=own["context_len"],
        max_num_seqs=engine.get("max_num_seqs"),
        expert_parallel=bool(engine.get("enable_expert_parallel", False)),
        kv_cache_dtype=engine.get("kv_cache_dtype", "auto"),
    )


USAGE = """usage: inferlab kv-calc [overrides...]

  model=NAME | model=hf model.path=DIR_OR_GGUF   the model (default: the default experiment's)
  engine.max_model_len=N engine.dtype=T          the sequence length and dtype planned
  engine.tensor_parallel_size=N[,N...]           per GPU over N devices (a list: a table)
  engine.enable_expert_parallel=true             an MoE model's experts split per GPU
  hardware=NAME[,NAME...]                        h100|h200|a100|l4|cpu: a predicted decode step
  device_memory_gib=GIB                          the device's memory (default: the hardware's,
                                                 else 80)
  context_len=N                                  the context of the predicted decode step
                                                 (default: max_model_len)

e.g. inferlab kv-calc model=llama3-8b engine.max_model_len=8192 engine.dtype=fp16 \\
         device_memory_gib=80"""


def main(args: list[str]) -> int:
    if any(arg in ("-h", "--help") for arg in args):
        print(USAGE)
        return 0
    try:
        own, lists, rest = _split_args(args)
        # hardware outermost: the rows of one GPU together, by tensor_parallel_size
        keys = sorted(lists, key=lambda k: LIST_KEYS.index(k.lstrip("+")))
        combos = itertools.product(*([f"{k}={v}" for v in lists[k]] for k in keys))
        reports = [plan([*rest, *combo], own) for combo in combos]
    except (configs.ComposeError, ValueError) as exc:  # each names its key
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(format_report(reports[0]) if not lists else format_table(reports))
    return 0
