"""Validate the regression gate on this machine (issue 6's targets).

Runs N A/A gates (baseline and candidate identical: every failure is false) and N gates with a
planted slowdown (the candidate busy-waits inside every engine step so that output tokens/s falls by
`--slowdown`), interleaved A/A, slow, A/A, slow ... so machine drift touches both sets alike.
Each gate is `inferlab gate ab` with the default rules. Targets: 0 false failures and at most 3
inconclusive in 20 A/A gates; the slowdown caught in at least 19 of 20.

    .venv/bin/python scripts/gate_validation.py                      # the full validation
    .venv/bin/python scripts/gate_validation.py --calibrate          # seconds per run only
    .venv/bin/python scripts/gate_validation.py --gates 1 --rounds 3 --allow-few-rounds \\
        --common "model=tiny workload.num_requests=4 workload.output_len=8"   # smoke test

Prints the tallies and writes one CSV row per gate (default: <out>/gate_validation.csv).
Exit status 0 when every target is met, 1 otherwise.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import shlex
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from harness.arguments import at_least
from harness.gating.ab import ABPlan, compose_config, run_ab
from harness.gating.rules import load_rules

# About 3 s of measured run time per run on a quiet 2-core CPU (small preset, 8 requests of
# 64-128 prompt tokens and 32 output tokens, offline); check with --calibrate.
# The KV budget is pinned: on CPU it otherwise comes from the RAM free at load time, so
# the contiguous cache's slot count, and with it num_steps and every other counter, would
# change with whatever else the machine holds (2 GiB: 14 slots of 2048 fp32 tokens).
GATE_WORKLOAD = (
    "model=small workload.num_requests=8 workload.output_len=32 "
    "run.warmup_requests=1 engine.kv_cache_memory_bytes=2147483648"
)
TARGET_RUN_S = 3.0


def step_delay_for(slowdown: float) -> float:
    """The step delay fraction f that cuts tokens/s by `slowdown` when all of a run's time is
    in engine steps: every step takes (1 + f) times as long, so tokens/s becomes 1 / (1 + f) of
    what it was; 1 / (1 + f) = 1 - slowdown gives f = slowdown / (1 - slowdown) (0.25 for
    20%). Time outside steps (the driver) is not slowed, so the measured cut is a little
    smaller; the CSV records the measured one."""
    return slowdown / (1.0 - slowdown)


def one_gate(
    name: str, out: Path, candidate: list[str], args: argparse.Namespace, rules: Any
) -> dict[str, Any]:
    plan = ABPlan(
        baseline=[],
        candidate=candidate,
        common=shlex.split(args.common),
        rounds=args.rounds,
        out=out / name,
        warmup_rounds=args.warmup_rounds,
    )
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = run_ab(plan, rules)
    wall = time.perf_counter() - start
    ab = json.loads((plan.out / "ab.json").read_text())
    rows = {r["metric"]: r for r in (ab.get("result") or {}).get("rows", [])}
    tok = rows.get("output_tok_per_s", {})
    ci = tok.get("ci") or [None, None]
    durations = []
    for entry in ab["rounds"]:
        for side in "ab":
            summary = json.loads((plan.out / entry[side] / "summary.json").read_text())
            durations.append(summary["metrics"].get("duration_s"))
    failing = [
        m
        for m, r in rows.items()
        if r["verdict"] not in ("pass", "improved", "missing", "info") and r["gates"]
    ]
    return {
        "gate": name,
        "exit_code": code,
        "verdict": ab.get("verdict"),
        "tok_per_s_ratio": tok.get("ratio"),
        "ci_low": ci[0],
        "ci_high": ci[1],
        "measured_slowdown": 1 - tok["ratio"] if tok.get("ratio") else None,
        "not_passing": " ".join(f"{m}:{rows[m]['verdict']}" for m in failing),
        "run_duration_median_s": statistics.median(d for d in durations if d),
        "gate_wall_s": wall,
    }


def calibrate(args: argparse.Namespace) -> int:
    from harness.running.experiment import run_experiment

    config = compose_config(shlex.split(args.common))
    out = Path(args.out) / "calibrate"
    for k in range(3):  # the first run in a process is cold; the gate runs warm ones
        summary = run_experiment(config, out / f"run-{k}", progress=False)
        print(
            f"run {k}: {summary['status']}, duration_s {summary['metrics']['duration_s']:.2f} "
            f"(target about {TARGET_RUN_S} s per run)"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gates", type=at_least(1), default=20, help="gates of each kind (20)")
    parser.add_argument("--rounds", type=at_least(1), default=9, help="A/B rounds per gate (9)")
    parser.add_argument("--allow-few-rounds", action="store_true")
    parser.add_argument("--warmup-rounds", type=at_least(0), default=1)
    parser.add_argument(
        "--slowdown", type=float, default=0.20, help="planted cut in output tokens/s (0.20)"
    )
    parser.add_argument("--common", default=GATE_WORKLOAD, help="overrides of every run")
    parser.add_argument(
        "--out", default="results/gate_validation/" + time.strftime("%Y%m%d-%H%M%S")
    )
    parser.add_argument("--csv", help="the CSV (default: <out>/gate_validation.csv)")
    parser.add_argument(
        "--calibrate", action="store_true", help="only print the gate workload's seconds per run"
    )
    args = parser.parse_args(argv)
    if args.calibrate:
        return calibrate(args)
    if args.rounds < 9 and not args.allow_few_rounds:
        parser.error("--rounds below 9 needs --allow-few-rounds")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rules = load_rules()
    delay = step_delay_for(args.slowdown)
    slow = [f"++engine.debug_step_delay_fraction={delay:.6g}"]
    print(
        f"gate validation: {args.gates} A/A + {args.gates} planted {args.slowdown:.0%} "
        f"slowdown (debug_step_delay_fraction={delay:.4g}), {args.rounds} rounds each, "
        f"workload: {args.common}\nfolders: {out}",
        flush=True,
    )
    rows = []
    for i in range(args.gates):
        for kind, candidate in (("aa", []), ("slow", slow)):
            row = {"kind": kind, **one_gate(f"{kind}-{i:02d}", out, candidate, args, rules)}
            rows.append(row)
            ratio = row["tok_per_s_ratio"]
            print(
                f"{row['gate']}: {row['verdict']} (exit {row['exit_code']}), tok/s ratio "
                f"{ratio if ratio is None else round(ratio, 3)} CI [{row['ci_low']}, "
                f"{row['ci_high']}], run {row['run_duration_median_s']:.2f} s, gate "
                f"{row['gate_wall_s']:.0f} s {row['not_passing']}",
                flush=True,
            )
    csv_path = Path(args.csv) if args.csv else out / "gate_validation.csv"
    with csv_path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def count(kind: str, code: int) -> int:
        return sum(1 for r in rows if r["kind"] == kind and r["exit_code"] == code)

    n = args.gates
    false_fail, aa_inconclusive = count("aa", 1), count("aa", 2)
    caught = count("slow", 1)
    slowdowns = [
        r["measured_slowdown"]
        for r in rows
        if r["kind"] == "slow" and r["measured_slowdown"] is not None
    ]
    targets = {
        "A/A false failures = 0": false_fail == 0,
        f"A/A inconclusive <= {3 * n // 20}": aa_inconclusive <= 3 * n // 20,
        f"slowdown caught >= {n - n // 20}": caught >= n - n // 20,
    }
    print(
        f"\nA/A ({n}): {count('aa', 0)} pass, {false_fail} false failures, "
        f"{aa_inconclusive} inconclusive"
    )
    measured = f"{statistics.median(slowdowns):.1%}" if slowdowns else "n/a"
    print(
        f"planted slowdown ({n}): {caught} caught, {count('slow', 0)} passed, "
        f"{count('slow', 2)} inconclusive; measured tok/s cut (median): {measured}"
    )
    print(
        f"median run duration {statistics.median(r['run_duration_median_s'] for r in rows):.2f}"
        f" s; median gate {statistics.median(r['gate_wall_s'] for r in rows):.0f} s"
    )
    for target, met in targets.items():
        print(f"target {target}: {'met' if met else 'NOT met'}")
    print(f"CSV: {csv_path}")
    return 0 if all(targets.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
