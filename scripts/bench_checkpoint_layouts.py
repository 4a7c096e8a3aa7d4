"""Which of the engine's exact layouts multiplies a GGUF file's 5-bit weights fastest: INT5
blocks (nibbles and a bit plane), INT8 blocks (a byte a level, Q5_0's symmetric form) and
grouped INT8, with float and INT8 activations, one decode row, SmolLM2's gate/up projection
(3072 x 576). Thirty distinct copies of the weight, so they stream from memory as a model's
layers do. engines/builtin/layers/checkpoint_quant.py orders its layouts by these figures.

    .venv/bin/python scripts/bench_checkpoint_layouts.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from engines.builtin.native import quant as native_quant

OUT, IN, COPIES = 3072, 576, 30


def per_call_ms(multiply_all: Callable[[], object], reps: int = 20) -> float:
    for _ in range(2):
        multiply_all()
    start = time.perf_counter()
    for _ in range(reps):
        multiply_all()
    return (time.perf_counter() - start) / reps / COPIES * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    levels = [torch.randint(0, 32, (OUT, IN), dtype=torch.uint8) for _ in range(COPIES)]
    d = (torch.rand(OUT, IN // 32) * 0.01).half()
    m = (-16 * d.float()).half()  # Q5_0's minimum
    int5 = [native_quant.pack_int5(q) for q in levels]
    int8b = [(q.to(torch.int16) - 16).to(torch.int8) for q in levels]
    scales, mins = d.float().contiguous(), m.float().contiguous()
    x = torch.randn(1, IN)
    for act in native_quant.ACTIVATIONS:
        layouts = {
            "int5 blocks": lambda a=act: [
                native_quant.int5_linear(x, n, f, d, m, activations=a) for n, f in int5
            ],
            "int8 blocks": lambda a=act: [
                native_quant.int8b_linear(x, q, d, activations=a) for q in int8b
            ],
            "grouped int8": lambda a=act: [
                native_quant.int8g_linear(x, q, scales, mins, 32, activations=a) for q in levels
            ],
        }
        times = "  ".join(f"{name} {per_call_ms(run):.3f} ms" for name, run in layouts.items())
        print(f"{args.threads} thread(s), {act} activations: {times}")


if __name__ == "__main__":
    main()
