"""Trace file loaders: arrival times and token lengths (and Mooncake prefix hashes) per row.

Formats (see docs/workloads.md):
  azure     CSV `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS.fffffff`), `ContextTokens`, `GeneratedTokens`
  mooncake  JSONL `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token blocks)
  burstgpt  CSV `Timestamp` (s), `Request tokens`, `Response tokens` (other columns ignored)
  csv/jsonl any columns, named by a `columns` mapping

Rows with a zero input or output length cannot be replayed (BurstGPT logs failed requests that
way): they are skipped and counted per reason. Anything else that is wrong (a missing column,
a negative or non-numeric length, timestamps going backwards, an empty file, a bad JSON line)
raises ValueError naming the file, the 1-based line (CSV counts the header as line 1) and the
field, because a silently repaired trace would be a different benchmark.
"""

from __future__ import annotations

import csv
import functools
import json
import math
import re
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from workloads.common import check_choice, check_keys, check_mapping, invalid

TRACE_FORMATS = ("azure", "mooncake", "burstgpt", "csv", "jsonl")
TIMESTAMP_UNITS = ("s", "ms", "us", "datetime")
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
COLUMN_KEYS = ("timestamp", "input_len", "output_len", "timestamp_unit")
_UNIT_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6}
# Python's %f takes at most 6 digits; Azure writes 7 (100 ns), so the fraction is parsed apart.
_DATETIME = re.compile(r"(\d{4}-\d{2}-\d{2})[ T](\d{2}:\d{2}:\d{2})(?:\.(\d+))?Z?")


@dataclass(frozen=True)
class TraceRow:
    line: int  # 1-based line in the file (CSV: the header is line 1)
    timestamp_s: float | None  # None when the layout has no timestamp column
    input_len: int
    output_len: int
    hash_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class Trace:
    path: str
    format: str
    rows: tuple[TraceRow, ...]  # the usable rows, in file order
    rows_read: int  # data rows in the file, usable or not
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    # Times of the first and last data rows, skipped ones included: the trace's own span.
    first_timestamp_s: float | None = None
    last_timestamp_s: float | None = None


@dataclass(frozen=True)
class _Layout:
    kind: str  # "csv" | "jsonl"
    timestamp: str | None
    unit: str
    input_len: str
    output_len: str
    hash_ids: str | None = None


_LAYOUTS = {
    "azure": _Layout("csv", "TIMESTAMP", "datetime", "ContextTokens", "GeneratedTokens"),
    "burstgpt": _Layout("csv", "Timestamp", "s", "Request tokens", "Response tokens"),
    "mooncake": _Layout("jsonl", "timestamp", "ms", "input_length", "output_length",
                        "hash_ids"),
}


def parse_columns(field_name: str, value: Any) -> dict[str, Any]:
    """Validate a csv/jsonl `columns` mapping; missing keys take the defaults below."""
    spec = check_mapping(field_name, value, "a mapping with keys " + "|".join(COLUMN_KEYS))
    check_keys(field_name, spec, COLUMN_KEYS, "a trace column mapping")
    out = {"timestamp": "timestamp", "input_len": "input_len", "output_len": "output_len",
           "timestamp_unit": "s", **spec}
    for key in ("input_len", "output_len"):
        if not isinstance(out[key], str) or not out[key]:
            raise invalid(f"{field_name}.{key}", out[key], "a column name")
    if out["timestamp"] is not None and (not isinstance(out["timestamp"], str)
                                         or not out["timestamp"]):
        raise invalid(f"{field_name}.timestamp", out["timestamp"],
                      "a column name, or null for a trace without times")
    check_choice(f"{field_name}.timestamp_unit", out["timestamp_unit"], TIMESTAMP_UNITS)
    return out


def load_trace(path: str | Path, fmt: str, columns: Mapping[str, Any] | None = None) -> Trace:
    """Read a whole trace (cached per file version, format and columns)."""
    check_choice("format", fmt, TRACE_FORMATS)
    p = Path(path)
    stat = p.stat()
    cols = None
    if fmt in ("csv", "jsonl"):
        cols = tuple(sorted(parse_columns("columns", columns or {}).items()))
    elif columns:
        raise invalid("columns", dict(columns), f"null for format {fmt} (its columns are fixed)")
    return _load(str(p.resolve()), stat.st_mtime_ns, stat.st_size, fmt, cols)


@functools.lru_cache(maxsize=8)
def _load(path: str, _mtime: int, _size: int, fmt: str,
          cols: tuple[tuple[str, Any], ...] | None) -> Trace:
    if cols is not None:
        c = dict(cols)
        layout = _Layout(fmt, c["timestamp"], c["timestamp_unit"], c["input_len"],
                         c["output_len"])
    else:
        layout = _LAYOUTS[fmt]
    records = _csv_records(path, layout) if layout.kind == "csv" else _jsonl_records(path)
    rows: list[TraceRow] = []
    skipped: Counter[str] = Counter()
    read = 0
    previous: float | None = None
    first: float | None = None
    for line, record in records:
        read += 1
        row = _parse_row(path, line, record, layout)
        if row.timestamp_s is not None:
            if previous is not None and row.timestamp_s < previous:
                raise _error(path, line, layout.timestamp,
                             f"{record.get(layout.timestamp)!r} is earlier than the previous "
                             "row's time (rows must be sorted by time)")
            previous = row.timestamp_s
            first = row.timestamp_s if first is None else first
        if row.input_len == 0:
            skipped["zero_input_len"] += 1
        elif row.output_len == 0:
            skipped["zero_output_len"] += 1
        else:
            rows.append(row)
    return Trace(path, fmt, tuple(rows), read, dict(skipped), first, previous)


def _error(path: str, line: int, field_name: str | None, problem: str) -> ValueError:
    where = f"field {field_name!r}: " if field_name else ""
    return ValueError(f"{path}: line {line}: {where}{problem}")


def _csv_records(path: str, layout: _Layout) -> Iterator[tuple[int, dict[str, Any]]]:
    needed = [c for c in (layout.timestamp, layout.input_len, layout.output_len) if c]
    with open(path, newline="", encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        header = reader.fieldnames
        if not header:
            raise _error(path, 1, None, f"empty file (expected a header row with {needed})")
        for name in needed:
            if name not in header:
                raise _error(path, 1, name, f"missing column (the header has {header})")
        any_row = False
        for record in reader:
            any_row = True
            yield reader.line_num, record
        if not any_row:
            raise _error(path, 2, None, "no data rows after the header")


def _jsonl_records(path: str) -> Iterator[tuple[int, dict[str, Any]]]:
    any_row = False
    with open(path, encoding="utf-8-sig") as f:
        for line, text in enumerate(f, start=1):
            if not text.strip():
                continue  # blank lines (a trailing newline) carry no request
            try:
                record = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _error(path, line, None, f"invalid JSON ({exc.msg}, column "
                             f"{exc.colno})") from exc
            if not isinstance(record, dict):
                raise _error(path, line, None, f"expected a JSON object, got {text.strip()!r}")
            any_row = True
            yield line, record
    if not any_row:
        raise _error(path, 1, None, "empty file (no JSON lines)")


def _parse_row(path: str, line: int, record: dict[str, Any], layout: _Layout) -> TraceRow:
    def get(name: str) -> Any:
        value = record.get(name)
        if value is None or (isinstance(value, str) and not value.strip()):
            raise _error(path, line, name, "missing value")
        return value

    timestamp = None
    if layout.timestamp:
        timestamp = _timestamp(path, line, layout.timestamp, get(layout.timestamp), layout.unit)
    input_len = _length(path, line, layout.input_len, get(layout.input_len))
    output_len = _length(path, line, layout.output_len, get(layout.output_len))
    hash_ids: tuple[int, ...] = ()
    if layout.hash_ids:
        hash_ids = _hash_ids(path, line, layout.hash_ids, get(layout.hash_ids), input_len)
    return TraceRow(line, timestamp, input_len, output_len, hash_ids)


def _length(path: str, line: int, name: str, value: Any) -> int:
    number: float | None = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            number = None
    if number is None or not math.isfinite(number) or not number.is_integer():
        raise _error(path, line, name, f"{value!r} is not a whole number of tokens")
    if number < 0:
        raise _error(path, line, name, f"{value!r} is negative")
    return int(number)


def _timestamp(path: str, line: int, name: str, value: Any, unit: str) -> float:
    if unit == "datetime":
        match = _DATETIME.fullmatch(str(value).strip())
        if not match:
            raise _error(path, line, name, f"{value!r} is not a YYYY-MM-DD HH:MM:SS[.fraction] "
                         "timestamp")
        date, clock, fraction = match.groups()
        try:
            base = datetime.strptime(f"{date} {clock}", "%Y-%m-%d %H:%M:%S")
        except ValueError as exc:
            raise _error(path, line, name, f"{value!r} is not a valid date ({exc})") from exc
        # No time zone is given: treat it as UTC; only differences between rows matter.
        seconds = base.replace(tzinfo=timezone.utc).timestamp()
        return seconds + (int(fraction) / 10 ** len(fraction) if fraction else 0.0)
    try:
        number = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise _error(path, line, name, f"{value!r} is not a number of {unit}")
    return number * _UNIT_SCALE[unit]


def _hash_ids(path: str, line: int, name: str, value: Any, input_len: int) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(
            isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in value):
        raise _error(path, line, name, "expected a list of non-negative integer block ids")
    if len(value) * MOONCAKE_BLOCK < input_len:
        raise _error(path, line, name, f"{len(value)} block(s) of {MOONCAKE_BLOCK} tokens "
                     f"cannot cover an input of {input_len} tokens")
    return tuple(value)
