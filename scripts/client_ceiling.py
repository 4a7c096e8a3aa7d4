"""The client's ceiling: how many chunks per second one engine=openai client process can time
truly, and what `run.num_clients` buys beyond it (docs/scaling.md, "Load from many clients").

The scripted server (serving/scripted_server.py) sends every request's tokens at known times
(TTFT, then one token every ITL) and logs when it actually sent each chunk. For each offered
request rate the harness runs a Poisson workload against it; the run's tokens are joined with
the server's log chunk by chunk, so that

- ITL error = |the client's gap - the server's send gap| per chunk: what the client added
  (late reads, its own parsing, a busy event loop), apart from the server's own lateness;
- lateness = sent_s - arrival_s per request: the client falling behind the arrival schedule;
- server lateness = sent - due per chunk: the server falling behind its script (on a shared
  machine the server and the clients compete for the same cores).

One client is swept first. Its ceiling is the first rate where it distorts: the median ITL
error exceeds `--threshold` of the ITL (10%: 0.5 ms at 5 ms), or its lateness p99 exceeds
`--lateness-ms` (default two ITLs). The p99 ITL error is shown but not a criterion: on shared
cores a process now and then waits a millisecond or more for a core, at any rate, so the p99 has
a floor of the machine's (1-3 ms on a busy 2-core VM) that says nothing about the client's
ceiling. Then 2 and 4 clients (`--clients`) run that rate and the ones above it. Read the
server's lateness beside each row: where the server itself falls behind its script, that rate
measures the server (or the machine), not the client.

    .venv/bin/python scripts/client_ceiling.py --rates 50,100,150,200,250,300 --clients 1,2,4
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import httpx
from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from script_args import parse_args_checking_out  # noqa: E402

import configs  # noqa: E402
import engines.backends  # noqa: E402, F401  (the config groups' schemas, for compose)
import workloads  # noqa: E402, F401
from harness.run_folder import load_table  # noqa: E402
from harness.running import config_schema  # noqa: E402, F401
from harness.running.experiment import run_experiment  # noqa: E402
from models.files import write_output_text  # noqa: E402
from serving.scripted_server import read_log, scripted_process, with_send_times  # noqa: E402

COLUMNS = (
    ("rate", "rate/s", "{:.0f}"),
    ("chunks_per_s", "chunks/s", "{:.0f}"),
    ("clients", "clients", "{:d}"),
    ("itl_error_p50_ms", "ITL err p50 ms", "{:.3f}"),
    ("itl_error_p99_ms", "ITL err p99 ms", "{:.3f}"),
    ("lateness_p99_ms", "lateness p99 ms", "{:.2f}"),
    ("server_lateness_p99_ms", "server late p99 ms", "{:.2f}"),
    ("overhead_mean_us", "overhead/chunk us", "{:.0f}"),
    ("status", "status", "{}"),
)


def measure(
    base_url: str, rate: float, clients: int, args: argparse.Namespace, folder: Path
) -> dict[str, Any]:
    """One run at `rate` requests/s from `clients` processes, against the server's log."""
    httpx.delete(f"{base_url}/scripted/log", timeout=30).raise_for_status()
    num_requests = max(int(rate * args.duration_s), 2 * clients)
    config = OmegaConf.to_container(
        configs.compose(
            [
                "engine=openai",
                f"engine.base_url={base_url}/v1",
                "engine.model=scripted",
                f"engine.max_connections={args.max_connections}",
                "model=tiny",
                f"workload.num_requests={num_requests}",
                "workload.input_len=16",
                f"workload.output_len={args.output_tokens}",
                f"workload.arrival={{process: poisson, rate: {rate}}}",
                f"run.num_clients={clients}",
                "run.warmup_requests=0",
                "run.progress=false",
            ]
        ),
        resolve=True,
    )
    assert isinstance(config, dict)
    run_dir = folder / f"rate{rate:g}-clients{clients}"
    summary = run_experiment(config, run_dir, progress=False)
    requests = load_table(run_dir, "requests")
    tokens = with_send_times(load_table(run_dir, "tokens"), read_log(base_url))
    by_request = tokens.groupby("request_id")
    error = (by_request["time_s"].diff() - by_request["sent_ns"].diff() / 1e9).abs().dropna()
    lateness = requests["sent_s"] - requests["arrival_s"]
    span = tokens["time_s"].max() - tokens["time_s"].min()
    return {
        "rate": rate,
        "clients": clients,
        "requests": len(requests),
        "chunks_per_s": len(tokens) / span if span > 0 else float("nan"),
        "itl_error_p50_ms": error.quantile(0.5) * 1e3,
        "itl_error_p99_ms": error.quantile(0.99) * 1e3,
        "lateness_p99_ms": lateness.quantile(0.99) * 1e3,
        "server_lateness_p99_ms": (tokens["sent_ns"] - tokens["due_ns"]).quantile(0.99) / 1e6,
        "overhead_mean_us": summary["engine"]["client"]["client_overhead_per_chunk_mean_us"],
        "status": summary["status"],
    }


def distorted(point: dict[str, Any], args: argparse.Namespace) -> bool:
    """The client distorts: the median ITL error above the threshold, or the client falling
    behind its schedule (lateness p99 above `--lateness-ms`)."""
    return (
        point["itl_error_p50_ms"] > args.threshold * args.itl_ms
        or point["lateness_p99_ms"] > args.lateness_ms
    )


def table(points: list[dict[str, Any]]) -> str:
    rows = [[title for _, title, _ in COLUMNS]]
    rows += [[fmt.format(p[key]) for key, _, fmt in COLUMNS] for p in points]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = [" | ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows]
    lines.insert(1, "-|-".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="50,100,150,200,250,300", help="requests/s, ascending")
    parser.add_argument("--clients", default="1,2,4", help="the first is the swept one")
    parser.add_argument("--duration-s", type=float, default=3.0, help="seconds of arrivals")
    parser.add_argument("--ttft-ms", type=float, default=20.0)
    parser.add_argument("--itl-ms", type=float, default=5.0)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--threshold", type=float, default=0.1, help="of the ITL")
    parser.add_argument("--lateness-ms", type=float, default=None, help="default: 2 ITLs")
    parser.add_argument("--max-connections", type=int, default=1024)
    parser.add_argument("--out", default=None, help="also write the points (JSON)")
    args = parse_args_checking_out(parser)
    if args.lateness_ms is None:
        args.lateness_ms = 2 * args.itl_ms
    rates = [float(r) for r in args.rates.split(",")]
    counts = [int(c) for c in args.clients.split(",")]
    points: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="client-ceiling-") as tmp:
        folder = Path(tmp)
        server_args = ["--ttft-ms", str(args.ttft_ms), "--itl-ms", str(args.itl_ms)]
        with scripted_process(server_args, folder / "server.log") as server:
            ceiling = None
            for rate in rates:
                points.append(measure(server.base_url, rate, counts[0], args, folder))
                print(table(points[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
                if ceiling is None and distorted(points[-1], args):
                    ceiling = rate
            beyond = [r for r in rates if ceiling is None or r >= ceiling]
            for clients in counts[1:]:
                for rate in beyond:
                    points.append(measure(server.base_url, rate, clients, args, folder))
                    print(table(points[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(
        f"scripted server: TTFT {args.ttft_ms} ms, ITL {args.itl_ms} ms, "
        f"{args.output_tokens} tokens per request; distortion: ITL error p50 above "
        f"{args.threshold:.0%} of the ITL ({args.threshold * args.itl_ms:g} ms) or lateness "
        f"p99 above {args.lateness_ms:g} ms"
    )
    print(
        f"one client's ceiling: {ceiling:g} requests/s"
        if ceiling is not None
        else "one client kept up at every rate"
    )
    print(table(points))
    if args.out is not None:
        write_output_text(args.out, json.dumps(points, indent=2), "--out")


if __name__ == "__main__":
    main()
