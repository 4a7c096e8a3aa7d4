"""The result JSON of `vllm bench serve --save-result`: its keys, and its traffic settings in
the lab's terms. Read from vllm-project/vllm `vllm/benchmarks/serve.py` (`benchmark`,
`calculate_metrics`, `main_async`); shared by the exporter and the importer.

Statistics are `mean_X_ms`, `median_X_ms`, `std_X_ms` and `pP_X_ms` for each P of
`--metric-percentiles` (default 99; P written as an integer when it is one: p99, p99.9) and
each X of `--percentile-metrics` (vLLM's default: ttft, tpot, itl)."""

from __future__ import annotations

import math
import re
from typing import Any

#: Every statistic vLLM can report (`--percentile-metrics`).
PERCENTILE_METRICS = (
    "ttft",
    "tpot",
    "itl",
    "e2el",
    "client_queue_time",
    "e2el_including_client_queue",
)
#: The exporter's default: vLLM's (ttft, tpot, itl) and the end-to-end latency.
EXPORT_PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")
#: vLLM's name -> the lab's metric prefix (client_queue_time and the queue-inclusive E2E have
#: no registered counterpart).
LAB_PREFIX = {"ttft": "ttft", "tpot": "tpot", "itl": "itl", "e2el": "e2e"}
#: The per-request lists that `--save-detailed` keeps (without it vLLM deletes them).
DETAIL_KEYS = (
    "input_lens",
    "output_lens",
    "start_times",
    "ttfts",
    "itls",
    "generated_texts",
    "errors",
)
STAT_KEY = re.compile(r"^(mean|median|std|p(\d+(?:\.\d+)?))_([a-z0-9_]+?)_ms$")


def percentile_word(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if int(p) == p else str(p)


def stat_keys(metric: str, percentiles: list[float]) -> dict[str, str]:
    """statistic (mean, median, std, p99, ...) -> its key for `metric`."""
    keys = {stat: f"{stat}_{metric}_ms" for stat in ("mean", "median", "std")}
    for p in percentiles:
        keys[f"p{percentile_word(p)}"] = f"p{percentile_word(p)}_{metric}_ms"
    return keys


def traffic_from_arrival(arrival: dict[str, Any]) -> dict[str, Any]:
    """The lab's `workload.arrival` as vLLM's traffic keys: request_rate ("inf" when every
    request is due at once), burstiness (the gamma shape; 1 = Poisson, inf = constant gaps),
    max_concurrency and, for a ramp, vLLM's linear ramp-up. A closed loop of C users is
    vLLM's nearest: every request due at once, at most C in flight."""
    process = arrival.get("process", "offline")
    out: dict[str, Any] = {
        "request_rate": "inf",
        "burstiness": 1.0,
        "max_concurrency": arrival.get("max_concurrency"),
    }
    if process in ("poisson", "gamma", "constant"):
        out["request_rate"] = float(arrival["rate"])
        if process == "gamma":
            out["burstiness"] = float(arrival["burstiness"])
        elif process == "constant":
            out["burstiness"] = math.inf
    elif process == "ramp":
        out.update(
            ramp_up_strategy="linear",
            ramp_up_start_rps=arrival.get("start_rate"),
            ramp_up_end_rps=arrival.get("end_rate"),
        )
    elif process == "closed":
        out["max_concurrency"] = arrival.get("concurrency")
    return out


def arrival_from_traffic(result: dict[str, Any]) -> dict[str, Any]:
    """vLLM's traffic keys as the lab's `workload.arrival` (what the file says; keys it does
    not have are left out)."""
    rate = result.get("request_rate")
    burstiness = result.get("burstiness")
    arrival: dict[str, Any]
    if result.get("ramp_up_strategy") is not None:
        arrival = {
            "process": "ramp",
            "start_rate": result.get("ramp_up_start_rps"),
            "end_rate": result.get("ramp_up_end_rps"),
            "ramp_up_strategy": result["ramp_up_strategy"],
        }
    elif rate is None:
        arrival = {}
    elif rate == "inf" or (isinstance(rate, float) and math.isinf(rate)):
        arrival = {"process": "offline"}
    elif burstiness is None or burstiness == 1.0:
        arrival = {"process": "poisson", "rate": float(rate)}
    elif math.isinf(float(burstiness)):
        arrival = {"process": "constant", "rate": float(rate)}
    else:
        arrival = {"process": "gamma", "rate": float(rate), "burstiness": float(burstiness)}
    if result.get("max_concurrency") is not None:
        arrival["max_concurrency"] = result["max_concurrency"]
    return arrival
