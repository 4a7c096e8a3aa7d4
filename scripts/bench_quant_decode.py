"""Batch-1 decode tokens/s for weight quantization variants, interleaved in one process.

    python scripts/bench_quant_decode.py --model small --dtype bfloat16 --rounds 3

Decode time = time(1 + N tokens) - time(1 token), so prefill cancels. Prints medians and
ratios against the unquantized engine, plus the bytes of the blocks' linear layers.
"""

from __future__ import annotations

import argparse
import statistics
import time

from engines.builtin import LLM, SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="bfloat16")
    # quantization[+head][+noprepack]: +head quantizes the LM head too (quantize_lm_head),
    # +noprepack runs dense layers on torch's plain GEMM (prepack_weights=false)
    parser.add_argument("--variants", default="none,int8,int4")
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    prompt = list(range(10, 42))

    def build(variant: str) -> LLM:
        quantization, *flags = variant.split("+")
        unknown = set(flags) - {"head", "noprepack"}
        if unknown:
            raise SystemExit(
                f"--variants: unknown flag(s) {sorted(unknown)} in {variant!r}; "
                "allowed: +head, +noprepack"
            )
        return LLM(
            args.model,
            dtype=args.dtype,
            quantization=quantization,
            max_model_len=256,
            max_num_seqs=1,
            quantization_group_size=args.group_size,
            quantize_lm_head="head" in flags,
            prepack_weights="noprepack" not in flags,
        )

    engines = {v: build(v) for v in args.variants.split(",")}

    def decode_rate(llm: LLM) -> float:
        def timed(n: int) -> float:
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))
            return time.perf_counter() - start

        return args.new_tokens / (timed(args.new_tokens + 1) - timed(1))

    for llm in engines.values():
        decode_rate(llm)  # warm-up
    rates: dict[str, list[float]] = {v: [] for v in engines}
    for _ in range(args.rounds):
        for v, llm in engines.items():
            rates[v].append(decode_rate(llm))
    base = statistics.median(rates[next(iter(rates))])
    print(
        f"model={args.model} dtype={args.dtype} new_tokens={args.new_tokens} rounds={args.rounds}"
    )
    for v, values in rates.items():
        med = statistics.median(values)
        linear = engines[v].engine.describe()["linear_weight_bytes"]
        print(
            f"  {v:14s} {med:7.2f} tok/s  x{med / base:4.2f}   linear weights "
            f"{linear / 2**20:8.1f} MiB   runs: " + ", ".join(f"{x:.1f}" for x in values)
        )


if __name__ == "__main__":
    main()
