"""Roofline-predicted vs measured decode step time across batch sizes (issue 6's target: within
1.5x of measured for batch sizes 1-64 on the small preset), plus batch-1 decode MBU.

    .venv/bin/python scripts/bench_roofline.py                       # small, fp32, CPU, 1..64
    .venv/bin/python scripts/bench_roofline.py --model tiny --batch-sizes 1,2 --decode-tokens 4

Each batch size B is one harness run (`run_experiment`, a run folder under --out): B requests
of --prompt-len tokens arrive at once, each decodes --decode-tokens tokens, max_num_seqs=B, so
every step after the prefill is a decode step of B sequences. The CPU is probed first (fresh,
at the engine's thread count; the result is cached for later runs). Per batch size the table
shows medians over the decode-only steps: measured step time (end - start, the MBU/MFU
denominator), the forward alone, the roofline prediction (with the probe's measured overlap of
compute and memory time) and measured/predicted, the standard max(compute, memory) roofline
and measured/that, the bound, and mean MBU/MFU. Writes bench_roofline.csv next to the run folders.
Exit status 0 when every batch size is within the target, 1 otherwise (`make check-roofline`).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch
import yaml
from script_args import refuse

from harness.arguments import at_least, integers_at_least
from harness.measuring import hardware
from harness.measuring.roofline import decode_only, measured_step_s
from harness.run_folder import has_summary
from harness.running.experiment import run_experiment

TARGET = 1.5
TABLE_FILE = "bench_roofline.csv"


def results_held(out: Path) -> list[str]:
    """What an earlier measurement left in `out` that this one would replace: its table and
    its run folders (any batch size: the table would no longer say which are whose)."""
    held = sorted(p.name for p in out.glob("batch-*") if has_summary(p))
    if (out / TABLE_FILE).exists():
        held.append(TABLE_FILE)
    return held


def run_batch(args: argparse.Namespace, batch: int, threads: int, out: Path) -> dict[str, Any]:
    config = {
        "engine": {
            "backend": "builtin",
            "dtype": args.dtype,
            "device": "cpu",
            "num_threads": threads,
            "max_num_seqs": batch,
            "max_model_len": args.prompt_len + args.decode_tokens + 8,
            "kv_cache": "contiguous",
            **args.engine_option,
        },
        "model": {"name": args.model},
        "workload": {
            "type": "synthetic",
            "num_requests": batch,
            "input_len": args.prompt_len,
            "output_len": args.decode_tokens,
            "arrival": {"process": "offline"},
        },
        "hardware": {"name": "cpu"},
        "run": {"warmup_requests": args.warmup_requests},
    }
    run_dir = out / f"batch-{batch}"
    summary = run_experiment(config, run_dir, progress=False)
    if summary.get("error_kind") == "config":  # a typo in --model or --engine-option
        refuse(summary["error"])
    if summary["status"] != "complete":
        raise SystemExit(f"batch {batch}: run {summary['status']}: {summary['error']}")
    steps = pd.read_parquet(run_dir / "steps.parquet")
    decodes = steps[decode_only(steps) & (steps["num_decode_seqs"] == batch)]
    if decodes.empty:
        raise SystemExit(f"batch {batch}: no decode step ran all {batch} sequences")
    measured = float(measured_step_s(decodes).median())
    predicted = float(decodes["predicted_s"].median())
    spec = summary["hardware"]
    compute = decodes["flops"] / spec["peak_flops"][summary["engine"]["dtype"]]
    memory = (
        decodes["weight_bytes_read"] + decodes["kv_bytes_read"] + decodes["kv_bytes_written"]
    ) / spec["memory_bandwidth"]
    compute_s, memory_s = float(compute.median()), float(memory.median())
    max_roofline_s = float(np.fmax(compute, memory).median())
    return {
        "batch": batch,
        "decode_steps": len(decodes),
        "measured_ms": 1e3 * measured,
        "forward_ms": 1e3 * float(decodes["forward_s"].median()),
        "predicted_ms": 1e3 * predicted,
        "ratio": measured / predicted,
        # the standard roofline, max(compute, memory), whatever overlap the spec measured
        "max_roofline_ms": 1e3 * max_roofline_s,
        "max_roofline_ratio": measured / max_roofline_s,
        "bound": "compute" if compute_s > memory_s else "memory",
        "mbu": float(decodes["mbu"].mean()),
        "mfu": float(decodes["mfu"].mean()),
        "within_target": 1 / TARGET <= measured / predicted <= TARGET,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch-sizes", type=integers_at_least(1), default="1,2,4,8,16,32,64")
    parser.add_argument("--prompt-len", type=at_least(1), default=32)
    parser.add_argument("--decode-tokens", type=at_least(2), default=32)
    parser.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an engine option for every run, e.g. native_kernels=false "
        "(repeatable; values parsed as YAML)",
    )
    parser.add_argument("--warmup-requests", type=at_least(0), default=2)
    parser.add_argument(
        "--threads",
        type=at_least(1),
        default=None,
        help="torch threads for the engine and the probe (default: torch's)",
    )
    parser.add_argument(
        "--no-reprobe",
        action="store_true",
        help="use the cached CPU probe instead of measuring it again first",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="folder for the run folders (default results/bench_roofline/<now>)",
    )
    args = parser.parse_args()
    options = {}
    for item in args.engine_option:
        key, sep, value = item.partition("=")
        if not sep:
            parser.error(f"--engine-option: expected KEY=VALUE, got {item!r}")
        options[key] = yaml.safe_load(value)
    args.engine_option = options
    batches = args.batch_sizes

    out = Path(args.out or f"results/bench_roofline/{time.strftime('%Y-%m-%d_%H-%M-%S')}")
    held = results_held(out)
    if held:
        refuse(
            f"--out: {out} already holds {', '.join(held)}; nothing was written. Choose a new "
            "folder, or leave --out out for a new dated one"
        )
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    spec = hardware.cpu_spec(reprobe=not args.no_reprobe)
    print(
        f"cpu probe ({threads} threads, {spec.details['cache_file']}): "
        f"memory bandwidth {spec.memory_bandwidth / 1e9:.1f} GB/s, "
        + ", ".join(
            f"{k} {v / 1e9:.0f} GFLOP/s (overlap {spec.overlap_for(k):.2f})"
            for k, v in spec.peak_flops.items()
        )
    )
    flops = spec.flops_for(args.dtype.replace("fp32", "float32").replace("bf16", "bfloat16"))
    if flops:
        print(f"ridge: {flops / spec.memory_bandwidth:.1f} FLOP/byte for {args.dtype}")

    out.mkdir(parents=True, exist_ok=True)
    rows = [run_batch(args, batch, threads, out) for batch in batches]
    table = pd.DataFrame(rows)
    table.to_csv(out / TABLE_FILE, index=False)
    print(
        f"\n{args.model}, {args.dtype}, prompt {args.prompt_len}, {args.decode_tokens} decode "
        f"tokens; medians over decode-only steps\n"
    )
    print(table.to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    batch1 = table[table["batch"] == 1]
    if len(batch1):
        print(f"\nbatch-1 decode MBU: {batch1['mbu'].iloc[0]:.3f}")
    worst = table.loc[(table["ratio"].apply(lambda r: max(r, 1 / r))).idxmax()]
    print(
        f"within {TARGET}x at {int(table['within_target'].sum())}/{len(table)} batch sizes; "
        f"worst: batch {int(worst['batch'])} ratio {worst['ratio']:.2f}"
    )
    print(f"run folders and bench_roofline.csv: {out}")
    return 0 if table["within_target"].all() else 1


if __name__ == "__main__":
    raise SystemExit(main())
