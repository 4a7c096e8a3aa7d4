"""What beam search costs the built-in engine (issue 39): beam width 1/2/4/8 against as many
parallel samples (n = width, one prompt's KV shared) and as many separate requests (nothing
shared), in paged KV and, for beams, contiguous KV (a fork copies its parent's whole region);
alternating rounds in one process, medians.

    .venv/bin/python scripts/bench_beam_search.py [--model smollm2-135m] [--requests 4]
        [--prompt-len 128] [--output-len 32] [--widths 1 2 4 8] [--rounds 3] [--json F]

Per run: wall time; output tokens per second (returned tokens: one beam per request, every
sample of n); sequence-tokens per second (every row the steps computed); the peak of KV blocks
in use (paged) or bytes reserved (contiguous); the peak of blocks shared by several sequences;
K/V bytes copied (copy-on-write, or a contiguous fork's copy). Prints the CPU and a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

from engines.base import StepRecord
from engines.builtin import LLM, SamplingParams

BLOCK_SIZE = 16


def variants(width: int, output_len: int) -> dict[str, tuple[SamplingParams, int]]:
    """name -> (the parameters of each request, copies of each request sent)."""
    beams = SamplingParams(
        max_tokens=output_len, ignore_eos=True, use_beam_search=True, beam_width=width
    )
    samples = SamplingParams(max_tokens=output_len, ignore_eos=True, n=width, seed=0)
    single = SamplingParams(max_tokens=output_len, ignore_eos=True, seed=0)
    return {
        "beam": (beams, 1),
        f"n={width} samples": (samples, 1),
        f"{width} requests": (single, width),
    }


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, copies: int) -> dict:
    engine = llm.engine
    records: list[StepRecord] = []
    engine.step_observers.append(records.append)
    returned = 0
    try:
        start = time.perf_counter()
        for i, prompt in enumerate(prompts * copies):
            engine.add_request(f"r{time.perf_counter_ns()}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            for event in engine.step():
                returned += len(getattr(event, "token_ids", ()))
        wall = time.perf_counter() - start
    finally:
        engine.step_observers.remove(records.append)
    computed = sum(r.decode_tokens + r.prefill_tokens for r in records)
    return {
        "wall_s": wall,
        "output_tok_s": returned / wall,
        "computed_tok_s": computed / wall,
        "steps": len(records),
        "kv_blocks_peak": max(r.kv_blocks_used for r in records),
        "kv_reserved_peak_mb": max(r.kv_bytes_reserved for r in records) / 2**20,
        "kv_used_peak_mb": max(r.kv_bytes_used for r in records) / 2**20,
        "kv_shared_peak": max(r.kv_blocks_shared for r in records),
        "kv_copied_mb": sum(r.kv_bytes_copied for r in records) / 2**20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    for name in ("requests", "prompt_len", "output_len", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: must be >= 1")
    if min(args.widths) < 1:
        parser.error("--widths: each must be >= 1")
    prompts = [
        [100 + (i * 31 + j * 7) % 9000 for j in range(args.prompt_len)]
        for i in range(args.requests)
    ]
    options: dict[str, Any] = {
        "dtype": "float32",
        "max_model_len": args.prompt_len + args.output_len + BLOCK_SIZE,
        "block_size": BLOCK_SIZE,
        "max_num_seqs": args.requests * max(args.widths),
    }
    cells: dict[str, list[dict]] = {}
    with (
        LLM(args.model, kv_cache="paged", **options) as paged,
        LLM(args.model, kv_cache="contiguous", **options) as contiguous,
    ):
        for llm in (paged, contiguous):  # warm-up
            run(llm, prompts, variants(2, 4)["beam"][0], 1)
        for _ in range(args.rounds):  # alternating, so a noisy moment hits every variant
            for width in args.widths:
                for name, (params, copies) in variants(width, args.output_len).items():
                    key = f"{width}|paged|{name}"
                    cells.setdefault(key, []).append(run(paged, prompts, params, copies))
                key = f"{width}|contiguous|beam"
                params = variants(width, args.output_len)["beam"][0]
                cells.setdefault(key, []).append(run(contiguous, prompts, params, 1))
    cpu = platform.processor() or platform.machine()
    print(
        f"{args.model}, float32, CPU {cpu}, {args.requests} requests x {args.prompt_len}-token "
        f"prompts, {args.output_len} output tokens, block {BLOCK_SIZE}, "
        f"{args.rounds} alternating rounds (medians)"
    )
    header = (
        "width kv         variant        wall_s  out_tok/s  seq_tok/s  blocks_peak  "
        "reserved_MB  shared_peak  copied_MB"
    )
    print(header)
    medians: dict[str, dict[str, float]] = {}
    for key, runs in cells.items():
        medians[key] = {m: statistics.median(r[m] for r in runs) for m in runs[0]}
        width, kv, name = key.split("|")
        m = medians[key]
        print(
            f"{width:>5} {kv:10s} {name:13s} {m['wall_s']:7.2f} {m['output_tok_s']:10.1f} "
            f"{m['computed_tok_s']:10.1f} {m['kv_blocks_peak']:12.0f} "
            f"{m['kv_reserved_peak_mb']:12.2f} {m['kv_shared_peak']:12.0f} "
            f"{m['kv_copied_mb']:10.2f}"
        )
    if args.json:
        out = {"cpu": cpu, "args": vars(args), "medians": medians, "runs": cells}
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
