"""The lab's own metrics over another tool's per-request rows.

When a file holds every request with its timestamps, the lab does not take the tool's
statistics: it runs its own `compute_summary` over the rows, so TTFT, TPOT, E2E, the counts,
the duration and the throughputs are defined exactly as for the lab's runs (docs/metrics.md),
as far as the tool's timestamps allow (a tool that records no scheduled arrival gives latencies
from the send). Streamed-chunk gaps, which some tools keep per request, give the ITL
statistics, one gap per chunk."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from harness.interop.errors import InteropError
from harness.interop.imported import FROM_REQUESTS, Definition, ImportedRun
from harness.measuring.metrics import REGISTRY, compute_summary, stat_percentile
from harness.run_folder import COLUMNS, REQUEST_COLUMNS

LATENCY_METRICS = tuple(n for n in REGISTRY if n.split("_", 1)[0] in ("ttft", "tpot", "e2e"))
COUNT_METRICS = (
    "num_requests",
    "num_completed",
    "num_failed",
    "input_tokens_total",
    "output_tokens_total",
)
RATE_METRICS = ("duration_s", "req_per_s", "input_tok_per_s", "output_tok_per_s", "total_tok_per_s")
ITL_METRICS = tuple(n for n in REGISTRY if re.fullmatch(r"itl_(mean|std|max|p\d+)_s", n))
CHUNK_ITL_NOTE = (
    "one gap per streamed chunk, pooled over requests (the lab records one gap per token, 0 "
    "within a multi-token event): equal when every chunk carries one token"
)


TEXT_COLUMNS = frozenset(
    {"request_id", "status", "error", "finish_reason", "prefix_group", "session_id"}
)
TIME_COLUMNS = tuple(c for c in REQUEST_COLUMNS if c.endswith("_s"))


def request_rows(frame: pd.DataFrame) -> pd.DataFrame:
    """`frame` with every column of the lab's requests table, in the table's order (absent
    ones null, numbers as numbers), and nothing else."""
    rows = pd.DataFrame(index=frame.index)
    for column in REQUEST_COLUMNS:
        if column not in frame:
            rows[column] = np.nan
        elif column in TEXT_COLUMNS:
            rows[column] = frame[column]
        else:
            rows[column] = pd.to_numeric(frame[column], errors="coerce")
    return rows.reset_index(drop=True)


def without_times(rows: pd.DataFrame) -> pd.DataFrame:
    """Rows whose times are each request's own (no common clock) with every time nulled: what
    is written to requests.parquet, where times share the run's clock."""
    return rows.assign(**{c: np.nan for c in TIME_COLUMNS if c in rows})


def _empty(table: str) -> pd.DataFrame:
    return pd.DataFrame({column: pd.Series(dtype="float64") for column in COLUMNS[table]})


def check_rows(run: ImportedRun, rows: pd.DataFrame) -> None:
    """An InteropError naming the file and the first request whose figures are no measurement:
    a negative token count, an infinite time, or a successful request's first token before its
    arrival or send, or its last token before its first (the lab's latencies would be
    negative)."""
    problems = [
        (rows["prompt_tokens"] < 0, "a negative prompt token count"),
        (rows["output_tokens"] < 0, "a negative output token count"),
        (rows[list(TIME_COLUMNS)].abs().eq(np.inf).any(axis=1), "an infinite time"),
    ]
    ok = rows["status"] == "ok"
    first, last = rows["first_token_s"], rows["last_token_s"]
    problems += [
        (ok & (first < rows["sent_s"]), "its first token before its send"),
        (ok & (first < rows["arrival_s"]), "its first token before its scheduled arrival"),
        (ok & (last < first), "its last token before its first"),
    ]
    for bad, what in problems:
        if bad.any():
            k = int(np.flatnonzero(bad.to_numpy())[0])
            request = rows["request_id"].iloc[k]
            raise InteropError(
                f"{run.rows_source}: request {request if pd.notna(request) else k}: {what} "
                "(the per-request data is damaged)"
            )


#: the statistics a successful request's first / last token time goes into
NEEDS_TIME = {"first_token_s": "TTFT, TPOT", "last_token_s": "E2E, TPOT"}


def say_missing_times(run: ImportedRun, rows: pd.DataFrame, sources: dict[str, str]) -> None:
    """Successful requests without a first or last token time count as completed but are left
    out of the statistics that need it: said and counted (run.warn_unusable, by the file's
    field in `sources`). A file that records the time for no request (a tool run without
    streaming) is not damaged, and is not warned about."""
    done = rows[rows["status"] == "ok"]
    for column, statistics in NEEDS_TIME.items():
        missing = done[column].isna()
        if missing.any() and not missing.all():
            run.warn_unusable(
                sources.get(column, column),
                int(missing.sum()),
                f"is missing or NaN for a successful request: counted as completed, left out "
                f"of the {statistics} statistics",
            )


def put_request_metrics(
    run: ImportedRun,
    rows: pd.DataFrame,
    *,
    arrival: str | None,
    timeline: bool = True,
    tokens: str = "as the file counts them",
    last_token: str | None = None,
    sources: dict[str, str] | None = None,
) -> None:
    """The lab's request metrics over `rows` (the lab's request columns: status, arrival_s,
    sent_s, first_token_s, last_token_s, prompt_tokens, output_tokens), into `run`.

    `arrival` says what the rows' `arrival_s` is in the tool's terms (e.g. "when AIPerf issued
    the request's credit"), or None when the file records no scheduled arrival and `arrival_s`
    is the send: latencies then run from the send. With `timeline` False the rows' times are
    each request's own (from its send: no common clock), so only latencies and counts are
    computed. `tokens` says how the tool counts tokens; `last_token` what the rows'
    `last_token_s` is when it is not the last streamed token (TPOT and E2E then differ);
    `sources` the file's fields for `first_token_s` and `last_token_s`, to name them where a
    successful request lacks one."""
    rows = request_rows(rows)
    check_rows(run, rows)
    say_missing_times(run, rows, sources or {})
    summary = _request_summary(rows)
    _put_latencies(run, summary, arrival, tokens, last_token)
    for name in COUNT_METRICS:
        note = f"tokens {tokens}" if name.endswith("tokens_total") else ""
        run.put(name, summary.get(name), Definition(FROM_REQUESTS, True, note))
    if timeline:
        _put_rates(run, summary, arrival)


def _request_summary(rows: pd.DataFrame) -> dict[str, Any]:
    """The lab's summary over the rows alone, without the token totals and rates of a side
    (input, output) whose counts the file lacks for a completed request."""
    summary = compute_summary(rows, _empty("tokens"), _empty("steps"))
    # a token count the file lacks for a completed request would sum as 0: leave its totals
    # and rates absent instead
    done = rows[rows["status"] == "ok"]
    unknown = {
        side
        for side, column in (("input", "prompt_tokens"), ("output", "output_tokens"))
        if done[column].isna().any() or rows[column].isna().all()
    }
    for side in unknown:
        for name in (f"{side}_tokens_total", f"{side}_tok_per_s", "total_tok_per_s"):
            summary.pop(name, None)
    return summary


def _start(arrival: str | None) -> str:
    """Where the latencies and rates start: the scheduled arrival, else the send."""
    return "scheduled arrival" if arrival else "send"


def _put_latencies(
    run: ImportedRun,
    summary: dict[str, Any],
    arrival: str | None,
    tokens: str,
    last_token: str | None,
) -> None:
    """TTFT, TPOT and end-to-end latency, each defined by where it starts and ends."""
    start = _start(arrival)
    from_arrival = arrival is not None
    where = (
        f"; arrival: {arrival}"
        if arrival
        else (
            "; the file records no scheduled arrival, so the wait before the send (the lab "
            "measures from arrival) is left out"
        )
    )
    last = last_token or "last streamed token"
    for name in LATENCY_METRICS:
        kind = name.split("_", 1)[0]
        if kind == "tpot":
            definition = Definition(
                FROM_REQUESTS,
                last_token is None,
                f"({last} - first streamed token) / (N - 1), N > 1; N {tokens}",
            )
        else:
            end = "first streamed token" if kind == "ttft" else last
            same = from_arrival and (kind == "ttft" or last_token is None)
            definition = Definition(FROM_REQUESTS, same, f"{end} - {start}{where}")
        run.put(name, summary.get(name), definition)


def _put_rates(run: ImportedRun, summary: dict[str, Any], arrival: str | None) -> None:
    """The rates over the rows' common clock, and the send lateness where arrivals are known."""
    from_arrival = arrival is not None
    for name in RATE_METRICS:
        run.put(
            name,
            summary.get(name),
            Definition(
                FROM_REQUESTS,
                from_arrival,
                f"over the first {_start(arrival)} -> the last completion (last streamed token)",
            ),
        )
    if from_arrival:
        run.put(
            "send_lateness_p99_s",
            summary.get("send_lateness_p99_s"),
            Definition(FROM_REQUESTS, True, f"p99 of send - scheduled arrival; arrival: {arrival}"),
        )


def put_chunk_itl(run: ImportedRun, gaps_s: np.ndarray, source: str, note: str = "") -> None:
    """ITL statistics over pooled streamed-chunk gaps (seconds), with numpy's percentiles as
    the lab takes them."""
    if not len(gaps_s):
        return
    if not np.isfinite(gaps_s).all() or (gaps_s < 0).any():
        bad = gaps_s[~(np.isfinite(gaps_s) & (gaps_s >= 0))][0]
        raise InteropError(
            f"{run.rows_source}: {source}: a chunk gap of {bad:g} s (negative or not finite)"
        )
    for name in ITL_METRICS:
        stat = name.removeprefix("itl_").removesuffix("_s")
        if stat == "mean":
            value = float(gaps_s.mean())
        elif stat == "std":
            value = float(gaps_s.std())
        elif stat == "max":
            value = float(gaps_s.max())
        else:  # p50 -> 50, p999 -> 99.9
            value = float(np.percentile(gaps_s, stat_percentile(stat) or 0.0))
        run.put(
            name, value, Definition(source, False, CHUNK_ITL_NOTE + (f"; {note}" if note else ""))
        )
