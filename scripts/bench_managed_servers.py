"""Issue 38's closing-note numbers: sweeps over a real server's flags, the server started by the
run for every job (engine.launch, docs/managed_servers.md), on SmolLM2-135M.

    .venv/bin/python scripts/bench_managed_servers.py [--work DIR] [--requests N] [--json F]

It runs, one after another, each an ordinary `inferlab run -m` it prints:
1. `inferlab serve` 2 x 2: engine.max_num_seqs 4,16 x engine.kv_cache paged,contiguous;
2. llama.cpp's server (llama-cpp-python) at 1 and 2 threads;
3. a 4-job workload-only sweep (output lengths) with engine.launch.reuse true, then false;
4. sweep 1 again, killed with SIGKILL once its second job's server runs, then resumed.
and prints, per sweep, the jobs ranked by output tokens/s with TPOT p50, the server's start-up
time per job, the wall time, what reuse saved, and which jobs the resumed sweep ran again.
Every job's server must be gone after each sweep (it checks, and says which survived).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"


def workload(requests: int) -> list[str]:
    return [
        f"model={MODEL}",
        f"workload.num_requests={requests}",
        "workload.input_len=128",
        "workload.output_len=64",
        "run.warmup_requests=2",
        "run.progress=false",
    ]


SERVE_2X2 = [
    "engine=serve_inferlab",
    "engine.launch.params.engine.max_num_seqs=4,16",
    "engine.launch.params.engine.kv_cache=paged,contiguous",
]
LLAMACPP = ["engine=serve_llama_cpp_python", "workload.prompt=text", "engine.launch.threads=1,2"]
WORKLOAD_ONLY = ["engine=serve_inferlab", "workload.output_len=16,32,48,64"]


def command(sweep_dir: Path, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "harness.cli", "run", "-m", *overrides,
            f"hydra.sweep.dir={sweep_dir}"]  # fmt: skip


def run_sweep(sweep_dir: Path, overrides: list[str]) -> float:
    cmd = command(sweep_dir, overrides)
    print(f"$ {shlex.join(cmd)}", flush=True)
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"exit {done.returncode}:\n{done.stderr[-3000:]}")
    return wall


def jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    out = []
    for job in sorted(sweep_dir.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else -1):
        if not (job / "summary.json").exists():
            continue
        summary = json.loads((job / "summary.json").read_text())
        server = (summary.get("engine") or {}).get("launched_server") or {}
        out.append({"job": job.name, "summary": summary, "server": server})
    return out


def survivors(sweep_dir: Path) -> list[int]:
    left = []
    for job in jobs(sweep_dir):
        pid = job["server"].get("pid")
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().split(") ")[1][0] != "Z":
                    left.append(pid)
        except (ProcessLookupError, FileNotFoundError, TypeError):
            pass
    return left


def ranking(sweep_dir: Path, swept: list[str]) -> pd.DataFrame:
    table = pd.read_csv(sweep_dir / "sweep.csv")
    keys = [c for c in table.columns if c.split(".")[0] in ("engine", "workload") and any(
        c == o.split("=")[0] for o in swept)]  # fmt: skip
    columns = [*keys, "status", "output_tok_per_s", "tpot_p50_s", "ttft_p50_s",
               "server_startup_s", "server_reused"]  # fmt: skip
    return table[columns].sort_values("output_tok_per_s", ascending=False)


def report(title: str, sweep_dir: Path, swept: list[str], wall: float) -> dict[str, Any]:
    table = ranking(sweep_dir, swept)
    left = survivors(sweep_dir)
    print(f"\n## {title} ({wall:.1f} s wall)\n{table.to_string(index=False)}")
    print(f"servers left running: {left or 'none'}", flush=True)
    return {"title": title, "wall_s": round(wall, 2), "jobs": table.to_dict("records"),
            "survivors": left}  # fmt: skip


def kill_and_resume(sweep_dir: Path, overrides: list[str]) -> dict[str, Any]:
    cmd = command(sweep_dir, overrides)
    print(f"$ {shlex.join(cmd)}   # killed with SIGKILL once job 1's server runs", flush=True)
    sweep = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    provenance = sweep_dir / "1" / "provenance.json"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and sweep.poll() is None:
        try:
            if "server" in json.loads(provenance.read_text()):
                break
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    pid = json.loads(provenance.read_text())["server"]["pid"]
    sweep.send_signal(signal.SIGKILL)
    sweep.wait()
    time.sleep(2)
    killed_left = survivors(sweep_dir)
    before = {j["job"]: j["summary"]["status"] for j in jobs(sweep_dir)}
    wall = run_sweep(sweep_dir, [*overrides, "run.resume=true"])
    after = {j["job"]: (j["summary"]["status"], j["server"].get("pid")) for j in jobs(sweep_dir)}
    print(f"\n## killed and resumed: statuses when killed {before}; server {pid} of job 1 "
          f"left running after the kill: {pid in killed_left}; after resume {after} "
          f"({wall:.1f} s)", flush=True)  # fmt: skip
    return {"killed_at_job": 1, "statuses_when_killed": before, "left_after_kill": killed_left,
            "after_resume": after, "resume_wall_s": round(wall, 2),
            "survivors": survivors(sweep_dir)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", type=Path, default=ROOT / "results" / "bench_managed_servers")
    parser.add_argument("--requests", type=int, default=32, help="measured requests per job")
    parser.add_argument("--json", type=Path, default=None, help="write the numbers here")
    args = parser.parse_args()
    if args.requests < 1:
        parser.error("--requests: must be >= 1")
    work = args.work / time.strftime("%Y-%m-%d_%H-%M-%S")
    base = workload(args.requests)
    cpu = platform.processor() or platform.machine()
    print(f"CPU: {cpu}, {len(os.sched_getaffinity(0))} cores; work folder {work}", flush=True)
    out: dict[str, Any] = {"cpu_cores": len(os.sched_getaffinity(0)), "sweeps": []}
    for title, swept, name in (
        ("inferlab serve, max_num_seqs x kv_cache", SERVE_2X2, "serve_2x2"),
        ("llama.cpp's server (llama-cpp-python), threads", LLAMACPP, "llamacpp"),
        ("workload only, reuse on", WORKLOAD_ONLY, "reuse_on"),
        ("workload only, reuse off", [*WORKLOAD_ONLY, "engine.launch.reuse=false"], "reuse_off"),
    ):
        wall = run_sweep(work / name, [*base, *swept])
        out["sweeps"].append(report(title, work / name, swept, wall))
    on, off = out["sweeps"][2], out["sweeps"][3]
    saved = off["wall_s"] - on["wall_s"]
    startups = [j["server_startup_s"] for j in off["jobs"]]
    print(f"\nreuse saved {saved:.1f} s of {off['wall_s']:.1f} s over 4 jobs; a server's "
          f"start-up took {min(startups):.2f}-{max(startups):.2f} s", flush=True)  # fmt: skip
    out["reuse_saved_s"] = round(saved, 2)
    out["kill_resume"] = kill_and_resume(work / "killed", [*base, *SERVE_2X2])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
