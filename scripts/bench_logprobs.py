"""What log-probabilities cost the built-in engine (issue 39): decode with `logprobs=20` against
none, and a prompt's prefill with `prompt_logprobs` against none, side by side in one process,
alternating rounds; medians and their ratios.

    .venv/bin/python scripts/bench_logprobs.py [--model smollm2-135m] [--batch 8]
        [--output-len 64] [--prompt-len 512] [--rounds 5] [--threads N] [--json F]

Decode: `batch` requests of a 32-token prompt decode `output-len` tokens; the median time per
output step (the engine's own step timestamps). Prefill: one `prompt-len`-token prompt, one
output token: the median time of its prefill step, where the LM head runs over every prompt
position when prompt logprobs are asked. Prints the CPU, each variant's median and the ratio.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from engines.builtin import LLM, SamplingParams

DECODE_VARIANTS = {"none": None, "logprobs=20": 20}
PREFILL_VARIANTS = {"none": None, "prompt_logprobs=0": 0, "prompt_logprobs=20": 20}


def step_times(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[float]:
    """Seconds of each engine step that produced tokens (decode or prefill), in order."""
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{time.perf_counter_ns()}-{i}", prompt, params)
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def decode_round(llm: LLM, args: argparse.Namespace, logprobs: int | None) -> float:
    prompts = [[100 + (i * 7 + j) % 900 for j in range(32)] for i in range(args.batch)]
    params = SamplingParams(
        max_tokens=args.output_len, temperature=0.0, ignore_eos=True, logprobs=logprobs
    )
    times = step_times(llm, prompts, params)
    return statistics.median(times[1:])  # the first step is the prefill


def prefill_round(llm: LLM, args: argparse.Namespace, prompt_logprobs: int | None) -> float:
    prompt = [[100 + j % 900 for j in range(args.prompt_len)]]
    params = SamplingParams(
        max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=prompt_logprobs
    )
    return step_times(llm, prompt, params)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    for name in ("batch", "output_len", "prompt_len", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    options: dict[str, Any] = {"dtype": "float32", "max_model_len": args.prompt_len + 64}
    if args.threads:
        options["num_threads"] = args.threads
    out: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "args": vars(args)}
    with LLM(args.model, **options) as llm:
        decode_round(llm, args, None)  # warm-up
        prefill_round(llm, args, None)
        decode: dict[str, list[float]] = {name: [] for name in DECODE_VARIANTS}
        prefill: dict[str, list[float]] = {name: [] for name in PREFILL_VARIANTS}
        for _ in range(args.rounds):  # alternating, so a noisy moment hits every variant
            for name, k in DECODE_VARIANTS.items():
                decode[name].append(decode_round(llm, args, k))
            for name, k in PREFILL_VARIANTS.items():
                prefill[name].append(prefill_round(llm, args, k))
    print(f"{args.model}, float32, CPU {out['cpu']}, {args.rounds} alternating rounds")
    for title, table in (("decode step", decode), ("prefill step", prefill)):
        base = statistics.median(table["none"])
        for name, values in table.items():
            median = statistics.median(values)
            print(f"  {title:12s} {name:20s} {median * 1e3:8.2f} ms  x{median / base:.3f}")
    out["decode_s"], out["prefill_s"] = decode, prefill
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
