"""Batch-1 time of a preset's decoder-block linear layers per weight format, at 1 and 2 threads.

    .venv/bin/python scripts/bench_linear_kernels.py                         # small, bf16
    .venv/bin/python scripts/bench_linear_kernels.py --model tinyllama-1.1b --rows 1,4
    .venv/bin/python scripts/bench_linear_kernels.py --dtype float32 --rows 1,16,128

Builds every block linear layer of the preset (one x [rows, in] per layer) through the
engine's own linear methods and times one pass over all of them (median of --repeats). With
bf16 activations (issue 5): bf16 plain GEMM, bf16 oneDNN-prepacked, INT8 per channel
(`aten._weight_int8pack_mm`), INT4 group 128 (`aten._weight_int4pack_mm_for_cpu`). With
float32 (issue 18): the float32 GEMM (the engine's panels; one row: torch's GEMV), torch's INT8
and INT4 g32 kernels, and the engine's own (native/quant.py): INT8, INT4 g32, INT4 g32 with
INT8 activations. Prints ms, the weight bytes streamed per second, and the 2-thread / 1-thread
speed-up: near 1 a kernel is bound by memory (a second core adds no bandwidth), near 2 it is
bound by the work each core does per byte. That tells whether a weight format's bytes saving
can show up as speed on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engines.builtin.layers import make_linear_method
from engines.builtin.layers.linear import Linear
from models.config import PRESETS

# label -> (quantization, prepacked layout, group size, activations, the engine's C kernels)
FORMATS = {
    "bfloat16": {
        "bf16 plain": ("none", None, 128, "float", False),
        "bf16 prepacked": ("none", "onednn", 128, "float", False),
        "int8": ("int8", None, 128, "float", False),
        "int4 g128": ("int4", None, 128, "float", False),
    },
    "float32": {
        "fp32 panels": ("none", "panels", 32, "float", False),
        "int8 torch": ("int8", None, 32, "float", False),
        "int4 g32 torch": ("int4", None, 32, "float", False),
        "int8 native": ("int8", None, 32, "float", True),
        "int4 g32 native": ("int4", None, 32, "float", True),
        "int4 g32 a8": ("int4", None, 32, "int8", True),
    },
}


def block_shapes(model: str) -> list[tuple[int, int]]:
    """(in, out) of every decoder-block linear layer, in forward order."""
    cfg = PRESETS[model]
    per_layer = [
        (cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size),
        (cfg.q_size, cfg.hidden_size),
        (cfg.hidden_size, 2 * cfg.intermediate_size),
        (cfg.intermediate_size, cfg.hidden_size),
    ]
    return per_layer * cfg.num_layers


def build(
    shapes: list[tuple[int, int]], dtype: torch.dtype, fmt: tuple[str, str | None, int, str, bool]
) -> list[Linear]:
    quantization, prepack, group, activations, native = fmt
    layers = []
    generator = torch.Generator().manual_seed(0)
    for i, (fan_in, fan_out) in enumerate(shapes):
        method = make_linear_method(
            quantization,
            group,
            prepack,
            activations=activations,
            native_reason=None if native else "not asked (torch's kernels)",
        )
        layer = Linear(fan_in, fan_out, method)
        layer.name = f"block_linear_{i}"
        weight = torch.randn(fan_out, fan_in, generator=generator) * fan_in**-0.5
        layer.load(weight.to(dtype))
        layers.append(layer)
    return layers


def time_pass(layers: list[Linear], rows: int, repeats: int, dtype: torch.dtype) -> float:
    sizes = {layer.in_features for layer in layers}
    inputs = {n: torch.randn(rows, n, dtype=dtype) for n in sizes}

    def one_pass() -> None:
        for layer in layers:
            layer(inputs[layer.in_features])

    for _ in range(3):
        one_pass()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        one_pass()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small", choices=sorted(PRESETS))
    parser.add_argument("--rows", default="1", help="comma-separated batch rows (default 1)")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(FORMATS))
    parser.add_argument(
        "--formats", default=None, help="comma-separated labels of --dtype's formats (default all)"
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    shapes = block_shapes(args.model)
    threads = sorted(int(t) for t in args.threads.split(","))
    print(
        f"{args.model}: {len(shapes)} block linear layers, {args.dtype} activations; median of "
        f"{args.repeats} passes\n"
    )
    print(
        f"{'format':<16}{'rows':>5}{'weight MiB':>12}"
        + "".join(f"{f'{t}t ms':>10}{f'{t}t GB/s':>10}" for t in threads)
        + f"{'speed-up':>10}"
    )
    with torch.inference_mode():
        formats = FORMATS[args.dtype]
        chosen = args.formats.split(",") if args.formats else list(formats)
        unknown = sorted(set(chosen) - set(formats))
        if unknown:
            raise SystemExit(f"--formats: unknown {unknown}; allowed: {','.join(formats)}")
        for label in chosen:
            layers = build(shapes, dtype, formats[label])
            nbytes = sum(layer.weight_bytes() for layer in layers)
            for rows in (int(r) for r in args.rows.split(",")):
                seconds = []
                for count in threads:
                    torch.set_num_threads(count)
                    seconds.append(time_pass(layers, rows, args.repeats, dtype))
                cells = "".join(f"{1e3 * s:>10.2f}{nbytes / s / 1e9:>10.1f}" for s in seconds)
                print(
                    f"{label:<16}{rows:>5}{nbytes / 2**20:>12.1f}{cells}"
                    f"{seconds[0] / seconds[-1]:>10.2f}"
                )
            del layers


if __name__ == "__main__":
    main()
