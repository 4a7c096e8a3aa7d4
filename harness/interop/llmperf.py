"""LLMPerf's results (ray-project/llmperf `token_benchmark_ray.py`, `src/llmperf/utils.py`
`LLMPerfResults` / `flatten_dict`, `src/llmperf/common_metrics.py`) into the lab's terms:
`<name>_summary.json` (the flattened summary: `results_<metric>_mean`,
`results_<metric>_quantiles_p50`, ...) and `<name>_individual_responses.json` beside it (one
object per request), found by name from whichever is given.

LLMPerf records no request start times, so the individual responses give latencies and
counts but no timeline: the lab computes TTFT, E2E, TPOT and the counts over them (their
times are not written: each is from its own request's send), and takes the throughputs from
the summary. What differs (docs/metrics.md, crosswalk):

- `ttft_s`: from the send; `end_to_end_latency_s`: send -> the stream closed (after the last
  token), so the lab's TPOT over it, (E2E - TTFT) / (N - 1), includes that tail;
- `inter_token_latency_s` is per request (sum of every gap, TTFT included) / N: neither the
  lab's ITL nor its TPOT (unmapped);
- output tokens are counted by re-tokenizing the text with LLMPerf's Llama tokenizer;
- `results_mean_output_throughput_token_per_s` and `results_num_completed_requests_per_min`
  are over the test's wall time (start -> end, timeout included).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pandas as pd
from pydantic import BaseModel, ConfigDict

from harness.interop.errors import InteropError
from harness.interop.imported import Definition, ImportedRun
from harness.interop.recompute import put_request_metrics, without_times
from harness.interop.sources import parse_json, read_text, validate
from harness.measuring.metrics import find_metric, percentile_stat

FORMAT = "LLMPerf token benchmark results"
SUMMARY_SUFFIX = "_summary"
RESPONSES_SUFFIX = "_individual_responses"
WALL = "over LLMPerf's test wall time (start -> end, the timeout included)"
FROM_SEND = "from the send, not the scheduled arrival"
#: a summary key's statistic: `mean`, or `quantiles_pNN` (pandas' quantile: linear
#: interpolation, as the lab's); not `stddev` (pandas' ddof=1, the lab's std has ddof=0)
STAT = re.compile(r"^(mean|quantiles_p(\d+(?:\.\d+)?))$")
LATENCIES = {
    "ttft_s": ("ttft", FROM_SEND),
    "end_to_end_latency_s": ("e2e", FROM_SEND + "; ends when the stream closed"),
}


class Summary(BaseModel):
    model_config = ConfigDict(extra="allow")

    results_num_completed_requests: int
    results_number_errors: int | None = None
    results_num_requests_started: int | None = None
    results_mean_output_throughput_token_per_s: float | None = None
    results_num_completed_requests_per_min: float | None = None
    version: str | None = None
    name: str | None = None
    model: str | None = None
    mean_input_tokens: int | None = None
    mean_output_tokens: int | None = None
    num_concurrent_requests: int | None = None


class Response(BaseModel):
    """One request's metrics (common_metrics.py's keys)."""

    model_config = ConfigDict(extra="allow")

    ttft_s: float
    end_to_end_latency_s: float
    number_input_tokens: int
    number_output_tokens: int
    error_code: int | None = None
    error_msg: str | None = None


def siblings(path: Path) -> tuple[Path, Path]:
    """(summary, individual responses) named as LLMPerf names them beside `path`."""
    stem = path.stem.removesuffix(SUMMARY_SUFFIX).removesuffix(RESPONSES_SUFFIX)
    return (
        path.with_name(f"{stem}{SUMMARY_SUFFIX}.json"),
        path.with_name(f"{stem}{RESPONSES_SUFFIX}.json"),
    )


def read_responses(path: Path, data: Any, notes: list[str]) -> pd.DataFrame:
    """The individual responses as the lab's rows, each timed from its own send (0)."""
    if not isinstance(data, list):
        raise InteropError(f"{path}: not LLMPerf's individual responses: expected a JSON list")
    # token_benchmark_ray.py's last collection loop extends the list with a response's keys
    # instead of the response (`completed_requests.extend(request_metrics)`): text entries
    strays = [item for item in data if isinstance(item, str)]
    if strays:
        notes.append(f"{len(strays)} text entries (LLMPerf's extend of a response's keys) skipped")
    rows = []
    for k, item in enumerate(x for x in data if not isinstance(x, str)):
        response = validate(Response, item, path, f"an LLMPerf response (entry {k})")
        ok = response.error_code is None
        rows.append(
            {
                "request_id": str(k),
                "status": "ok" if ok else "failed",
                "error": None if ok else (response.error_msg or f"error {response.error_code}"),
                "arrival_s": 0.0,
                "sent_s": 0.0,
                "first_token_s": response.ttft_s if ok else None,
                "last_token_s": response.end_to_end_latency_s if ok else None,
                "prompt_tokens": response.number_input_tokens,
                "output_tokens": response.number_output_tokens if ok else 0,
            }
        )
    if not rows:
        raise InteropError(f"{path}: no response in LLMPerf's individual responses")
    return pd.DataFrame(rows)


def put_summary(run: ImportedRun, summary: Summary) -> None:
    extra = summary.model_extra or {}
    for key, (lab, note) in LATENCIES.items():
        for source in extra:
            match = STAT.match(source.removeprefix(f"results_{key}_"))
            if not source.startswith(f"results_{key}_") or match is None:
                continue
            stat = "mean" if match[2] is None else percentile_stat(float(match[2]))
            if find_metric(f"{lab}_{stat}_s") is not None:
                run.put(f"{lab}_{stat}_s", extra[source], Definition(source, False, note))
    run.put(
        "num_completed",
        summary.results_num_completed_requests,
        Definition("results_num_completed_requests", True),
    )
    run.put("num_failed", summary.results_number_errors, Definition("results_number_errors", True))
    run.put(
        "num_requests",
        summary.results_num_requests_started,
        Definition("results_num_requests_started", True),
    )
    run.put(
        "output_tok_per_s",
        summary.results_mean_output_throughput_token_per_s,
        Definition(
            "results_mean_output_throughput_token_per_s",
            False,
            "re-tokenized output tokens of successful requests " + WALL,
        ),
    )
    per_min = summary.results_num_completed_requests_per_min
    run.put(
        "req_per_s",
        None if per_min is None else per_min / 60,
        Definition("results_num_completed_requests_per_min / 60", False, WALL),
    )
    run.leave_out(
        *sorted(
            key
            for key in extra
            if key.startswith("results_")
            and not any(key.startswith(f"results_{k}_") for k in LATENCIES)
        )
    )


def config_of(summary: Summary | None, rows: pd.DataFrame | None) -> dict[str, Any]:
    if summary is None:
        counted = {} if rows is None else {"num_requests": len(rows)}
        return {"source": {"tool": "llmperf"}, "workload": counted}
    workload: dict[str, Any] = {
        "num_requests": summary.results_num_requests_started,
        "input_len": summary.mean_input_tokens,
        "output_len": summary.mean_output_tokens,
    }
    if summary.num_concurrent_requests is not None:
        workload["arrival"] = {"process": "closed", "concurrency": summary.num_concurrent_requests}
    return {
        "source": {"tool": "llmperf", "name": summary.name},
        "model": {"name": summary.model},
        "workload": {k: v for k, v in workload.items() if v is not None},
    }


def import_results(path: Path, data: Any) -> list[ImportedRun]:
    """`data`: the parsed summary (an object) or individual responses (a list); the other file
    is looked for beside `path`."""
    summary_path, responses_path = siblings(path)
    run = ImportedRun(tool="llmperf", format=FORMAT, files=[path])
    summary: Summary | None = None
    responses: Any = None
    if isinstance(data, dict):
        summary = validate(Summary, data, path, "an LLMPerf summary (*_summary.json)")
        if responses_path.is_file():
            responses = parse_json(responses_path, read_text(responses_path))
            run.files.append(responses_path)
    else:
        responses = data
        if summary_path.is_file():
            summary_data = parse_json(summary_path, read_text(summary_path))
            summary = validate(Summary, summary_data, summary_path, "an LLMPerf summary")
            run.files.append(summary_path)
    run.tool_version = summary.version if summary else None  # LLMPerf's results version
    rows = None
    if responses is not None:
        rows = read_responses(
            responses_path if isinstance(data, dict) else path, responses, run.notes
        )
        if summary is not None and len(rows) != summary.results_num_requests_started:
            run.notes.append(
                f"{len(rows)} individual responses, the summary counts "
                f"{summary.results_num_requests_started} requests: the metrics are the summary's"
            )
            rows = None
    if rows is not None:
        run.rows_file = responses_path if isinstance(data, dict) else path
        run.requests = without_times(rows)
        put_request_metrics(
            run,
            rows,
            arrival=None,
            timeline=False,
            tokens="as LLMPerf counts them (output re-tokenized with its Llama tokenizer)",
            last_token="the stream's end (end_to_end_latency_s)",
            sources={"first_token_s": "ttft_s", "last_token_s": "end_to_end_latency_s"},
        )
    if summary is not None:
        put_summary(run, summary)
    run.config = config_of(summary, rows)
    return [run]


def looks_like_summary(data: Any) -> bool:
    return isinstance(data, dict) and "results_num_completed_requests" in data


def looks_like_responses(data: Any) -> bool:
    items = [x for x in data if isinstance(x, dict)] if isinstance(data, list) else []
    return bool(items) and all("ttft_s" in x and "end_to_end_latency_s" in x for x in items)
