"""One workload against one `inferlab serve`, measured by the lab, by guidellm and by AIPerf
(their results imported with `inferlab import`), with the server's own TTFT/ITL scraped from
its /metrics around each tool's run: the table of docs/interop.md "Three clients, one server".

    .venv/bin/python scripts/interop_compare.py [--out results/interop] [--concurrency 1]

The server runs pinned to core 0 with one thread, the clients on the other cores, one tool at
a time: closed loop, `--concurrency` streams, `--input-len` prompt tokens (the served model's
tokenizer, written to a folder for the external tools), `--output-len` output tokens each,
completions API, streaming. Writes compare.csv and compare.md under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pandas as pd

from harness.measuring.server_scrape import Histogram, parse_page, quantities
from harness.run_folder import load_table
from models.tokenizer import default_tokenizer
from serving.testing import serve_command as serve_command_process

ROOT = Path(__file__).resolve().parents[1]
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
SERVED = "small"
# the table's columns: (label, summary metric); the server's come from its histograms
CLIENT_METRICS = (
    ("TTFT mean", "ttft_mean_s"),
    ("TTFT p50", "ttft_p50_s"),
    ("TTFT p99", "ttft_p99_s"),
    ("ITL mean", "itl_mean_s"),
    ("ITL p50", "itl_p50_s"),
    ("TPOT mean", "tpot_mean_s"),
    ("E2E mean", "e2e_mean_s"),
    ("output tok/s", "output_tok_per_s"),
    ("requests", "num_completed"),
)


def serve_command(core: int) -> list[str]:
    """`inferlab serve` pinned to `core` (taskset), one thread, on the port it picks."""
    return [
        "taskset",
        "-c",
        str(core),
        sys.executable,
        "-m",
        "harness.cli",
        "serve",
        f"model={SERVED}",
        "engine.dtype=float32",
        "engine.num_threads=1",
        "engine.max_num_seqs=8",
        "host=127.0.0.1",
        "port=0",
        "log_level=warning",
    ]


def server_view(root: str) -> dict[str, Any]:
    return quantities(parse_page(httpx.get(f"{root}/metrics", timeout=10).text), "inferlab")


def server_run_figures(before: dict[str, Any], after: dict[str, Any]) -> dict[str, float | None]:
    """The server's TTFT and ITL over one tool's run: its histograms' differences."""
    out: dict[str, float | None] = {}
    for quantity in ("ttft", "itl", "e2e"):
        run: Histogram | None = after[quantity].minus(before[quantity])
        out[f"server_{quantity}_mean_s"] = run.mean() if run else None
        out[f"server_{quantity}_p50_s"] = run.quantile(0.5) if run else None
    out["server_requests_finished"] = after["requests_finished"] - before["requests_finished"]
    return out


def run_lab(base: str, out: Path, args: argparse.Namespace) -> Path:
    folder = out / "lab"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "harness.cli",
            "run",
            "engine=openai",
            f"engine.base_url={base}/v1",
            f"model={SERVED}",
            "engine.api=completions",
            f"workload.num_requests={args.requests}",
            f"workload.input_len={args.input_len}",
            f"workload.output_len={args.output_len}",
            "workload.arrival.process=closed",
            f"workload.arrival.concurrency={args.concurrency}",
            "run.warmup_requests=0",
            "run.progress=false",
            f"hydra.run.dir={folder}",
        ],
        cwd=ROOT,
        check=True,
    )
    return folder


def run_guidellm(base: str, out: Path, tokenizer: Path, args: argparse.Namespace) -> Path:
    result = out / "guidellm.json"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "guidellm",
            "run",
            "--backend",
            f"kind=openai_http,target={base},model={SERVED},request_format=/v1/completions",
            "--profile",
            f"kind=concurrent,streams={args.concurrency}",
            "--constraint",
            f"kind=max_requests,count={args.requests}",
            "--data",
            f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
            "--tokenizer",
            f"kind=huggingface_auto,model={tokenizer}",
            "--output",
            f"kind=json,path={result}",
            "--disable-console-interactive",
        ],
        cwd=out,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        check=True,
    )
    return result


def run_aiperf(base: str, out: Path, tokenizer: Path, args: argparse.Namespace) -> Path:
    folder = out / "aiperf"
    env = {
        k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    }
    env.update(AIPERF_DATASET_MMAP_BASE_PATH=str(out), AIPERF_DATASET_MMAP_CACHE_ENABLED="0")
    subprocess.run(
        [
            str(AIPERF),
            "profile",
            "--model",
            SERVED,
            "--url",
            base,
            "--endpoint-type",
            "completions",
            "--streaming",
            "--request-count",
            str(args.requests),
            "--concurrency",
            str(args.concurrency),
            "--isl",
            str(args.input_len),
            "--osl",
            str(args.output_len),
            "--extra-inputs",
            "ignore_eos:true",
            "--tokenizer",
            str(tokenizer),
            "--prompt-corpus",
            "random",
            "--random-seed",
            "0",
            "--use-server-token-count",
            "--ui-type",
            "none",
            "--no-gpu-telemetry",
            "--no-server-metrics",
            "--artifact-dir",
            str(folder),
        ],
        cwd=out,
        env=env,
        check=True,
    )
    return folder / "profile_export_aiperf.json"


def imported(result: Path, folder: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "harness.cli", "import", str(result), "--out", str(folder)],
        cwd=ROOT,
        check=True,
    )
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "interop")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = default_tokenizer().save_pretrained(out / "tokenizer")
    cores = os.sched_getaffinity(0)
    server_core = min(cores)
    os.environ["OMP_NUM_THREADS"] = "1"
    rows = []
    with serve_command_process(serve_command(server_core), out / "server.log") as server:
        root = server.base_url
        # the tools, started from here, inherit the other cores
        os.sched_setaffinity(0, cores - {server_core} or cores)
        for _ in range(2):  # warm the server before any tool measures it
            httpx.post(
                f"{root}/v1/completions",
                json={"model": SERVED, "prompt": "warm up", "max_tokens": 8},
                timeout=120,
            ).raise_for_status()
        for tool in ("lab", "guidellm", "aiperf"):
            before = server_view(root)
            if tool == "lab":
                folder = run_lab(root, out, args)
            elif tool == "guidellm":
                folder = imported(run_guidellm(root, out, tokenizer, args), out / "guidellm")
            else:
                folder = imported(run_aiperf(root, out, tokenizer, args), out / "aiperf-run")
            after = server_view(root)
            summary = json.loads((folder / "summary.json").read_text())
            # every request, as the tools count them (the lab's `metrics` may be a window)
            metrics = summary.get("metrics_whole_run") or summary["metrics"]
            row: dict[str, Any] = {"measured by": tool}
            row.update({label: metrics.get(name) for label, name in CLIENT_METRICS})
            requests = load_table(folder, "requests")
            ok = requests[requests["status"] == "ok"]
            row["TTFT from send mean"] = float((ok["first_token_s"] - ok["sent_s"]).mean())
            row.update(server_run_figures(before, after))
            rows.append(row)
    table = pd.DataFrame(rows)
    table.to_csv(out / "compare.csv", index=False)
    (out / "compare.md").write_text(table.to_markdown(index=False, floatfmt=".4g") + "\n")
    print(table.to_markdown(index=False, floatfmt=".4g"))


if __name__ == "__main__":
    main()
