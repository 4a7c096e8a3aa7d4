"""AIPerf's exports (AIPerf 0.13; `aiperf/common/models/record_models.py`,
`aiperf/metrics/types/`) into the lab's terms: the summary `profile_export_aiperf.json` (or its
CSV, rounded to two decimals) and the per-request records `profile_export.jsonl` beside it,
found by name from whichever of them is given.

With the records (one per request of the profiling phase, as many as the summary counts), the
lab computes its own metrics over them: arrival = when AIPerf issued the request's credit (its
schedule: the rate's next slot, or a free concurrency slot), send = request start, first and
last token = send + TTFT and send + request latency; ITL from each record's chunk gaps. The
summary fills the rest; what differs (docs/metrics.md, crosswalk):

- `time_to_first_token`, `request_latency`: from the request start (send), not the credit;
  latency ends at the last content chunk;
- `inter_token_latency` is per request (latency - TTFT) / (OSL - 1): the lab's TPOT;
- `inter_chunk_latency`: one gap per content chunk (its percentiles t-digest estimates);
- throughputs over AIPerf's benchmark duration (first request start -> last response);
- percentiles of single-valued metrics are numpy's (linear interpolation), as the lab's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from harness.interop.errors import InteropError
from harness.interop.imported import Definition, ImportedRun
from harness.interop.recompute import CHUNK_ITL_NOTE, put_chunk_itl, put_request_metrics
from harness.interop.sources import parse_json, parse_json_documents, read_text, validate
from harness.interop.unit_stats import (
    SECONDS_PER_UNIT,
    Stat,
    put_stat,
    stats_from_csv,
    stats_from_json,
    value_of,
)

FORMAT = "AIPerf profile export"
SUMMARY_SUFFIX = "_aiperf"  # profile_export_aiperf.json / .csv beside profile_export.jsonl
ARRIVAL = "when AIPerf issued the request's credit (credit_issued_ns)"
DURATION = "over AIPerf's benchmark duration (first request start -> last response)"
FROM_SEND = "from the request start (send), not the credit (arrival)"
#: summary tags the lab reads (every other one is listed as unmapped)
TIMES = {
    "time_to_first_token": ("ttft", False, FROM_SEND),
    "inter_token_latency": (
        "tpot",
        True,
        "(request latency - TTFT) / (OSL - 1) per request, N > 1; OSL from the server's usage "
        "with --use-server-token-count, else AIPerf's tokenizer",
    ),
    "inter_chunk_latency": ("itl", False, CHUNK_ITL_NOTE + "; its percentiles t-digest estimates"),
    "request_latency": ("e2e", False, FROM_SEND + "; ends at the last content chunk"),
}
RATES = {
    "request_throughput": "req_per_s",
    "output_token_throughput": "output_tok_per_s",
    "input_token_throughput": "input_tok_per_s",
    "total_token_throughput": "total_tok_per_s",
    "goodput": "goodput_req_per_s",
}
COUNTS = (
    "benchmark_duration",
    "request_count",
    "error_request_count",
    "completed_request_count",
    "total_isl",
    "total_osl",
)


class RecordMetadata(BaseModel):
    model_config = ConfigDict(extra="allow")

    request_start_ns: int
    request_end_ns: int
    credit_issued_ns: int | None = None
    benchmark_phase: str | None = None
    was_cancelled: bool = False
    x_request_id: str | None = None
    session_num: int | None = None


class MetricValue(BaseModel):
    value: float | list[float]
    unit: str


class ErrorDetails(BaseModel):
    model_config = ConfigDict(extra="allow")

    message: str
    code: int | None = None


class Record(BaseModel):
    """One line of profile_export.jsonl (AIPerf's MetricRecordInfo)."""

    metadata: RecordMetadata
    metrics: dict[str, MetricValue] = Field(default_factory=dict)
    error: ErrorDetails | None = None


class Summary(BaseModel):
    """profile_export_aiperf.json's header; its metrics are read as unit_stats records."""

    model_config = ConfigDict(extra="allow")

    aiperf_version: str | None = None
    schema_version: str | None = None
    was_cancelled: bool = False
    is_complete: bool | None = None
    input_config: dict[str, Any] = Field(default_factory=dict)
    error_summary: list[Any] = Field(default_factory=list)


def siblings(path: Path) -> tuple[Path, Path, Path]:
    """(summary JSON, summary CSV, records JSONL) named as AIPerf names them beside `path`."""
    stem = path.stem.removesuffix(SUMMARY_SUFFIX)
    folder = path.parent
    return (
        folder / f"{stem}{SUMMARY_SUFFIX}.json",
        folder / f"{stem}{SUMMARY_SUFFIX}.csv",
        folder / f"{stem}.jsonl",
    )


def _seconds(metric: MetricValue | None, name: str, path: Path) -> float | None:
    if metric is None or isinstance(metric.value, list):
        return None
    if metric.unit not in SECONDS_PER_UNIT:
        raise InteropError(f"{path}: record metric '{name}' has unit {metric.unit!r}")
    return float(metric.value) * SECONDS_PER_UNIT[metric.unit]


def _count(metric: MetricValue | None) -> float | None:
    return None if metric is None or isinstance(metric.value, list) else float(metric.value)


def read_records(path: Path) -> tuple[pd.DataFrame, list[float], int, bool]:
    """The profiling phase's records as the lab's rows (seconds from the first credit, or the
    first start without credits), their pooled chunk gaps (seconds), the number of cancelled
    records left out, and whether every record has its credit (the scheduled arrival)."""
    documents = parse_json_documents(path, read_text(path))
    records = []
    cancelled = 0
    for number, document in enumerate(documents, 1):
        record = validate(Record, document, path, f"an AIPerf record (line {number})")
        if record.metadata.benchmark_phase not in (None, "profiling"):
            continue  # warm-up requests stay out, as the lab's warm-up does
        if record.metadata.was_cancelled:
            cancelled += 1
            continue
        records.append((number, record))
    if not records:
        raise InteropError(f"{path}: no record of the profiling phase")
    credits_known = all(r.metadata.credit_issued_ns is not None for _, r in records)
    # rebased in integer nanoseconds: epoch seconds as floats keep only ~0.2 us
    t0 = min(
        (r.metadata.credit_issued_ns or 0) if credits_known else r.metadata.request_start_ns
        for _, r in records
    )
    rows, gaps = [], []
    for number, record in records:
        meta = record.metadata
        sent = (meta.request_start_ns - t0) / 1e9
        ttft = _seconds(record.metrics.get("time_to_first_token"), "time_to_first_token", path)
        latency = _seconds(record.metrics.get("request_latency"), "request_latency", path)
        ok = record.error is None
        rows.append(
            {
                "request_id": meta.x_request_id or str(meta.session_num or number - 1),
                "status": "ok" if ok else "failed",
                "error": None if ok else record.error.message if record.error else None,
                "arrival_s": (meta.credit_issued_ns - t0) / 1e9
                if credits_known and meta.credit_issued_ns is not None
                else sent,
                "sent_s": sent,
                "first_token_s": sent + ttft if ok and ttft is not None else None,
                "last_token_s": sent + latency if ok and latency is not None else None,
                "finished_s": (meta.request_end_ns - t0) / 1e9,
                "prompt_tokens": _count(record.metrics.get("input_sequence_length")),
                "output_tokens": _count(record.metrics.get("output_sequence_length")),
            }
        )
        chunks = record.metrics.get("inter_chunk_latency")
        if ok and chunks is not None and isinstance(chunks.value, list):
            gaps += [float(g) * SECONDS_PER_UNIT.get(chunks.unit, 1e-3) for g in chunks.value]
    frame = pd.DataFrame(rows).sort_values(["arrival_s", "request_id"]).reset_index(drop=True)
    return frame, gaps, cancelled, credits_known


def put_summary(run: ImportedRun, stats: dict[str, Stat], path: Path) -> None:
    for tag, (lab, same, note) in TIMES.items():
        put_stat(run, stats, tag, lab, same=same, note=note, path=path)
    for tag, lab in RATES.items():
        run.put(lab, value_of(stats, tag), Definition(f"{tag}.avg", False, DURATION))
    duration = stats.get("benchmark_duration")
    if duration is not None and duration.get("avg") is not None:
        scale = duration.seconds_per_unit("benchmark_duration", path)
        run.put(
            "duration_s",
            duration.get("avg") * scale,  # type: ignore[operator]
            Definition("benchmark_duration.avg", False, "first request start -> last response"),
        )
    valid = value_of(stats, "request_count")
    failed = value_of(stats, "error_request_count")
    if failed is None and valid is not None:
        # AIPerf writes no error count when nothing failed; its total (success + error) says
        total = value_of(stats, "completed_request_count")
        failed = total - valid if total is not None else None
    run.put("num_completed", valid, Definition("request_count.avg", True, "valid requests"))
    run.put("num_failed", failed, Definition("error_request_count.avg", True))
    if valid is not None and failed is not None:
        run.put("num_requests", valid + failed, Definition("request_count + errors", True))
    every = failed == 0
    note = "" if every else "valid requests only (the lab: every request)"
    run.put(
        "input_tokens_total", value_of(stats, "total_isl"), Definition("total_isl.avg", every, note)
    )
    run.put(
        "output_tokens_total",
        value_of(stats, "total_osl"),
        Definition("total_osl.avg", every, note),
    )
    used = set(TIMES) | set(RATES) | set(COUNTS)
    run.leave_out(*sorted(tag for tag in stats if tag not in used))


def config_of(summary: Summary | None, records: pd.DataFrame | None) -> dict[str, Any]:
    config = summary.input_config if summary else {}
    models = [
        m.get("name") for m in (config.get("models") or {}).get("items", []) if isinstance(m, dict)
    ]
    endpoint = config.get("endpoint") or {}
    datasets = [d for d in config.get("datasets") or [] if isinstance(d, dict)]
    phases = [p for p in config.get("phases") or [] if isinstance(p, dict)]
    profiling = next((p for p in phases if p.get("kind") == "profiling"), {})
    prompts = (datasets[0].get("prompts") or {}) if datasets else {}
    workload: dict[str, Any] = {
        "num_requests": profiling.get("requests")
        if profiling.get("requests") is not None
        else (None if records is None else len(records)),
        "input_len": (prompts.get("isl") or {}).get("mean"),
        "output_len": (prompts.get("osl") or {}).get("mean"),
    }
    if profiling.get("type") == "concurrency":
        workload["arrival"] = {"process": "closed", "concurrency": profiling.get("concurrency")}
    elif profiling.get("rate") is not None:
        workload["arrival"] = {"rate": profiling.get("rate"), "aiperf_type": profiling.get("type")}
    return {
        "source": {"tool": "aiperf", "phase": profiling or None},
        "model": {"name": models[0] if models else None},
        "target": {
            "url": (endpoint.get("urls") or [None])[0],
            "endpoint": endpoint.get("type"),
            "streaming": endpoint.get("streaming"),
        },
        "workload": {k: v for k, v in workload.items() if v is not None},
    }


def import_export(path: Path, content: Any, kind: str) -> list[ImportedRun]:
    """`content`: the parsed summary JSON (kind "json"), the CSV text ("csv") or the records'
    JSON documents ("jsonl"); the other files are looked for beside `path`."""
    summary_json, _, records_path = siblings(path)
    files = [path]
    summary: Summary | None = None
    stats: dict[str, Stat] = {}
    if kind == "csv":
        stats = stats_from_csv(content, path)
    elif kind == "json":
        summary = validate(Summary, content, path, "an AIPerf summary (profile_export_aiperf.json)")
        stats = stats_from_json(content, path)
    if kind in ("csv", "jsonl") and summary_json.is_file() and summary_json != path:
        data = parse_json(summary_json, read_text(summary_json))
        summary = validate(Summary, data, summary_json, "an AIPerf summary")
        if kind == "jsonl":
            stats = stats_from_json(data, summary_json)
            files.append(summary_json)
    if kind == "json" and not stats:
        raise InteropError(f"{path}: an AIPerf summary without any metric record")
    run = ImportedRun(
        tool="aiperf",
        format=FORMAT,
        files=files,
        tool_version=summary.aiperf_version if summary else None,
    )
    if summary and (summary.was_cancelled or summary.is_complete is False):
        run.status, run.error = "incomplete", "AIPerf says the profile was cancelled"
    records = None
    if kind == "jsonl" or records_path.is_file():
        source = path if kind == "jsonl" else records_path
        records, gaps, cancelled, arrival_known = read_records(source)
        if source not in files:
            files.append(source)
        valid, failed = value_of(stats, "request_count"), value_of(stats, "error_request_count")
        ok = int((records["status"] == "ok").sum())
        if cancelled:
            run.notes.append(f"{cancelled} cancelled record(s) left out")
        if valid is not None and (
            ok != valid or (failed is not None and len(records) - ok != failed)
        ):
            mismatch = f"the records hold {ok} valid requests, the summary counts {valid:g}"
            run.notes.append(f"{mismatch}: the metrics are AIPerf's aggregates")
            run.warnings.append(
                f"{source}: {mismatch}: the metrics are AIPerf's aggregates, no per-request "
                "rows imported"
            )
            records = None
        else:
            run.rows_file = source
            run.requests = records
            put_request_metrics(
                run,
                records,
                arrival=ARRIVAL if arrival_known else None,
                tokens="as AIPerf counts them (the server's usage with --use-server-token-count, "
                "else its tokenizer)",
                sources={
                    "first_token_s": "time_to_first_token",
                    "last_token_s": "request_latency",
                },
            )
            put_chunk_itl(run, np.array(gaps, dtype=float), "records' inter_chunk_latency")
    if kind == "csv":
        run.notes.append("from AIPerf's CSV: values rounded to the two decimals it writes")
    put_summary(run, stats, path)
    run.config = config_of(summary, records)
    return [run]


def looks_like_summary(data: Any) -> bool:
    return isinstance(data, dict) and (
        "aiperf_version" in data
        or (
            "schema_version" in data
            and isinstance(data.get("time_to_first_token", data.get("request_latency")), dict)
        )
    )


def looks_like_record(data: Any) -> bool:
    return (
        isinstance(data, dict)
        and isinstance(data.get("metadata"), dict)
        and "request_start_ns" in data["metadata"]
    )
