"""OpenMP wait policies and thread counts, side by side, on the machine as it is (run it while
the machine is busy to see contention; docs/engine_options.md, "Threads").

    .venv/bin/python scripts/bench_threads.py                       # spin, passive, one thread
    .venv/bin/python scripts/bench_threads.py --rounds 4 --variants spin,passive,spin10k

Each variant runs in a fresh process (libgomp reads its variables once, when loaded), the
variants alternated round by round so that a change in the machine's load hits them alike.
A process builds `--model` (max_model_len 256), runs one warm-up request, then times one
16-token greedy request and a batch of 8 such requests, each --repeats times (the median is
kept). Prints one JSON line per process and the medians per variant at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# variant -> (environment, threads): `spin` is libgomp's own default (what inferlab set
# before it chose PASSIVE); an explicit GOMP_SPINCOUNT keeps inferlab from setting a policy
VARIANTS: dict[str, tuple[dict[str, str], int | None]] = {
    "spin": ({"GOMP_SPINCOUNT": "300000"}, None),
    "passive": ({}, None),  # inferlab's default
    "one": ({}, 1),
    "spin10k": ({"GOMP_SPINCOUNT": "10000"}, None),
    "spin50k": ({"GOMP_SPINCOUNT": "50000"}, None),
    "active": ({"OMP_WAIT_POLICY": "ACTIVE"}, None),
}


def measure(model: str, threads: int | None, repeats: int) -> dict[str, object]:
    import engines.openmp
    from engines.builtin.llm import LLM
    from engines.sampling_params import SamplingParams

    llm = LLM(model=model, num_threads=threads, max_model_len=256, max_num_seqs=8)
    params = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.0)
    llm.generate(["warm up please"], params)

    def timed(prompts: list[str]) -> list[float]:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            llm.generate(prompts, params)
            times.append(round(time.perf_counter() - start, 3))
        return times

    one = timed(["The quick brown fox jumps over the lazy dog"])
    batch = timed([f"Prompt number {i} about the sea" for i in range(8)])
    return {
        "threads": llm.engine.platform.num_threads,
        "policy": engines.openmp.wait_policy(),
        "one_request_s": statistics.median(one),
        "batch8_s": statistics.median(batch),
        "one_all": one,
        "batch8_all": batch,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--variants", default="spin,passive,one", help=f"comma-separated, of {','.join(VARIANTS)}"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="small")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.model, VARIANTS[args.child][1], args.repeats)))
        return 0
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; known: {','.join(VARIANTS)}")
    results: dict[str, list[dict[str, object]]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for name in names:
            env = {
                k: v
                for k, v in os.environ.items()
                if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
            }
            load = os.getloadavg()[0]
            child = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--child",
                    name,
                    "--model",
                    args.model,
                    "--repeats",
                    str(args.repeats),
                ],
                cwd=REPO,
                env={**env, **VARIANTS[name][0]},
                capture_output=True,
                text=True,
                check=True,
            )
            result = {
                "round": round_,
                "variant": name,
                "load_avg": load,
                **json.loads(child.stdout.splitlines()[-1]),
            }
            results[name].append(result)
            print(json.dumps(result), flush=True)
    for name, rows in results.items():
        print(
            f"{name:8s} one request {statistics.median(r['one_request_s'] for r in rows):6.2f}"
            f" s   8 requests {statistics.median(r['batch8_s'] for r in rows):6.2f} s"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
