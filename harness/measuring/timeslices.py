"""The run over time: its requests and tokens counted in slices of equal length
(`timeslices.csv`, docs/metrics.md "Timeslices").

A summary says how a run went on average; a slowly filling queue, a server that drowns
halfway, or a throughput that sags as the KV cache fills only show over time. Each slice counts
what happened inside it, with the same definitions as the summary (harness/measuring/metrics.py):
a completion is an `ok` request's last token, its throughput counts completed requests' tokens,
latencies are those of `ok` requests; failed and cancelled requests are counted apart.

Slices are half-open, [start, end), from the first arrival; the last one is closed and ends at
the run's last event, so it may be shorter than the others.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd

#: slices `timeslice_s: null` aims for over the run
TARGET_SLICES = 20
#: a table longer than this is a mistake (a slice of a millisecond over an hour), not a view
MAX_SLICES = 10_000
#: the lengths an automatic slice is rounded to: these x 10^k seconds
READABLE_STEPS = (1.0, 2.0, 5.0)

COLUMNS = (
    "slice_start_s",
    "slice_end_s",
    "requests_sent",
    "requests_completed",
    "requests_failed",
    "requests_cancelled",
    "in_flight",
    "output_tokens",
    "output_tok_per_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "itl_p50_s",
    "itl_p99_s",
    "tpot_p50_s",
)
_COUNTS = COLUMNS[2:8]


def automatic_slice_s(duration_s: float) -> float:
    """About TARGET_SLICES slices over `duration_s`, the length rounded (by ratio) to the
    nearest 1, 2 or 5 x 10^k seconds; 1 s for a run of no length."""
    if not duration_s > 0:
        return 1.0
    raw = duration_s / TARGET_SLICES
    exponent = math.floor(math.log10(raw))
    candidates = [
        round(step * 10.0**power, 12)  # 0.30000000000000004 is no readable length
        for power in (exponent, exponent + 1)
        for step in READABLE_STEPS
    ]
    return min(candidates, key=lambda length: abs(math.log(length / raw)))


def run_span(requests: pd.DataFrame, tokens: pd.DataFrame) -> tuple[float, float]:
    """First arrival (the summary's start of D) -> the run's last event: a send, a token or a
    request's end, whatever its status."""
    # an imported run may know only the sends
    starts = requests["arrival_s"].dropna()
    if not len(starts):
        starts = requests["sent_s"].dropna()
    events = [requests[c] for c in ("sent_s", "first_token_s", "last_token_s", "finished_s")]
    ends = pd.concat([*events, tokens["time_s"]]).dropna()
    start = float(starts.min()) if len(starts) else 0.0
    end = float(ends.max()) if len(ends) else start
    return start, max(start, end)


def timeslices(
    requests: pd.DataFrame, tokens: pd.DataFrame, slice_s: float | None = None
) -> pd.DataFrame:
    """One row per slice of `slice_s` seconds (None: automatic_slice_s) over the run: requests
    sent, completed, failed and cancelled inside it, those in flight at its end, the completed
    requests' output tokens and their rate, TTFT of the first tokens inside it, ITL of the gaps
    ending inside it, TPOT of the requests completed inside it. A statistic with no sample in a
    slice is empty (NaN); so is the rate of a slice of no length (a run of one instant)."""
    if not len(requests):
        return pd.DataFrame({column: pd.Series(dtype="float64") for column in COLUMNS})
    start, end = run_span(requests, tokens)
    length = slice_s if slice_s is not None else automatic_slice_s(end - start)
    # the run's end on an edge is no extra slice, nor is float noise just past it
    count = max(1, math.ceil((end - start) / length - 1e-9))
    if count > MAX_SLICES:
        raise ValueError(
            f"run.timeslice_s: {slice_s!r} gives {count} slices over the run's "
            f"{end - start:.3f} s; allowed: null, or a length giving at most {MAX_SLICES} "
            f"slices (>= {(end - start) / MAX_SLICES:.3g} s)"
        )
    edges = start + length * np.arange(count + 1)
    edges[-1] = end

    def slice_of(times: pd.Series) -> pd.Series:
        """The slice each time falls in ([start, end) each, the last closed), NaN: no time."""
        index = np.floor((times.to_numpy(float) - start) / length)
        return pd.Series(np.clip(index, 0, count - 1), index=times.index)

    table = pd.DataFrame(
        {"slice_start_s": edges[:-1], "slice_end_s": edges[1:]}, index=pd.RangeIndex(count)
    )
    status = requests["status"]
    ok = requests[status == "ok"]
    # a request ends when it finishes; a row without that time, at its last token, else at
    # its send (a request that failed at once)
    ended = requests["finished_s"].combine_first(requests["last_token_s"])
    ended = ended.combine_first(requests["sent_s"])
    completed_at = ok["last_token_s"].combine_first(ok["finished_s"])  # as the summary's D
    sent = requests["sent_s"].notna()
    table["requests_sent"] = _count(slice_of(requests.loc[sent, "sent_s"]), count)
    table["requests_completed"] = _count(slice_of(completed_at), count)
    table["requests_failed"] = _count(slice_of(ended[status == "failed"]), count)
    table["requests_cancelled"] = _count(slice_of(ended[status == "cancelled"]), count)
    # in flight at a slice's end: sent so far less ended so far (a request cancelled before
    # it was sent never was in flight)
    ended_sent = _count(slice_of(ended[sent]), count)
    table["in_flight"] = table["requests_sent"].cumsum() - ended_sent.cumsum()
    ok_tokens = tokens[tokens["request_id"].isin(set(ok["request_id"]))]
    table["output_tokens"] = _count(slice_of(ok_tokens["time_s"]), count)
    seconds = table["slice_end_s"] - table["slice_start_s"]
    table["output_tok_per_s"] = (table["output_tokens"] / seconds).where(seconds > 0)
    ttft = ok["first_token_s"] - ok["arrival_s"]
    _put_percentiles(table, "ttft", ttft, slice_of(ok["first_token_s"]), (50, 99))
    gaps, gap_ends = _gaps(ok_tokens)
    _put_percentiles(table, "itl", gaps, slice_of(gap_ends), (50, 99))
    n = ok["output_tokens"]
    tpot = ((ok["last_token_s"] - ok["first_token_s"]) / (n - 1)).where(n > 1)
    _put_percentiles(table, "tpot", tpot, slice_of(completed_at), (50,))
    for column in _COUNTS:
        table[column] = table[column].astype("int64")
    return table.reindex(columns=list(COLUMNS))


def _count(slices: pd.Series, count: int) -> pd.Series:
    """How many of the times fall in each slice (a time that is NaN in none)."""
    counted = slices.dropna().astype(int).value_counts()
    return counted.reindex(range(count), fill_value=0).astype("int64")


def _gaps(tokens: pd.DataFrame) -> tuple[pd.Series, pd.Series]:
    """Every gap between consecutive tokens of a request, with the time of the token that
    ends it (the summary's ITL, placed in time)."""
    ordered = tokens.sort_values(["request_id", "index"])
    gaps = ordered.groupby("request_id", sort=False)["time_s"].diff()
    has_gap = gaps.notna()
    return gaps[has_gap], ordered.loc[has_gap, "time_s"]


def _put_percentiles(
    table: pd.DataFrame,
    name: str,
    values: pd.Series,
    slices: pd.Series,
    percentiles: Sequence[int],
) -> None:
    """`{name}_p{q}_s` per slice over the values falling in it (linear interpolation, as the
    summary's numpy percentiles)."""
    frame = pd.DataFrame({"value": values.to_numpy(float), "slice": slices.to_numpy(float)})
    frame = frame.dropna()
    grouped = frame.groupby(frame["slice"].astype(int))["value"]
    for q in percentiles:
        table[f"{name}_p{q}_s"] = grouped.quantile(q / 100).reindex(table.index)
