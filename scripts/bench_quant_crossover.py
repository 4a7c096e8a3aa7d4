"""Where the INT8 / INT4 rows kernels stop beating dequantize-tile + GEMM (native/quant.py's
ROWS_MAX), per format, at 1 and 2 threads.

    .venv/bin/python scripts/bench_quant_crossover.py                 # SmolLM2-135M's layers
    .venv/bin/python scripts/bench_quant_crossover.py --model tinyllama-1.1b --rows 1,4,8,16

Times one pass over one decoder block's linear layers (random weights in the kernels' layouts)
with every row count through each kernel (`max_rows` forcing it) and prints the medians and
rows / tile: below 1 the rows kernels win. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_cpu_kernels import median_ms
from bench_linear_kernels import block_shapes

from engines.builtin.native import quant as native_quant

FORMATS = {"int4": (4, "float"), "int4 a8": (4, "int8"), "int8": (8, "float")}
# SmolLM2-135M's block (hidden 576, intermediate 1,536, 9 heads and 3 KV heads of 64): the real
# model issue 18's targets are set on, which has no dummy preset
SMOLLM2_BLOCK = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def block_pass(bits: int, activations: str, shapes: list[tuple[int, int]], rows: int):
    """A function per kernel choice (rows kernels, tiles) running every layer once."""
    gen = torch.Generator().manual_seed(0)
    calls: dict[str, list[Callable[[], object]]] = {"rows": [], "tile": []}
    for fan_in, fan_out in shapes:
        x = torch.randn(rows, fan_in, generator=gen)
        if bits == 4:
            nibbles = native_quant.pack_int4(torch.randint(0, 16, (fan_out, fan_in), generator=gen))
            scales = torch.rand(fan_out, fan_in // 32, generator=gen)
            mins = torch.rand(fan_out, fan_in // 32, generator=gen)
            for kind, max_rows in (("rows", rows), ("tile", 0)):
                calls[kind].append(
                    lambda x=x, n=nibbles, s=scales, m=mins, r=max_rows: native_quant.int4_linear(
                        x, n, s, m, 32, activations=activations, max_rows=r
                    )
                )
        else:
            q = torch.randint(-127, 128, (fan_out, fan_in), dtype=torch.int8, generator=gen)
            scales = torch.rand(fan_out, generator=gen)
            for kind, max_rows in (("rows", rows), ("tile", 0)):
                calls[kind].append(
                    lambda x=x, q=q, s=scales, r=max_rows: native_quant.int8_linear(
                        x, q, s, max_rows=r
                    )
                )
    return {kind: (lambda fns=fns: [fn() for fn in fns]) for kind, fns in calls.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m or a preset")
    parser.add_argument("--rows", default="1,2,4,6,8,12,16,24,32")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    shapes = SMOLLM2_BLOCK if args.model == "smollm2-135m" else block_shapes(args.model)[:4]
    rows_list = [int(r) for r in args.rows.split(",")]
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        print(f"{args.model}, one block, {threads} thread(s): rows ms / tile ms (ratio)")
        for rows in rows_list:
            cells = []
            for label, (bits, activations) in FORMATS.items():
                passes = block_pass(bits, activations, shapes, rows)
                rows_ms = median_ms(passes["rows"], args.repeats)
                tile_ms = median_ms(passes["tile"], args.repeats)
                cells.append(f"{label} {rows_ms:6.3f} / {tile_ms:6.3f} ({rows_ms / tile_ms:4.2f})")
            print(f"  {rows:3d} rows  " + "   ".join(cells), flush=True)
        print("current crossovers:", {k: native_quant.rows_max(*v) for k, v in FORMATS.items()})


if __name__ == "__main__":
    main()
