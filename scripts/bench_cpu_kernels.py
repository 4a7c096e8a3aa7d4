"""The engine's C kernels (engines/builtin/native) against the torch ops they replace, on the
small preset's shapes, fp32, at torch's thread count.

    .venv/bin/python scripts/bench_cpu_kernels.py
    .venv/bin/python scripts/bench_cpu_kernels.py --rows 1,16,64 --repeats 200

Linear layers: the small preset's 49 matmuls of a step (12 layers' QKV, output, gate-up and
down projections, and the LM head) over weights far larger than the caches, at each --gemm-rows
count: the engine's GEMM over its panels against oneDNN's packed GEMM and torch's plain one
(F.linear), the three passes alternated, median over --gemm-repeats.

Decode attention: 12 layers' K/V in caches laid out as the engine's (contiguous layout, 2 MB
pages as `kv_cache_prefault` maps them), one query per sequence; the C kernel against
torch's SDPA over the same in-place views (what attention_backend=sdpa does), median over
--repeats passes. Prompt attention: one layer's prompts (no cached context), q/k/v as views of
the fused QKV rows; the C kernel (one call for all) against SDPA one prompt at a time (the sdpa
backend). Elementwise ops (RMSNorm with the residual add, SiLU-and-multiply, rotary +
K/V store) are timed right after a matmul over a 12 MB weight, the way they run in a layer
(the matmul leaves the caches cold), and hot (the same op again); both sides include their
Python call (the kernels' argument checks, torch's dispatch). The kernels work in place
(the residual stream, the QKV rows), as in the model.
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.builtin import native
from engines.builtin.kv_cache.storage import zeros
from engines.builtin.layers.linear import PrepackedDenseMethod
from engines.builtin.layers.rotary import RotaryEmbedding, apply_rotary
from models.config import PRESETS


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def alternated_median_ms(passes: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Each pass once to warm up, then `repeats` rounds of all of them in turn (the machine's
    drift hits every pass alike); the median ms of each."""
    for run in passes.values():
        run()
    times: dict[str, list[float]] = {name: [] for name in passes}
    for _ in range(repeats):
        for name, run in passes.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}


def matmuls(rows_list: list[int], repeats: int) -> list[tuple[int, float, float, float]]:
    """(rows, plain ms, oneDNN packed ms, engine GEMM ms) for a step's 49 matmuls."""
    cfg = PRESETS["small"]
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    per_layer = [
        (cfg.q_size + 2 * cfg.kv_size, hidden),
        (hidden, cfg.q_size),
        (2 * inter, hidden),
        (hidden, inter),
    ]  # (out, in)
    shapes = per_layer * cfg.num_layers + [(cfg.vocab_size, hidden)]
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(shape, generator=generator) * 0.02 for shape in shapes]
    onednn = [
        torch.ops.mkldnn._reorder_linear_weight(w, PrepackedDenseMethod.PACK_FOR_ROWS)
        for w in weights
    ]
    panels = [native.pack_linear_weight(w) for w in weights]
    out = []
    for rows in rows_list:
        xs = [torch.randn(rows, w.shape[1], generator=generator) for w in weights]
        passes: dict[str, Callable[[], object]] = {
            "plain": lambda xs=xs: [F.linear(x, w) for x, w in zip(xs, weights, strict=True)],
            "onednn": lambda xs=xs: [
                torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], "")
                for x, p in zip(xs, onednn, strict=True)
            ],
            "engine": lambda xs=xs: [
                native.linear(x, p, w.shape[0]) for x, p, w in zip(xs, panels, weights, strict=True)
            ],
        }
        medians = alternated_median_ms(passes, repeats)
        out.append((rows, *medians.values()))
    return out


def attention(batch: int, keys: int, repeats: int) -> tuple[float, float]:
    cfg = PRESETS["small"]
    heads, dim, layers = cfg.num_heads, cfg.head_dim, cfg.num_layers
    slot = keys + 64
    cpu = torch.device("cpu")
    caches = [
        tuple(
            zeros((batch, slot, heads, dim), torch.float32, cpu, True).normal_() for _ in range(2)
        )
        for _ in range(layers)
    ]
    q = torch.randn(batch, heads, dim)
    tables = torch.arange(batch, dtype=torch.int32).view(batch, 1)
    lens = torch.full((batch,), keys, dtype=torch.int32)

    def sdpa() -> None:
        for k, v in caches:
            F.scaled_dot_product_attention(
                q.unsqueeze(2),
                k[:, :keys].transpose(1, 2),
                v[:, :keys].transpose(1, 2),
                scale=dim**-0.5,
            )

    def kernel() -> None:
        for k, v in caches:
            native.decode_attention(q, k, v, tables, lens, dim**-0.5, None, keys)

    return median_ms(sdpa, repeats), median_ms(kernel, repeats)


def prompt_attention(lengths: list[int], repeats: int) -> tuple[float, float]:
    """One layer's attention for whole prompts of these lengths, q/k/v as views of the fused
    QKV rows: torch's SDPA one prompt at a time (the sdpa backend) against the C kernel, one
    call for all. Alternated; medians in ms."""
    cfg = PRESETS["small"]
    heads, dim = cfg.num_heads, cfg.head_dim
    tokens = sum(lengths)
    qkv = torch.randn(tokens, 3 * heads * dim)
    q, k, v = (t.view(tokens, heads, dim) for t in qkv.split(heads * dim, dim=1))
    bounds = [0, *itertools.accumulate(lengths)]
    starts = torch.tensor(bounds, dtype=torch.int32)

    def sdpa() -> None:
        out = torch.empty_like(q)
        for a, b in itertools.pairwise(bounds):
            # [1, h, n, d], as the dense path calls it (3-d inputs miss the flash kernel)
            out[a:b] = F.scaled_dot_product_attention(
                *(t[a:b].transpose(0, 1)[None] for t in (q, k, v)), is_causal=True, scale=dim**-0.5
            )[0].transpose(0, 1)

    def kernel() -> None:
        native.prefill_attention(q, k, v, starts, dim**-0.5, None)

    medians = alternated_median_ms({"sdpa": sdpa, "kernel": kernel}, repeats)
    return medians["sdpa"], medians["kernel"]


def cold_and_hot(
    op: Callable[[], object], weight: torch.Tensor, x: torch.Tensor, repeats: int
) -> tuple[float, float]:
    cold, hot = [], []
    for _ in range(repeats):
        F.linear(x, weight)  # streams 12 MB through the caches
        t0 = time.perf_counter()
        op()
        t1 = time.perf_counter()
        op()
        t2 = time.perf_counter()
        cold.append(t1 - t0)
        hot.append(t2 - t1)
    return 1e6 * statistics.median(cold), 1e6 * statistics.median(hot)


def elementwise(rows: int, repeats: int) -> list[tuple[str, float, float, float, float]]:
    cfg = PRESETS["small"]
    hidden, inter, heads, dim = cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.head_dim
    weight = torch.randn(4096, hidden)
    x, residual, norm_w = torch.randn(rows, hidden), torch.randn(rows, hidden), torch.ones(hidden)
    gate_up = torch.randn(rows, 2 * inter)
    rope = RotaryEmbedding(dim, 512, cfg.rope_theta, None, torch.device("cpu"))
    positions = torch.arange(rows) + 7
    qkv = torch.randn(rows, 3 * heads * dim)
    k_cache, v_cache = torch.zeros(512, heads, dim), torch.zeros(512, heads, dim)
    slots = torch.arange(rows) * 3

    rotation = rope.rotation(positions)  # looked up once per step, as in the model
    rotation.factors(torch.float32)

    def torch_rope() -> None:
        qk, v = qkv.split([2 * heads * dim, heads * dim], dim=-1)
        rotated = apply_rotary(qk.view(rows, 2 * heads, dim), rotation)
        k_cache.index_copy_(0, slots, rotated[:, heads:])
        v_cache.index_copy_(0, slots, v.view(rows, heads, dim))

    ops = {
        "add + RMSNorm": (
            lambda: F.rms_norm(x + residual, (hidden,), norm_w, eps=1e-6),
            lambda: native.rms_norm(x, norm_w, 1e-6, residual),
        ),
        "SiLU-and-multiply": (
            lambda: F.silu(gate_up[:, :inter]) * gate_up[:, inter:],
            lambda: native.silu_and_mul(gate_up),
        ),
        "rotary + K/V store": (
            torch_rope,
            lambda: native.rope_and_cache(
                qkv, positions, rope.cos_sin_table, heads, heads, dim, k_cache, v_cache, slots
            ),
        ),
    }
    out = []
    for name, (reference, kernel) in ops.items():
        out.append(
            (
                name,
                *cold_and_hot(reference, weight, x, repeats),
                *cold_and_hot(kernel, weight, x, repeats),
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,16,64", help="rows (tokens) for the elementwise ops")
    parser.add_argument(
        "--attention",
        default="1x48,16x48,64x48,64x200",
        help="sequences x keys for decode attention",
    )
    parser.add_argument(
        "--prompts",
        default="15x0,4x512,1x2000",
        help="prompts x tokens for prompt attention (0 tokens: 64-192 each)",
    )
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument(
        "--gemm-rows",
        default="1,2,4,8,16,32,64,128,256,2000",
        help="input rows for the linear layers",
    )
    parser.add_argument("--gemm-repeats", type=int, default=7)
    args = parser.parse_args()
    if native.load() is None:
        raise SystemExit(f"the C kernels did not build: {native.reason()}")
    print(f"{torch.get_num_threads()} threads")
    print(
        "\nlinear layers, a step's 49 matmuls (ms): plain  oneDNN packed  engine  "
        "engine/oneDNN  engine/plain"
    )
    rows_list = [int(r) for r in args.gemm_rows.split(",")]
    for rows, plain, onednn, engine in matmuls(rows_list, args.gemm_repeats):
        print(
            f"  {rows:5d} rows {plain:9.2f} {onednn:9.2f} {engine:9.2f} "
            f"{engine / onednn:9.2f} {engine / plain:9.2f}"
        )
    print("\ndecode attention, 12 layers (ms):  sdpa  C kernel  ratio")
    for item in args.attention.split(","):
        batch, keys = (int(v) for v in item.split("x"))
        sdpa, kernel = attention(batch, keys, args.repeats)
        print(f"  {batch:3d} x {keys:3d} keys {sdpa:9.2f} {kernel:9.2f} {kernel / sdpa:6.2f}")
    print("\nprompt attention, one layer (ms):  sdpa  C kernel  ratio")
    for item in args.prompts.split(","):
        count, length = (int(v) for v in item.split("x"))
        lengths = (
            [length] * count
            if length
            # 0: the vs_hf workload's 64-192 tokens
            else [random.Random(i).randint(64, 192) for i in range(count)]
        )
        sdpa, kernel = prompt_attention(lengths, args.repeats)
        label = f"{count} x {length or '64-192'}"
        print(f"  {label:>10s} tokens {sdpa:8.2f} {kernel:9.2f} {kernel / sdpa:6.2f}")
    print("\nelementwise (us): torch after a matmul / hot, C kernel after a matmul / hot")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, t_cold, t_hot, k_cold, k_hot in elementwise(rows, 10 * args.repeats):
            print(
                f"  {rows:3d} rows {name:20s} {t_cold:7.1f} / {t_hot:6.1f}   "
                f"{k_cold:7.1f} / {k_hot:6.1f}"
            )


if __name__ == "__main__":
    main()
