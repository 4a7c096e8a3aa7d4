"""`vllm bench serve --save-result` JSON (one result, or one per line with --append-result)
into the lab's terms.

With `--save-detailed` the file holds every request (start time, client queue time, TTFT,
latency, chunk gaps, lengths, error): the lab then computes its own metrics over those rows
(recompute.py), with the scheduled arrival = start - queue time (vLLM's `queue_times`, present
in current versions), and the ITL statistics from the chunk gaps. vLLM's own aggregates fill
what the rows do not give, each with its definition (docs/metrics.md, crosswalk):

- `*_ttft_ms`, `*_e2el_ms`: from the send, not the scheduled arrival; E2EL ends at the last
  chunk;
- `*_tpot_ms`: (latency - TTFT) / (N - 1), N > 1: the lab's TPOT;
- `*_itl_ms`: one gap per streamed chunk (the lab: one per token);
- throughputs over vLLM's duration (benchmark start -> every request done, failed ones
  included; the lab: first arrival -> last completion); token totals of successful requests;
- a statistic over no sample is written as 0 by vLLM (`np.mean(x or 0)`): read as absent.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pydantic import BaseModel, ConfigDict

from harness.interop.errors import InteropError
from harness.interop.imported import Definition, ImportedRun
from harness.interop.recompute import put_chunk_itl, put_request_metrics, without_times
from harness.interop.sources import validate
from harness.interop.vllm_format import LAB_PREFIX, STAT_KEY, arrival_from_traffic
from harness.measuring.metrics import REGISTRY, find_metric, percentile_stat

FORMAT = "vllm bench serve --save-result JSON"
WHAT = "a vllm bench serve result (--save-result JSON)"
FROM_SEND = "from the send, not the scheduled arrival (vLLM's start_time)"
VLLM_DURATION = "over vLLM's duration: benchmark start -> every request done (failed included)"
NOTES = {
    "ttft": FROM_SEND,
    "tpot": "(latency - TTFT) / (N - 1), N > 1, N from the server's usage (else re-tokenized)",
    "itl": "one gap per streamed chunk (the lab: one per token, 0 within a multi-token event)",
    "e2el": FROM_SEND + "; ends at the last streamed chunk",
}


class VllmResult(BaseModel):
    """The keys the lab reads; everything else (statistics, metadata) passes as extra keys.
    Lists are per request, in dispatch order."""

    model_config = ConfigDict(extra="allow")

    duration: float
    completed: int
    total_input_tokens: int
    request_throughput: float
    failed: int | None = None
    total_output_tokens: int | None = None
    output_throughput: float | None = None
    total_token_throughput: float | None = None
    request_goodput: float | None = None
    date: str | None = None
    backend: str | None = None
    label: str | None = None
    model_id: str | None = None
    tokenizer_id: str | None = None
    num_prompts: int | None = None
    request_rate: float | str | None = None
    burstiness: float | None = None
    max_concurrency: int | None = None
    input_lens: list[int] | None = None
    output_lens: list[int | None] | None = None
    ttfts: list[float | None] | None = None
    itls: list[list[float]] | None = None
    latencies: list[float | None] | None = None
    start_times: list[float | None] | None = None
    queue_times: list[float | None] | None = None
    errors: list[str | None] | None = None
    spec_decode_acceptance_rate: float | None = None
    spec_decode_acceptance_length: float | None = None


def _numbers(values: list[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def _entry(raw: float | None, value: float) -> str:
    """What one unusable entry holds, in words."""
    if raw is None:
        return "null"
    if np.isnan(value):
        return "NaN"
    return "infinite" if np.isinf(value) else "0 or negative"


def _held(raw: list[float | None], values: np.ndarray, where: np.ndarray) -> str:
    """What the entries at `where` held, counted: "NaN (2), null (1)"."""
    kinds = Counter(_entry(raw[k], values[k]) for k in np.flatnonzero(where))
    return ", ".join(f"{kind} ({count})" for kind, count in kinds.items())


def _failed_without_error(
    run: ImportedRun,
    name: str,
    raw: list[float | None],
    values: np.ndarray,
    bad: np.ndarray,
    why: str | None = None,
) -> list[str | None]:
    """Requests vLLM records no error for, whose `name` entry is no usable time (`why`, by
    default what it holds): counted as failed, said (run.warn_unusable), and each row's error
    says why."""
    if bad.any():
        run.warn_unusable(
            name,
            int(bad.sum()),
            f"{why}: counted as failed"
            if why
            else f"is {_held(raw, values, bad)} with no error recorded: counted as failed "
            "(vLLM writes NaN for some requests)",
        )
    return [
        (
            f"vLLM's {name} entry ({_entry(raw[k], values[k])}) {why}"
            if why
            else f"vLLM's {name} entry is {_entry(raw[k], values[k])}, with no error recorded"
        )
        if bad[k]
        else None
        for k in range(len(bad))
    ]


def _after_the_benchmark(end: np.ndarray, result: VllmResult) -> np.ndarray:
    """Which requests end after vLLM's `duration` (benchmark start -> every request done),
    counted from the first arrival, which is not before the benchmark's start: an edited or
    damaged latency (1e308 s in a benchmark of 0.5 s). A duration its request_throughput
    contradicts is no yardstick (usable_duration says so) and flags none."""
    if not _duration_agrees(result):
        return np.zeros(len(end), dtype=bool)
    return end > result.duration * (1 + 1e-6) + 1e-6


def _finite_times(run: ImportedRun, name: str, raw: list[float | None] | None) -> bool:
    """Whether a list of per-request clock readings (start_times, queue_times) is there with
    no NaN or infinity (nulls aside): one would make every request's time NaN, so the list is
    then not used, and that is said."""
    if raw is None:
        return False
    values = _numbers(raw)
    bad = ~np.isfinite(values) & np.array([v is not None for v in raw], dtype=bool)
    if bad.any():
        run.warn_unusable(
            name, int(bad.sum()), f"is {_held(raw, values, bad)}: the list is not used"
        )
    return not bad.any()


def request_frame(
    result: VllmResult, path: Path, run: ImportedRun
) -> tuple[pd.DataFrame, bool, bool] | None:
    """The per-request rows of a --save-detailed result (lab columns), whether they carry the
    scheduled arrival (queue_times) and a common clock (start_times); None without them.
    Values the lab cannot use are said and counted in `run` (warn_unusable)."""
    if result.ttfts is None or (result.latencies is None and result.itls is None):
        return None
    n = len(result.ttfts)
    _check_list_lengths(result, path, n)
    ttft = _numbers(result.ttfts)
    if result.latencies is not None:
        latency = _numbers(result.latencies)
    else:  # older versions keep no latencies: the last chunk is the first plus its gaps
        latency = ttft + np.array([sum(g) for g in result.itls or [[]] * n], dtype=float)
    errors = result.errors or [""] * n
    ok, why_failed = _outcomes(run, result, ttft, latency, errors)
    timeline = _finite_times(run, "start_times", result.start_times) and all(
        s is not None for s in result.start_times or []
    )
    start = _numbers(result.start_times or []) if timeline else np.zeros(n)
    queued = _finite_times(run, "queue_times", result.queue_times)
    queue = np.nan_to_num(_numbers(result.queue_times or [])) if queued else np.zeros(n)
    arrival = start - queue
    t0 = float(arrival.min()) if timeline and n else 0.0
    late = ok & _after_the_benchmark(start + latency - t0, result)
    late_errors = _failed_without_error(
        run,
        "latencies",
        result.latencies or [],
        latency,
        late,
        f"ends after the benchmark's duration ({result.duration:g} s)",
    )
    ok &= ~late
    why_failed = [a or b for a, b in zip(why_failed, late_errors, strict=True)]
    outputs = result.output_lens or [None] * n
    rows = pd.DataFrame(
        {
            "request_id": [str(i) for i in range(n)],
            "status": np.where(ok, "ok", "failed"),
            "error": [
                None if k else (e or why or "failed")
                for k, e, why in zip(ok, errors, why_failed, strict=True)
            ],
            "arrival_s": arrival - t0,
            "sent_s": start - t0,
            "first_token_s": np.where(ok, start + ttft - t0, np.nan),
            "last_token_s": np.where(ok, start + latency - t0, np.nan),
            "finished_s": np.where(ok, start + latency - t0, np.nan),
            "prompt_tokens": result.input_lens if result.input_lens is not None else [None] * n,
            "output_tokens": [o if k else 0 for o, k in zip(outputs, ok, strict=True)],
        }
    )
    return rows, queued and timeline, timeline


_PER_REQUEST_LISTS = (
    "input_lens",
    "output_lens",
    "itls",
    "latencies",
    "start_times",
    "queue_times",
    "errors",
)


def _check_list_lengths(result: VllmResult, path: Path, n: int) -> None:
    """Every per-request list the result holds has one entry a request, as `ttfts` has."""
    for name in _PER_REQUEST_LISTS:
        value = getattr(result, name)
        if value is not None and len(value) != n:
            raise InteropError(
                f"{path}: not {WHAT}: '{name}' has {len(value)} entries, 'ttfts' {n}"
            )


def _outcomes(
    run: ImportedRun,
    result: VllmResult,
    ttft: np.ndarray,
    latency: np.ndarray,
    errors: list[str | None],
) -> tuple[np.ndarray, list[str | None]]:
    """Which requests succeeded, and why a failed one without vLLM's error failed (its TTFT
    or latency unusable)."""
    # vLLM records a failed request with its error and a TTFT of 0 (files without `errors`:
    # the TTFT of 0 alone)
    failed = np.array([bool(e) for e in errors], dtype=bool)  # bool: also for no row
    if result.errors is None:
        failed |= ttft == 0
    no_ttft = ~failed & ~(np.isfinite(ttft) & (ttft > 0))
    ttft_errors = _failed_without_error(run, "ttfts", result.ttfts or [], ttft, no_ttft)
    no_latency = ~failed & ~no_ttft & ~np.isfinite(latency)
    latency_errors = (
        _failed_without_error(run, "latencies", result.latencies, latency, no_latency)
        if result.latencies is not None
        else [None] * len(ttft)
    )
    why = [a or b for a, b in zip(ttft_errors, latency_errors, strict=True)]
    return ~failed & ~no_ttft & ~no_latency, why


def put_aggregates(run: ImportedRun, result: VllmResult, extra: dict[str, Any]) -> None:
    """vLLM's own statistics and totals, where the rows gave nothing."""
    _put_statistics(run, result, extra)
    _put_totals(run, result)
    _put_rates(run, result, extra)
    _put_spec_decode(run, result, extra)


def _put_statistics(run: ImportedRun, result: VllmResult, extra: dict[str, Any]) -> None:
    """vLLM's latency statistics (`mean_ttft_ms`, `p99_itl_ms`...) under the lab's names; the
    figures the lab has no name for are left out."""
    measured = result.completed > 0
    for key, value in extra.items():
        match = STAT_KEY.match(key)
        if not match:
            if _numeric(value) and key not in CONSUMED_EXTRAS:
                run.leave_out(key)  # a figure the lab has no name for (probe_*, diffusion_*...)
            continue
        if not isinstance(value, int | float):
            continue
        stat, percentile, metric = match.groups()
        lab = LAB_PREFIX.get(metric)
        if lab is None:
            run.leave_out(key)
            continue
        if stat in ("mean", "std"):  # vLLM's std is np.std's (ddof=0), as the lab's
            name = f"{lab}_{stat}_s"
        else:  # median is p50; p99.9 is p999, p5 stays p5 (the lab's spelling)
            name = f"{lab}_{percentile_stat(float(percentile or 50))}_s"
        if find_metric(name) is None:
            run.leave_out(key)
            continue
        if not measured or value == 0:  # 0: vLLM's placeholder for a statistic with no sample
            continue
        run.put(name, value / 1000, Definition(key, metric == "tpot", NOTES[metric]))


def _put_totals(run: ImportedRun, result: VllmResult) -> None:
    """The request counts and the token totals."""
    failed = result.failed or 0
    # older files have no `failed`: then vLLM's totals cannot be told to be every request's
    none_failed = result.failed == 0
    every_request = "" if none_failed else "successful requests only (the lab: every request)"
    run.put("num_completed", result.completed, Definition("completed", True))
    if result.failed is not None:
        run.put("num_failed", failed, Definition("failed", True))
        run.put("num_requests", result.completed + failed, Definition("completed + failed", True))
    run.put(
        "input_tokens_total",
        result.total_input_tokens,
        Definition("total_input_tokens", none_failed, every_request),
    )
    run.put(
        "output_tokens_total",
        result.total_output_tokens,
        Definition("total_output_tokens", none_failed, every_request),
    )


def _put_rates(run: ImportedRun, result: VllmResult, extra: dict[str, Any]) -> None:
    """The duration, the throughputs and the goodput, over vLLM's duration."""
    if usable_duration(result, run):
        run.put("duration_s", result.duration, Definition("duration", False, VLLM_DURATION))
        run.put(
            "input_tok_per_s",
            result.total_input_tokens / result.duration,
            Definition("total_input_tokens / duration", False, VLLM_DURATION),
        )
    for key, name in (
        ("request_throughput", "req_per_s"),
        ("output_throughput", "output_tok_per_s"),
        ("total_token_throughput", "total_tok_per_s"),
    ):
        run.put(name, getattr(result, key), Definition(key, False, VLLM_DURATION))
    goodput = result.request_goodput
    if goodput is None:  # benchmark_serving.py spelt the key with a colon
        goodput = extra.get("request_goodput:")
    run.put(
        "goodput_req_per_s",
        goodput,
        Definition(
            "request_goodput",
            False,
            "SLOs (--goodput, ms) on TTFT and E2EL from the send, TPOT 0 for N <= 1; "
            + VLLM_DURATION,
        ),
    )


def _put_spec_decode(run: ImportedRun, result: VllmResult, extra: dict[str, Any]) -> None:
    """Speculative decoding's acceptance, from the server's counters."""
    if result.spec_decode_acceptance_rate is not None:
        run.put(
            "spec_acceptance_rate",
            result.spec_decode_acceptance_rate / 100,  # vLLM writes a percentage
            Definition(
                "spec_decode_acceptance_rate", True, "the server's counters over the run, in %"
            ),
        )
    run.put(
        "spec_mean_accepted_length",
        result.spec_decode_acceptance_length,
        Definition("spec_decode_acceptance_length", True, "1 + accepted / drafts"),
    )
    for position, rate in enumerate(extra.get("spec_decode_per_position_acceptance_rates") or []):
        if f"spec_acceptance_rate_pos{position + 1}" in REGISTRY:
            run.put(
                f"spec_acceptance_rate_pos{position + 1}",
                rate,
                Definition(
                    f"spec_decode_per_position_acceptance_rates[{position}]",
                    True,
                    "accepted at the position / drafts (vLLM's draft models propose k every "
                    "step, so every draft has the position)",
                ),
            )


#: extra keys read above (not statistics, but not unmapped either)
CONSUMED_EXTRAS = frozenset(
    {"request_goodput:", "spec_decode_per_position_acceptance_rates", "inferlab_status"}
)


def _numeric(value: Any) -> bool:
    """A number, or a list of numbers (a figure, as opposed to metadata text)."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, int | float) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool)


def config_of(result: VllmResult, extra: dict[str, Any]) -> dict[str, Any]:
    settings = result.model_dump(include={"request_rate", "burstiness", "max_concurrency"})
    settings.update({k: extra[k] for k in extra if k.startswith("ramp_up_")})
    arrival = arrival_from_traffic(settings)
    workload: dict[str, Any] = {"num_requests": result.num_prompts}
    if arrival:
        workload["arrival"] = arrival
    return {
        "source": {"tool": "vllm", "backend": result.backend, "label": result.label},
        "model": {"name": result.model_id, "tokenizer": result.tokenizer_id},
        "workload": workload,
    }


def import_result(data: Any, path: Path, index: int | None) -> ImportedRun:
    result = validate(VllmResult, data, path, WHAT)
    extra = dict(result.model_extra or {})
    run = ImportedRun(
        tool="vllm",
        format=FORMAT,
        files=[path],
        label=None if index is None else f"result {index}",
    )
    # vLLM's file records no vLLM version: the `date` says when it ran
    run.notes.append(f"vllm bench serve result of {result.date or 'an unknown date'}")
    status = extra.get("inferlab_status")  # `inferlab export` of a run that did not finish
    if isinstance(status, str) and not status.startswith("complete"):
        run.status = "incomplete"
        run.notes.append(f"exported by inferlab from a run that did not finish: {status}")
    detailed = request_frame(result, path, run)
    if detailed is not None:
        rows, arrival_known, timeline = detailed
        # without start times each row's clock is its own send: no timeline to write
        run.requests = rows if timeline else without_times(rows)
        ok = int((rows["status"] == "ok").sum())
        if ok != result.completed:
            run.notes.append(
                f"the per-request lists hold {ok} successful requests, 'completed' says "
                f"{result.completed}: the lab's figures come from the lists"
            )
        put_request_metrics(
            run,
            rows,
            arrival="send - vLLM's client queue time (queue_times)" if arrival_known else None,
            timeline=timeline,
            tokens="as vLLM counts them (the server's usage, else re-tokenized text)",
            sources={"first_token_s": "ttfts", "last_token_s": "latencies"},
        )
        gaps = [
            g
            for gaps, k in zip(result.itls or [], rows["status"] == "ok", strict=False)
            if k
            for g in gaps
        ]
        put_chunk_itl(run, np.array(gaps, dtype=float), "itls")
    put_aggregates(run, result, extra)
    run.config = config_of(result, extra)
    return run


def usable_duration(result: VllmResult, run: ImportedRun) -> bool:
    """Whether vLLM's `duration` can be reported and divided by. vLLM computes
    request_throughput = completed / duration, so a duration that disagrees with it (an edited
    or corrupted file: 1e308, 0) is said, not used; a negative one is no measurement."""
    duration, where = result.duration, run.files[0]
    if duration < 0:
        raise InteropError(f"{where}: duration: {duration:g} is invalid; allowed: a time >= 0")
    if _duration_agrees(result):
        return True
    rate = _rate(result)
    run.warnings.append(
        f"{where}: 'duration' is {duration:g} s, but completed / duration = "
        f"{'undefined' if rate is None else f'{rate:g}'} where the file's request_throughput is "
        f"{result.request_throughput:g}/s: duration_s and input_tok_per_s are not reported"
    )
    return False


def _duration_agrees(result: VllmResult) -> bool:
    """Whether `duration` is finite, positive and what vLLM divided by: request_throughput =
    completed / duration."""
    rate = _rate(result)
    return rate is not None and math.isclose(rate, result.request_throughput, rel_tol=0.01)


def _rate(result: VllmResult) -> float | None:
    """completed / duration; None where the duration is 0, negative or infinite."""
    return result.completed / result.duration if 0 < result.duration < math.inf else None


def import_file(documents: list[Any], path: Path) -> list[ImportedRun]:
    """Every result in the file (several when vLLM appended them, --append-result)."""
    if len(documents) == 1:
        return [import_result(documents[0], path, None)]
    return [import_result(doc, path, k) for k, doc in enumerate(documents)]


def looks_like(data: Any) -> bool:
    duration = data.get("duration") if isinstance(data, dict) else None
    return (
        isinstance(data, dict)
        and "completed" in data
        # a duration of the wrong type is told as vLLM's, then named by the schema check
        and (not isinstance(duration, int | float) or not math.isnan(duration))
        and "duration" in data
        and isinstance(data.get("request_throughput"), int | float)
    )
