"""guidellm's benchmark report (`guidellm run --output kind=json|yaml`; report schema version 2,
guidellm 0.8: `GenerativeBenchmarksReport` in `guidellm/benchmark/schemas/report.py`, its
benchmarks' `GenerativeMetrics` and `GenerativeRequestStats`) into the lab's terms, one run
per benchmark (one per strategy of a sweep).

When the report keeps every request of a benchmark (its requests lists are not sampled down:
as many as its request totals count), the lab computes its own metrics over them, from
guidellm's targeted start (its arrival schedule) to the first and last streamed token. Its
aggregates fill the rest; what differs (docs/metrics.md, crosswalk):

- `time_to_first_token_ms`: from the send (request_start), not the targeted start;
- `inter_token_latency_ms` is per request (last - first token) / (N - 1), the lab's TPOT, but
  its distribution weights each request by N - 1: its mean is the mean gap over all the
  requests' tokens (the lab's ITL mean), its percentiles weighted TPOT percentiles;
- `time_per_output_token_ms` divides by N from the request start: no lab counterpart;
- `request_latency` (seconds): request start -> response end;
- rates are guidellm's rate distributions over its measurement window (mean = events in the
  window / its length), counts and totals are inside that window;
- percentiles are nearest-rank over guidellm's value distribution, not interpolated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from harness.interop.errors import InteropError
from harness.interop.imported import Definition, ImportedRun
from harness.interop.recompute import put_request_metrics
from harness.interop.sources import validate
from harness.measuring.metrics import find_metric, percentile_stat, stat_percentile

FORMAT = "guidellm benchmark report (JSON/YAML)"
WHAT = "a guidellm benchmark report"
NEAREST = "percentiles nearest-rank over guidellm's distribution, not interpolated"
WINDOW = "over guidellm's measurement window (first request start -> last request end)"
ARRIVAL = (
    "guidellm's targeted start (its arrival schedule; as soon as a worker is free for the "
    "synchronous, concurrent and throughput strategies)"
)


class Distribution(BaseModel):
    """guidellm's DistributionSummary (the fields the lab reads)."""

    mean: float
    median: float
    count: int
    total_sum: float
    percentiles: dict[str, float]


class ByStatus(BaseModel):
    successful: Distribution
    errored: Distribution | None = None
    incomplete: Distribution | None = None


class Totals(BaseModel):
    successful: int
    errored: int
    incomplete: int
    total: int


class Metrics(BaseModel):
    request_totals: Totals
    requests_per_second: ByStatus
    request_latency: ByStatus
    time_to_first_token_ms: ByStatus
    inter_token_latency_ms: ByStatus
    prompt_token_count: ByStatus
    output_token_count: ByStatus
    output_tokens_per_second: ByStatus
    prompt_tokens_per_second: ByStatus | None = None
    tokens_per_second: ByStatus | None = None
    request_dispatch_delay: ByStatus | None = None
    slo_attainment: float | None = None
    request_goodput: ByStatus | None = None


class Timings(BaseModel):
    targeted_start: float | None = None
    request_start: float | None = None
    first_token_iteration: float | None = None
    last_token_iteration: float | None = None
    request_end: float | None = None


class Info(BaseModel):
    timings: Timings
    error: str | None = None


class RequestStats(BaseModel):
    request_id: str
    info: Info
    prompt_tokens: int | None = None
    output_tokens: int | None = None


class Requests(BaseModel):
    successful: list[RequestStats] = Field(default_factory=list)
    errored: list[RequestStats] = Field(default_factory=list)
    incomplete: list[RequestStats] = Field(default_factory=list)


class Benchmark(BaseModel):
    model_config = ConfigDict(extra="allow")

    config: dict[str, Any] = Field(default_factory=dict)
    metrics: Metrics
    requests: Requests
    duration: float | None = None


class Metadata(BaseModel):
    version: int | None = None
    guidellm_version: str | None = None


class Report(BaseModel):
    metadata: Metadata = Field(default_factory=Metadata)
    config: dict[str, Any] | None = None
    benchmarks: list[Benchmark]


def request_frame(benchmark: Benchmark) -> tuple[pd.DataFrame, bool] | None:
    """The benchmark's requests as the lab's rows (epoch times rebased to the first arrival),
    and whether every one has guidellm's targeted start; None when the report kept only a
    sample of them (fewer than its totals count) or no request had a start time. Incomplete
    requests (cancelled at the window's edge by guidellm's own limits) are left out, as the
    lab leaves out requests an interrupted run did not finish."""
    totals, listed = benchmark.metrics.request_totals, benchmark.requests
    if (len(listed.successful), len(listed.errored)) != (totals.successful, totals.errored):
        return None
    rows = []
    for status, requests in (("ok", listed.successful), ("failed", listed.errored)):
        for request in requests:
            t = request.info.timings
            rows.append(
                {
                    "request_id": request.request_id,
                    "status": status,
                    "error": request.info.error if status == "failed" else None,
                    "arrival_s": t.targeted_start,
                    "sent_s": t.request_start,
                    "first_token_s": t.first_token_iteration if status == "ok" else None,
                    "last_token_s": t.last_token_iteration if status == "ok" else None,
                    "finished_s": t.request_end,
                    "prompt_tokens": request.prompt_tokens,
                    "output_tokens": request.output_tokens,
                }
            )
    frame = pd.DataFrame(rows)
    if frame.empty or frame["sent_s"].isna().all():
        return None
    arrival_known = bool(frame["arrival_s"].notna().all())
    if not arrival_known:
        frame["arrival_s"] = frame["sent_s"]
    times = ["arrival_s", "sent_s", "first_token_s", "last_token_s", "finished_s"]
    frame[times] = frame[times].astype(float) - float(frame["arrival_s"].min())
    return frame.sort_values(["arrival_s", "request_id"]).reset_index(drop=True), arrival_known


def _put_distribution(
    run: ImportedRun,
    lab: str,
    source: str,
    distribution: Distribution,
    scale: float,
    same: bool,
    note: str,
) -> None:
    """The mean and every percentile (p001, p01 ... p999) of one successful-request
    distribution under the lab prefix `lab`, named as the lab names them (guidellm's p01 is
    the lab's p1, its p001 and p999 the lab's)."""
    if distribution.count == 0:
        return
    key = f"{source}.successful.mean"
    run.put(f"{lab}_mean_s", distribution.mean * scale, Definition(key, same, note))
    for word, value in distribution.percentiles.items():
        q = _guidellm_percentile(word)
        name = None if q is None else f"{lab}_{percentile_stat(q)}_s"
        if name is None or find_metric(name) is None:
            continue
        key = f"{source}.successful.percentiles.{word}"
        run.put(name, None if value is None else value * scale, Definition(key, same, note))


def _guidellm_percentile(word: str) -> float | None:
    """guidellm's spelling of a percentile (p01 = 1, p001 = 0.1, p999 = 99.9): two digits of
    integer part, the rest decimals, whatever their zeros; None for another key."""
    digits = word.removeprefix("p")
    if not digits.isdigit() or len(digits) < 2:
        return None
    return stat_percentile(percentile_stat(float(f"{digits[:2]}.{digits[2:] or 0}")))


def put_aggregates(run: ImportedRun, benchmark: Benchmark) -> None:
    m = benchmark.metrics
    _put_latencies(run, m)
    _put_rates(run, m)
    _put_totals(run, m)
    _put_window(run, benchmark)
    run.leave_out(
        "time_per_output_token_ms",
        "time_to_first_output_token_ms",
        "request_scheduled_latency",
        "request_concurrency",
        "request_streaming_iterations_count",
        "output_tokens_per_iteration",
        "iter_tokens_per_iteration",
    )


def _put_latencies(run: ImportedRun, m: Metrics) -> None:
    """TTFT, ITL, TPOT and end-to-end latency over the successful requests."""
    _put_distribution(
        run, "ttft", "time_to_first_token_ms", m.time_to_first_token_ms.successful,
        1e-3, False, "from the send (request_start), not the arrival; " + NEAREST,
    )  # fmt: skip
    itl = m.inter_token_latency_ms.successful
    if itl.count:
        run.put(
            "itl_mean_s",
            itl.mean / 1000,
            Definition(
                "inter_token_latency_ms.successful.mean",
                True,
                "per-request (last - first token) / (N - 1) weighted by N - 1: the mean gap "
                "over all the requests' tokens",
            ),
        )
    _put_distribution(
        run, "tpot", "inter_token_latency_ms", itl, 1e-3, False,
        "guidellm's 'ITL' is per request (last - first token) / (N - 1), the lab's TPOT, but "
        "weighted by N - 1 (the lab: each request once); " + NEAREST,
    )  # fmt: skip
    _put_distribution(
        run, "e2e", "request_latency", m.request_latency.successful, 1.0, False,
        "request start -> response end (the lab: arrival -> last token); " + NEAREST,
    )  # fmt: skip


def _put_rates(run: ImportedRun, m: Metrics) -> None:
    """The request and token throughputs (successful requests, over guidellm's window)."""
    for lab, source, distribution in (
        ("req_per_s", "requests_per_second", m.requests_per_second),
        ("output_tok_per_s", "output_tokens_per_second", m.output_tokens_per_second),
        ("input_tok_per_s", "prompt_tokens_per_second", m.prompt_tokens_per_second),
        ("total_tok_per_s", "tokens_per_second", m.tokens_per_second),
    ):
        if distribution is not None and distribution.successful.count:
            run.put(
                lab,
                distribution.successful.mean,
                Definition(f"{source}.successful.mean", False, "successful requests " + WINDOW),
            )


def _put_totals(run: ImportedRun, m: Metrics) -> None:
    """The request counts and token totals inside guidellm's measurement window."""
    totals = m.request_totals
    inside = "inside guidellm's measurement window"
    run.put("num_completed", totals.successful, Definition("request_totals.successful", True))
    run.put("num_failed", totals.errored, Definition("request_totals.errored", True, inside))
    run.put(
        "num_requests",
        totals.successful + totals.errored,
        Definition("request_totals.successful + errored", True, inside),
    )
    for lab, source, counts in (
        ("input_tokens_total", "prompt_token_count", m.prompt_token_count),
        ("output_tokens_total", "output_token_count", m.output_token_count),
    ):
        errored = counts.errored.total_sum if counts.errored else 0.0
        run.put(
            lab,
            counts.successful.total_sum + errored,
            Definition(f"{source}.successful + errored .total_sum", True, inside),
        )


def _put_window(run: ImportedRun, benchmark: Benchmark) -> None:
    """The window's duration, the send lateness, the SLO attainment and the goodput."""
    m = benchmark.metrics
    run.put("duration_s", benchmark.duration, Definition("duration", False, WINDOW))
    delay = m.request_dispatch_delay
    if delay is not None and delay.successful.count:
        run.put(
            "send_lateness_p99_s",
            delay.successful.percentiles.get("p99"),
            Definition(
                "request_dispatch_delay.successful.percentiles.p99",
                False,
                "request start - targeted start, successful requests only; " + NEAREST,
            ),
        )
    run.put(
        "slo_attainment",
        m.slo_attainment,
        Definition("slo_attainment", False, "errored requests count as missing the SLO"),
    )
    if m.request_goodput is not None and m.request_goodput.successful.count:
        run.put(
            "goodput_req_per_s",
            m.request_goodput.successful.mean,
            Definition("request_goodput.successful.mean", False, WINDOW),
        )


def arrival_of(strategy: dict[str, Any]) -> dict[str, Any]:
    """guidellm's scheduling strategy as the lab's workload.arrival, where there is one."""
    kind = strategy.get("type_")
    if kind == "synchronous":
        return {"process": "closed", "concurrency": 1}
    if kind == "concurrent":
        return {"process": "closed", "concurrency": strategy.get("streams")}
    if kind == "throughput":
        return {"process": "offline", "max_concurrency": strategy.get("max_concurrency")}
    if kind in ("constant", "poisson"):
        return {"process": kind, "rate": strategy.get("rate")}
    return {}


def config_of(report: Report, benchmark: Benchmark) -> dict[str, Any]:
    strategy = benchmark.config.get("strategy") or {}
    backend = benchmark.config.get("backend") or {}
    spec = (report.config or {}).get("spec") or {}
    data = [d for d in spec.get("data") or [] if isinstance(d, dict)]
    workload: dict[str, Any] = {"arrival": arrival_of(strategy)}
    if len(data) == 1 and data[0].get("kind") == "synthetic_text":
        workload.update(
            input_len=data[0].get("prompt_tokens"), output_len=data[0].get("output_tokens")
        )
    return {
        "source": {"tool": "guidellm", "strategy": strategy},
        "model": {"name": backend.get("model")},
        "target": {
            "kind": backend.get("kind"),
            "url": backend.get("target"),
            "endpoint": backend.get("request_format"),
        },
        "workload": workload,
    }


def import_benchmark(report: Report, k: int, path: Path) -> ImportedRun:
    benchmark = report.benchmarks[k]
    strategy = (benchmark.config.get("strategy") or {}).get("type_", "?")
    run = ImportedRun(
        tool="guidellm",
        format=FORMAT,
        files=[path],
        tool_version=report.metadata.guidellm_version,
        label=f"benchmark {k} ({strategy})",
    )
    totals = benchmark.metrics.request_totals
    if totals.incomplete:
        run.notes.append(
            f"{totals.incomplete} incomplete request(s) (cancelled at guidellm's window edge) "
            "are left out, as the lab leaves out requests an interrupted run did not finish"
        )
    rows = request_frame(benchmark)
    if rows is None:
        run.notes.append(
            "the report keeps a sample of the requests, not every one: the metrics are "
            "guidellm's aggregates"
        )
    else:
        frame, arrival_known = rows
        run.requests = frame
        put_request_metrics(
            run,
            frame,
            arrival=ARRIVAL if arrival_known else None,
            tokens="as guidellm counts them (the server's usage, else streamed iterations)",
            sources={
                "first_token_s": "first_token_iteration",
                "last_token_s": "last_token_iteration",
            },
        )
    put_aggregates(run, benchmark)
    run.config = config_of(report, benchmark)
    return run


def import_report(data: Any, path: Path) -> list[ImportedRun]:
    """One run per benchmark of the report."""
    report = validate(Report, data, path, WHAT)
    if not report.benchmarks:
        raise InteropError(f"{path}: {WHAT} with no benchmark in it")
    return [import_benchmark(report, k, path) for k in range(len(report.benchmarks))]


def looks_like(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("benchmarks"), list)
        and (
            "guidellm_version" in (data.get("metadata") or {})
            or any(
                isinstance(b, dict) and b.get("type_") == "generative_benchmark"
                for b in data["benchmarks"]
            )
        )
    )
