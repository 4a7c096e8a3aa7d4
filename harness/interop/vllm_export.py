"""A lab run folder as the JSON `vllm bench serve --save-result --save-detailed` writes:
vLLM's keys, units and statistics, computed vLLM's way from the run's requests and tokens
tables (docs/interop.md says what differs from the lab's own summary and why):

- a request's clock starts at its send (`sent_s`), as vLLM's `start_time` does; the wait
  before it (`sent_s - arrival_s`: the lab's lateness, a `max_concurrency` slot) is vLLM's
  `queue_times` entry, and stays out of TTFT and E2EL as in vLLM;
- `ttfts`: first token - send; `latencies` and E2EL: last token - send;
- `itls`: one gap per streamed chunk, as vLLM measures them: the tokens a request got at one
  time (one engine event, one SSE chunk) are one chunk;
- TPOT: (latency - TTFT) / (N - 1) for N > 1 (the lab's TPOT over the same span);
- `duration`: from the run's start (t0, when the arrival schedule starts, as vLLM's benchmark
  start) to the end of the last request, failed ones included; the throughputs are over it;
- totals count successful requests only; a failed request has ttft, latency and output
  length 0 and no gaps, as vLLM records one that failed before its stream ended; a request
  that finished without a token is a failure, as for vLLM (no chunk received); so is one the
  harness cancelled (vLLM has no other outcome), its error starting `cancelled`;
- statistics over no sample are 0, as vLLM writes them (`np.mean(x or 0)`);
- `generated_texts` are empty strings: the lab keeps token ids, not text.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from harness.interop.errors import InteropError
from harness.interop.vllm_format import (
    DETAIL_KEYS,
    percentile_word,
    stat_keys,
    traffic_from_arrival,
)
from harness.run_folder import (
    SUMMARY_FILE,
    load_table,
    read_config,
    read_summary,
    table_path,
)
from models.files import UserFileError, write_output_text

NO_TOKEN_ERROR = "no output token (vLLM counts a request without a streamed chunk as failed)"


@dataclass
class Output:
    """One request as vLLM's RequestFuncOutput records it (seconds, from the send)."""

    success: bool
    start_time: float
    queue_time: float
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def has_requests(folder: Path) -> bool:
    return any(table_path(folder, "requests", s).is_file() for s in ("parquet", "jsonl"))


def run_folders(path: Path) -> list[Path]:
    """The run folders (holding a requests table) at or under `path`: itself, each repeat,
    each sweep job, in path order."""
    if not path.is_dir():
        raise InteropError(f"{path}: {'not a folder' if path.exists() else 'no such folder'}")
    if has_requests(path):
        return [path]
    found = {
        table.parent
        for pattern in ("requests.parquet", "requests.jsonl")
        for table in path.rglob(pattern)
        if not any(part.startswith(".") for part in table.relative_to(path).parts[:-1])
    }
    if not found:
        raise InteropError(f"{path}: no run folder (requests.parquet or requests.jsonl) in it")
    return sorted(found, key=lambda p: [(0, int(s)) if s.isdigit() else (1, s) for s in p.parts])


def chunk_times(tokens: pd.DataFrame) -> dict[str, np.ndarray]:
    """Per request, the distinct times its tokens arrived, in order: its streamed chunks."""
    if tokens.empty:
        return {}
    ordered = tokens.sort_values(["request_id", "index"])
    return {
        str(request_id): np.unique(group["time_s"].to_numpy(dtype=float))
        for request_id, group in ordered.groupby("request_id", sort=False)
    }


def _number(value: Any, default: float = 0.0) -> float:
    return default if value is None or pd.isna(value) else float(value)


def outputs_of(requests: pd.DataFrame, tokens: pd.DataFrame) -> list[Output]:
    """The run's requests in arrival order, as vLLM's outputs."""
    chunks = chunk_times(tokens)
    ordered = requests.sort_values(["arrival_s", "request_id"], kind="stable")
    outputs = []
    for row in ordered.itertuples(index=False):
        sent = _number(row.sent_s, _number(row.arrival_s))
        prompt = row.prompt_tokens if pd.notna(row.prompt_tokens) else row.prompt_tokens_requested
        output = Output(
            success=row.status == "ok" and pd.notna(row.first_token_s),
            start_time=sent,
            queue_time=sent - _number(row.arrival_s, sent),
            prompt_len=int(_number(prompt)),
        )
        if output.success:
            times = chunks.get(str(row.request_id), np.array([row.first_token_s]))
            output.ttft = float(row.first_token_s) - sent
            output.latency = _number(row.last_token_s, row.first_token_s) - sent
            output.itl = [float(g) for g in np.diff(times)]
            output.output_len = int(_number(row.output_tokens))
        else:
            error = row.error if isinstance(row.error, str) and row.error else None
            if row.status == "cancelled":  # the lab counts it apart; vLLM's file cannot
                error = f"cancelled by the harness: {error or 'no reason recorded'}"
            output.error = error or (NO_TOKEN_ERROR if row.status == "ok" else "failed")
        outputs.append(output)
    return outputs


def _stats(values: list[float], percentiles: list[float]) -> dict[str, float]:
    """vLLM's statistics in ms: np.mean / median / std / percentile of `values or 0`."""
    data: Any = values or 0
    stats = {
        "mean": float(np.mean(data)) * 1000,
        "median": float(np.median(data)) * 1000,
        "std": float(np.std(data)) * 1000,
    }
    for p in percentiles:
        stats[f"p{percentile_word(p)}"] = float(np.percentile(data, p)) * 1000
    return stats


def peaks(outputs: list[Output]) -> tuple[float, int]:
    """vLLM's max_output_tokens_per_s (chunks arriving in each whole second from the first
    successful send; vLLM counts one token per chunk) and max_concurrent_requests (the most
    successful requests in flight at once, over [send, send + latency))."""
    done = [o for o in outputs if o.success]
    if not done:
        return 0.0, 0
    first = min(o.start_time for o in done)
    last = max(o.start_time + o.latency for o in done)
    buckets = np.zeros(int(np.ceil(last - first)) + 1)
    for o in done:
        times = o.start_time + o.ttft + np.concatenate([[0.0], np.cumsum(o.itl)])
        for t in times:
            bucket = int(t - first)
            if 0 <= bucket < len(buckets):
                buckets[bucket] += 1
    events = sorted(
        [(o.start_time, 1) for o in done] + [(o.start_time + o.latency, -1) for o in done]
    )
    in_flight = peak = 0
    for _, delta in events:
        in_flight += delta
        peak = max(peak, in_flight)
    return float(buckets.max()), peak


def goodput(outputs: list[Output], slo: dict[str, Any], duration: float) -> float | None:
    """vLLM's request_goodput under the run's SLOs (run.slo, seconds): successful requests
    whose TTFT, TPOT (0 for N <= 1) and E2EL are all within their bounds, over `duration`.
    None when the run set no SLO (vLLM writes null without --goodput)."""
    bounds = {k: float(v) for k in ("ttft_s", "tpot_s", "e2e_s") if (v := slo.get(k)) is not None}
    if not bounds or duration <= 0:
        return None
    good = 0
    for o in outputs:
        if not o.success:
            continue
        tpot = (o.latency - o.ttft) / (o.output_len - 1) if o.output_len > 1 else 0.0
        values = {"ttft_s": o.ttft, "tpot_s": tpot, "e2e_s": o.latency}
        good += all(bound >= values[k] for k, bound in bounds.items())
    return good / duration


def run_date(run_dir: Path) -> str:
    """When the run finished (its summary.json last written), as vLLM dates its results."""
    summary = run_dir / SUMMARY_FILE
    stamp = summary.stat().st_mtime if summary.is_file() else datetime.now().timestamp()
    return datetime.fromtimestamp(stamp).strftime("%Y%m%d-%H%M%S")


def vllm_result(
    run_dir: Path,
    percentile_metrics: tuple[str, ...],
    percentiles: list[float],
    detailed: bool = True,
) -> dict[str, Any]:
    """The run folder's measured requests as vLLM's result JSON (a dict, in vLLM's key order).
    `detailed` keeps the per-request lists (vLLM's --save-detailed)."""
    requests, tokens = _measured_tables(run_dir)
    config = read_config(run_dir) or {}
    outputs = outputs_of(requests, tokens)
    duration = _duration(run_dir, requests)
    result = _identity(run_dir, config, len(outputs))
    result.update(_status(run_dir))
    result.update(traffic_from_arrival(_arrival(config.get("workload") or {})))
    slo = (config.get("run") or {}).get("slo") or {}
    result.update(_aggregates(outputs, duration, slo))
    done = [o for o in outputs if o.success]
    values = _percentile_values(done, result)
    for metric in percentile_metrics:
        if metric not in values:
            continue
        stats = _stats(values[metric], percentiles)
        for stat, key in stat_keys(metric, percentiles).items():
            result[key] = stats[stat]
    if not detailed:
        for key in DETAIL_KEYS:
            result.pop(key, None)
    return result


def _measured_tables(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The run's requests and tokens tables; refused when unreadable or without a request."""
    try:
        requests = load_table(run_dir, "requests")
        tokens = load_table(run_dir, "tokens")
    except (OSError, ValueError) as exc:
        raise InteropError(f"{run_dir}: its tables cannot be read: {exc}") from exc
    if requests.empty:
        raise InteropError(f"{run_dir}: no measured request to export (empty requests table)")
    return requests, tokens


def _duration(run_dir: Path, requests: pd.DataFrame) -> float:
    """Run start to the last request's end (vLLM's benchmark duration)."""
    ends = pd.concat([requests["finished_s"], requests["last_token_s"], requests["sent_s"]])
    duration = float(ends.max()) if ends.notna().any() else 0.0
    if not duration > 0:
        raise InteropError(f"{run_dir}: the requests table has no times to take a duration from")
    return duration


def _identity(run_dir: Path, config: dict[str, Any], num_prompts: int) -> dict[str, Any]:
    """What vLLM's result says first: when, which endpoint and model, how many prompts."""
    model = config.get("model") or {}
    engine = config.get("engine") or {}
    model_id = model.get("path") or model.get("name")
    return {
        "date": run_date(run_dir),
        "endpoint_type": f"inferlab-{engine.get('backend', 'builtin')}",
        "backend": f"inferlab-{engine.get('backend', 'builtin')}",
        "label": (config.get("run") or {}).get("name"),
        "model_id": model_id,
        "tokenizer_id": model.get("tokenizer") or model_id,
        "num_prompts": num_prompts,
        "inferlab_run": str(run_dir),  # vLLM's --metadata KEY=VALUE land at this level
    }


def _status(run_dir: Path) -> dict[str, Any]:
    """`inferlab_status`, where the run did not complete (nothing where it did)."""
    summary = read_summary(run_dir) or {}
    status, error = summary.get("status"), summary.get("error")
    if status == "complete":
        return {}
    # vLLM writes only finished benchmarks: say this one is not
    status = status if isinstance(status, str) else "no summary.json"
    return {"inferlab_status": f"{status}: {error}" if isinstance(error, str) else status}


def _arrival(workload: dict[str, Any]) -> dict[str, Any]:
    """The workload's arrival process, with a trace workload's cap on requests in flight."""
    arrival = dict(workload.get("arrival") or {"process": "offline"})
    if workload.get("max_concurrency") is not None:
        arrival.setdefault("max_concurrency", workload["max_concurrency"])
    return arrival


def _aggregates(outputs: list[Output], duration: float, slo: dict[str, Any]) -> dict[str, Any]:
    """The counts, throughputs and per-request lists, in vLLM's order."""
    done = [o for o in outputs if o.success]
    total_input = sum(o.prompt_len for o in done)
    total_output = sum(o.output_len for o in done)
    max_tokens_per_s, max_in_flight = peaks(outputs)
    return {
        "duration": duration,
        "completed": len(done),
        "failed": len(outputs) - len(done),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(done) / duration,
        "request_goodput": goodput(outputs, slo, duration),
        "output_throughput": total_output / duration,
        "total_token_throughput": (total_input + total_output) / duration,
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": [o.output_len for o in outputs],
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "latencies": [o.latency for o in outputs],
        "start_times": [o.start_time for o in outputs],
        "queue_times": [o.queue_time for o in outputs],
        "generated_texts": ["" for _ in outputs],
        "errors": [o.error for o in outputs],
        "max_output_tokens_per_s": max_tokens_per_s,
        "max_concurrent_requests": max_in_flight,
        "rtfx": 0.0,  # audio only
    }


def _percentile_values(done: list[Output], traffic: dict[str, Any]) -> dict[str, list[float]]:
    """Each percentile metric's values over the completed requests."""
    values = {
        "ttft": [o.ttft for o in done],
        "tpot": [(o.latency - o.ttft) / (o.output_len - 1) for o in done if o.output_len > 1],
        "itl": [gap for o in done for gap in o.itl],
        "e2el": [o.latency for o in done],
    }
    # vLLM reports the client-side queue only under --max-concurrency, and the queue-inclusive
    # E2EL only when, besides, the request rate is finite
    if traffic["max_concurrency"] is not None:
        values["client_queue_time"] = [o.queue_time for o in done]
        if traffic["request_rate"] != "inf":
            values["e2el_including_client_queue"] = [o.latency + o.queue_time for o in done]
    return values


def write_json(path: Path, result: dict[str, Any]) -> None:
    """As vLLM writes it: json.dump, one line (so `--append-result` files are JSON lines);
    an infinite burstiness is written as Python writes it (Infinity)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InteropError(f"{path}: cannot be written: {exc.strerror or exc}") from exc
    try:
        write_output_text(path, json.dumps(result) + "\n", "--out")
    except UserFileError as exc:
        raise InteropError(str(exc)) from exc


def check_percentiles(text: str) -> list[float]:
    """`--metric-percentiles`: comma-separated numbers in [0, 100], as vLLM takes them."""
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError as exc:
        raise InteropError(
            f"--metric-percentiles: {text!r} is invalid; allowed: comma-separated numbers "
            "from 0 to 100, e.g. 50,90,99"
        ) from exc
    if not values or any(not (0 <= p <= 100) or math.isnan(p) for p in values):
        raise InteropError(
            f"--metric-percentiles: {text!r} is invalid; allowed: comma-separated numbers "
            "from 0 to 100, e.g. 50,90,99"
        )
    return values
