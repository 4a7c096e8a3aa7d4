"""genai-perf's exports (triton-inference-server/perf_analyzer `genai-perf`:
`export_data/json_exporter.py`, `csv_exporter.py`, `metrics/statistics.py`,
`profile_data_parser/llm_profile_data_parser.py`) into the lab's terms:
`profile_export_genai_perf.json` (statistics and the `input_config` it ran with) or its CSV.
Statistics only: genai-perf's per-request file is perf_analyzer's raw profile (response texts,
which it re-tokenizes), not read here. What differs (docs/metrics.md, crosswalk):

- `time_to_first_token`, `request_latency`: from the send; latency ends at the last response;
- `inter_token_latency`: (request latency - TTFT) / (N - 1) per request, N > 1, N by
  re-tokenizing the text: the lab's TPOT;
- `request_throughput`: every request of the profile (errored ones too) / duration;
  `output_token_throughput`: output tokens / duration; duration = first request -> last
  response;
- percentiles: numpy's (linear interpolation), as the lab's; no request counts in the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from harness.interop.errors import InteropError
from harness.interop.imported import Definition, ImportedRun
from harness.interop.sources import validate
from harness.interop.unit_stats import Stat, put_stat, stats_from_csv, stats_from_json, value_of

FORMAT = "genai-perf profile export"
FROM_SEND = "from the send, not the scheduled arrival"
DURATION = "over genai-perf's duration (first request -> last response)"
TIMES = {
    "time_to_first_token": ("ttft", False, FROM_SEND),
    "inter_token_latency": (
        "tpot",
        True,
        "(request latency - TTFT) / (N - 1) per request, N > 1, N by re-tokenizing the text",
    ),
    "request_latency": ("e2e", False, FROM_SEND + "; ends at the last response"),
}
RATES = {
    "request_throughput": ("req_per_s", "every request of the profile, errored ones too, "),
    "output_token_throughput": ("output_tok_per_s", "output tokens (re-tokenized) "),
    "request_goodput": ("goodput_req_per_s", "requests meeting --goodput "),
}


class Export(BaseModel):
    """profile_export_genai_perf.json: statistics records and the arguments it ran with."""

    model_config = ConfigDict(extra="allow")

    input_config: dict[str, Any] = Field(default_factory=dict)


def config_of(settings: dict[str, Any]) -> dict[str, Any]:
    models = settings.get("model")
    workload: dict[str, Any] = {
        "num_requests": settings.get("request_count") or None,
        "input_len": settings.get("synthetic_input_tokens_mean"),
        "output_len": settings.get("output_tokens_mean"),
    }
    if settings.get("concurrency"):
        workload["arrival"] = {"process": "closed", "concurrency": settings["concurrency"]}
    elif settings.get("request_rate"):
        workload["arrival"] = {"rate": settings["request_rate"]}
    return {
        "source": {"tool": "genai-perf", "service_kind": settings.get("service_kind")},
        "model": {"name": models[0] if isinstance(models, list) and models else models},
        "target": {
            "url": settings.get("u") or settings.get("url"),
            "endpoint": settings.get("endpoint_type"),
            "streaming": settings.get("streaming"),
        },
        "workload": {k: v for k, v in workload.items() if v is not None},
    }


def import_export(path: Path, content: Any, kind: str) -> list[ImportedRun]:
    """`content`: the parsed JSON (kind "json") or the CSV text ("csv")."""
    settings: dict[str, Any] = {}
    if kind == "csv":
        stats: dict[str, Stat] = stats_from_csv(content, path)
    else:
        settings = validate(Export, content, path, "a genai-perf export").input_config
        stats = stats_from_json(content, path)
    if not any(tag in stats for tag in (*TIMES, *RATES)):
        raise InteropError(
            f"{path}: not a genai-perf export: none of its metrics ({', '.join([*TIMES, *RATES])})"
        )
    run = ImportedRun(tool="genai-perf", format=FORMAT, files=[path])
    for tag, (lab, same, note) in TIMES.items():
        put_stat(run, stats, tag, lab, same=same, note=note, path=path)
    for tag, (lab, what) in RATES.items():
        run.put(lab, value_of(stats, tag), Definition(f"{tag}.avg", False, what + DURATION))
    run.leave_out(*sorted(tag for tag in stats if tag not in TIMES and tag not in RATES))
    if kind == "csv":
        run.notes.append("from genai-perf's CSV: values rounded to the two decimals it writes")
    run.notes.append("genai-perf's export has no request counts and no per-request rows")
    run.config = config_of(settings)
    return [run]


def looks_like(data: Any) -> bool:
    settings = data.get("input_config") if isinstance(data, dict) else None
    return (
        isinstance(settings, dict)
        and "aiperf_version" not in data
        and ("service_kind" in settings or "endpoint_type" in settings)
        and isinstance(data.get("request_throughput"), dict)
    )
