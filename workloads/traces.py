"""Trace file loaders: arrival times and token lengths (and Mooncake prefix hashes) per row.

Formats (see docs/workloads.md):
  azure     CSV `TIMESTAMP` (`YYYY-MM-DD HH:MM:SS.fffffff`), `ContextTokens`, `GeneratedTokens`
  mooncake  JSONL `timestamp` (ms), `input_length`, `output_length`, `hash_ids` (512-token blocks)
  burstgpt  CSV `Timestamp` (s), `Request tokens`, `Response tokens` (other columns ignored)
  csv/jsonl any columns, named by a `columns` mapping
Any of them may be gzip-compressed and named `.gz` (workloads/trace_files.py).

Rows with a zero input or output length cannot be replayed (BurstGPT logs failed requests that
way): they are skipped and counted per reason. Anything else that is wrong (a missing column,
a CSV row with more or fewer fields than the header, a negative, non-numeric or huge length,
timestamps going backwards, an empty file, a bad JSON line, bytes that are not UTF-8) raises
ValueError naming the file, the 1-based line (CSV counts the header as line 1) and the field,
because a silently repaired trace would be a different benchmark.

The file is read in chunks of a few MB and reading stops once the rows asked for are in: the
first `limit` usable rows of the window [start_s, end_s) (rows are sorted by time, so the
first row at or past end_s ends the window). Clean chunks are parsed column-wise
(workloads/trace_arrow.py); any other chunk row by row here, which is the reference.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from models.files import check_regular_file
from workloads import trace_arrow
from workloads.common import check_choice, check_keys, check_mapping, invalid
from workloads.trace_files import Chunk, chunks, decode, open_data

TRACE_FORMATS = ("azure", "mooncake", "burstgpt", "csv", "jsonl")
TIMESTAMP_UNITS = ("s", "ms", "us", "datetime")
MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
# No model's context comes near 2**31 tokens; a length beyond it is a corrupt field, and it
# would overflow the int64 arithmetic downstream once scaled.
MAX_TOKENS = 2**31 - 1
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


@dataclass(frozen=True, eq=False)
class Trace:
    """The usable rows of the part of a trace that was read, as columns."""

    path: str
    format: str
    lines: np.ndarray  # int64: 1-based line of each usable row
    timestamps_s: np.ndarray | None  # float64; None when the layout has no timestamp column
    input_lens: np.ndarray  # int64
    output_lens: np.ndarray  # int64
    hash_offsets: np.ndarray | None  # Mooncake: row i's ids are hash_values[off[i]:off[i+1]]
    hash_values: np.ndarray | None
    rows_read: int  # data rows read, usable or not
    skipped: dict[str, int] = field(default_factory=dict)  # reason -> rows
    # Times of the first and last data rows read, skipped ones included.
    first_timestamp_s: float | None = None
    last_timestamp_s: float | None = None
    # False when reading stopped before the end of the file (enough rows were in).
    read_to_end: bool = True

    def __len__(self) -> int:
        return len(self.lines)

    def hash_ids(self, i: int) -> tuple[int, ...]:
        if self.hash_offsets is None or self.hash_values is None:
            return ()
        return tuple(self.hash_values[self.hash_offsets[i] : self.hash_offsets[i + 1]].tolist())

    @property
    def rows(self) -> tuple[TraceRow, ...]:
        """The usable rows as objects (convenient for small traces; the columns are cheaper)."""
        times = self.timestamps_s.tolist() if self.timestamps_s is not None else None
        return tuple(
            TraceRow(
                int(line), times[i] if times is not None else None, int(a), int(b), self.hash_ids(i)
            )
            for i, (line, a, b) in enumerate(
                zip(
                    self.lines.tolist(),
                    self.input_lens.tolist(),
                    self.output_lens.tolist(),
                    strict=True,
                )
            )
        )


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
    "mooncake": _Layout("jsonl", "timestamp", "ms", "input_length", "output_length", "hash_ids"),
}


def parse_columns(field_name: str, value: Any) -> dict[str, Any]:
    """Validate a csv/jsonl `columns` mapping; missing keys take the defaults below."""
    spec = check_mapping(field_name, value, "a mapping with keys " + "|".join(COLUMN_KEYS))
    check_keys(field_name, spec, COLUMN_KEYS, "a trace column mapping")
    out = {
        "timestamp": "timestamp",
        "input_len": "input_len",
        "output_len": "output_len",
        "timestamp_unit": "s",
        **spec,
    }
    for key in ("input_len", "output_len"):
        if not isinstance(out[key], str) or not out[key]:
            raise invalid(f"{field_name}.{key}", out[key], "a column name")
    if out["timestamp"] is not None and (
        not isinstance(out["timestamp"], str) or not out["timestamp"]
    ):
        raise invalid(
            f"{field_name}.timestamp",
            out["timestamp"],
            "a column name, or null for a trace without times",
        )
    check_choice(f"{field_name}.timestamp_unit", out["timestamp_unit"], TIMESTAMP_UNITS)
    return out


def load_trace(
    path: str | Path,
    fmt: str,
    columns: Mapping[str, Any] | None = None,
    *,
    start_s: float = 0.0,
    end_s: float | None = None,
    limit: int | None = None,
) -> Trace:
    """Read a trace up to the rows asked for (cached per file version and request).

    With the defaults every row is read. Otherwise reading stops at the end of the chunk
    holding the `limit`-th usable row of [start_s, end_s) or the first row at or past end_s
    (times in seconds since the first row); the Trace then covers the rows up to the last
    one needed (or before the first past the window), and rows beyond it are not checked.
    """
    check_choice("format", fmt, TRACE_FORMATS)
    p = Path(path)
    stat = check_regular_file(p)
    cols = None
    if fmt in ("csv", "jsonl"):
        cols = tuple(sorted(parse_columns("columns", columns or {}).items()))
    elif columns:
        raise invalid("columns", dict(columns), f"null for format {fmt} (its columns are fixed)")
    return _load(
        str(p.resolve()),
        stat.st_mtime_ns,
        stat.st_size,
        fmt,
        cols,
        float(start_s),
        None if end_s is None else float(end_s),
        limit,
    )


@functools.lru_cache(maxsize=4)
def _load(
    path: str,
    _mtime: int,
    _size: int,
    fmt: str,
    cols: tuple[tuple[str, Any], ...] | None,
    start_s: float,
    end_s: float | None,
    limit: int | None,
) -> Trace:
    if cols is not None:
        c = dict(cols)
        layout = _Layout(fmt, c["timestamp"], c["timestamp_unit"], c["input_len"], c["output_len"])
    else:
        layout = _LAYOUTS[fmt]
    parts: list[tuple[np.ndarray, trace_arrow.Columns]] = []
    t0: float | None = None
    selected = 0
    read_to_end = True
    with open_data(path) as reader:
        for lines, cols_, last in _parsed(path, reader, layout):
            times = cols_.timestamps_s
            n = len(lines)
            if t0 is None and times is not None and n:
                t0 = float(times[0])
            usable = (cols_.input_lens > 0) & (cols_.output_lens > 0)
            cut = n
            if times is not None:
                since = times - t0
                if end_s is not None:
                    past = np.flatnonzero(since >= end_s)
                    cut = int(past[0]) if len(past) else n
                usable &= since >= start_s
            if limit is not None:
                wanted = np.flatnonzero(usable[:cut])
                if len(wanted) >= limit - selected:
                    cut = int(wanted[limit - selected - 1]) + 1 if limit > selected else 0
            selected += int(usable[:cut].sum())
            parts.append((lines[:cut], _head(cols_, cut)))
            if cut < n or (limit is not None and selected >= limit):
                read_to_end = last and cut == n
                break
    return _trace(path, fmt, parts, t0, read_to_end)


def _head(columns: trace_arrow.Columns, n: int) -> trace_arrow.Columns:
    """The first n rows."""
    offsets = columns.hash_offsets
    times = columns.timestamps_s
    first = (
        times[:n] if times is not None else None,
        columns.input_lens[:n],
        columns.output_lens[:n],
    )
    if offsets is None or columns.hash_values is None:
        return trace_arrow.Columns(*first, None, None)
    return trace_arrow.Columns(*first, offsets[: n + 1], columns.hash_values[: offsets[n]])


def _trace(
    path: str,
    fmt: str,
    parts: list[tuple[np.ndarray, trace_arrow.Columns]],
    t0: float | None,
    read_to_end: bool,
) -> Trace:
    lines = np.concatenate([p[0] for p in parts]) if parts else np.zeros(0, np.int64)

    def joined(i: int) -> np.ndarray:
        return np.concatenate([p[1][i] for p in parts]) if parts else np.zeros(0, np.int64)

    inputs, outputs = joined(1), joined(2)
    times = joined(0).astype(np.float64) if parts and parts[0][1][0] is not None else None
    zero_in, zero_out = inputs == 0, (outputs == 0) & (inputs > 0)
    skipped = {
        k: int(v.sum())
        for k, v in (("zero_input_len", zero_in), ("zero_output_len", zero_out))
        if v.any()
    }
    keep = ~(zero_in | zero_out)
    offsets = values = None
    if parts and parts[0][1].hash_offsets is not None:
        diffs = []
        for _, part in parts:
            assert part.hash_offsets is not None  # one layout: every part has hash ids or none
            diffs.append(np.diff(part.hash_offsets))
        counts = np.concatenate(diffs)
        values = np.concatenate([p[1].hash_values for p in parts])
        values = values[np.repeat(keep, counts)]  # the ids of the kept rows, in order
        offsets = np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64)
    last = float(times[-1]) if times is not None and len(times) else None
    return Trace(
        path,
        fmt,
        lines[keep],
        times[keep] if times is not None else None,
        inputs[keep],
        outputs[keep],
        offsets,
        values,
        len(lines),
        skipped,
        t0 if times is not None and len(times) else None,
        last,
        read_to_end,
    )


def _parsed(
    path: str, reader: Any, layout: _Layout
) -> Iterator[tuple[np.ndarray, trace_arrow.Columns, bool]]:
    """(lines, columns, last chunk?) per chunk, every row checked; emptiness is an error."""
    previous: float | None = None
    header: list[str] | None = None
    rows = 0
    for chunk in chunks(path, reader, quoted=layout.kind == "csv"):
        if layout.kind == "csv" and header is None:
            header, chunk = _csv_header(path, chunk, layout)
        if not chunk.data:
            continue
        fast = (
            trace_arrow.csv_columns(chunk.data, header, layout, previous, _UNIT_SCALE, MAX_TOKENS)
            if header is not None
            else trace_arrow.jsonl_columns(
                chunk.data, layout, previous, _UNIT_SCALE, MAX_TOKENS, MOONCAKE_BLOCK
            )
        )
        if fast is not None:
            lines = np.arange(
                chunk.first_line, chunk.first_line + len(fast.input_lens), dtype=np.int64
            )
            columns = fast
        else:
            records = (
                _csv_records(path, chunk, header)
                if header is not None
                else _jsonl_records(path, chunk)
            )
            lines, columns = _rows(path, records, layout, previous)
        if len(lines):
            rows += len(lines)
            if columns.timestamps_s is not None:
                previous = float(columns.timestamps_s[-1])
            yield lines, columns, chunk.last
    if layout.kind == "csv" and header is None:
        needed = [c for c in (layout.timestamp, layout.input_len, layout.output_len) if c]
        raise _error(path, 1, None, f"empty file (expected a header row with {needed})")
    if rows == 0:
        raise (
            _error(path, 2, None, "no data rows after the header")
            if layout.kind == "csv"
            else _error(path, 1, None, "empty file (no JSON lines)")
        )


def _rows(
    path: str,
    records: Iterator[tuple[int, dict[str, Any]]],
    layout: _Layout,
    previous: float | None,
) -> tuple[np.ndarray, trace_arrow.Columns]:
    """Row-by-row parse (the reference): the same columns, or the exact error."""
    lines: list[int] = []
    times: list[float] = []
    inputs: list[int] = []
    outputs: list[int] = []
    hashes: list[int] = []
    counts: list[int] = []
    for line, record in records:
        row = _parse_row(path, line, record, layout)
        if row.timestamp_s is not None:
            if previous is not None and row.timestamp_s < previous:
                assert layout.timestamp is not None  # a row has a time only from a time column
                raise _error(
                    path,
                    line,
                    layout.timestamp,
                    f"{record.get(layout.timestamp)!r} is earlier than the previous "
                    "row's time (rows must be sorted by time)",
                )
            previous = row.timestamp_s
            times.append(row.timestamp_s)
        lines.append(line)
        inputs.append(row.input_len)
        outputs.append(row.output_len)
        hashes.extend(row.hash_ids)
        counts.append(len(row.hash_ids))
    offsets = values = None
    if layout.hash_ids:
        offsets = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        values = np.asarray(hashes, dtype=np.int64)
    return np.asarray(lines, dtype=np.int64), trace_arrow.Columns(
        np.asarray(times, dtype=np.float64) if layout.timestamp else None,
        np.asarray(inputs, dtype=np.int64),
        np.asarray(outputs, dtype=np.int64),
        offsets,
        values,
    )


def _error(path: str, line: int, field_name: str | None, problem: str) -> ValueError:
    where = f"field {field_name!r}: " if field_name else ""
    return ValueError(f"{path}: line {line}: {where}{problem}")


def _csv_header(path: str, chunk: Chunk, layout: _Layout) -> tuple[list[str], Chunk]:
    """The header of the first chunk, checked, and the chunk's data rows."""
    end = chunk.data.find(b"\n") + 1 or len(chunk.data)
    header = next(csv.reader([chunk.data[:end].decode("utf-8").rstrip("\r\n")]), [])
    needed = [c for c in (layout.timestamp, layout.input_len, layout.output_len) if c]
    for name in needed:
        if name not in header:
            hint = ""
            if chunk.data.lstrip()[:1] in (b"{", b"["):
                hint = "; this looks like JSON Lines: use format=mooncake or jsonl"
            raise _error(path, 1, name, f"missing column (the header has {header}){hint}")
        if header.count(name) > 1:
            raise _error(path, 1, name, "the header names this column more than once")
    return header, Chunk(chunk.data[end:], chunk.first_line + 1, chunk.last)


def _csv_records(
    path: str, chunk: Chunk, header: list[str]
) -> Iterator[tuple[int, dict[str, Any]]]:
    reader = csv.reader(io.StringIO(decode(path, chunk), newline=""))
    while True:
        start = chunk.first_line + reader.line_num  # the line the next record begins on
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            raise _error(
                path, chunk.first_line + reader.line_num - 1, None, f"not valid CSV ({exc})"
            ) from exc
        if not row:
            continue  # a blank line, as Python's DictReader skips it
        line = chunk.first_line + reader.line_num - 1
        if len(row) != len(header) and line > start:
            raise _error(
                path,
                start,
                None,
                f"a quoted field opened on this line runs to line "
                f"{line}, leaving {len(row)} field(s) where the header has "
                f"{len(header)}: an unbalanced double quote?",
            )
        if len(row) < len(header):
            raise _error(
                path,
                line,
                header[len(row)],
                f"missing value (the row has "
                f"{len(row)} of the header's {len(header)} fields: a cut row?)",
            )
        if len(row) > len(header):
            raise _error(
                path,
                line,
                None,
                f"{len(row)} fields where the header has "
                f"{len(header)}: a stray comma, or a comma in an unquoted value?",
            )
        yield line, dict(zip(header, row, strict=True))


def _jsonl_records(path: str, chunk: Chunk) -> Iterator[tuple[int, dict[str, Any]]]:
    for offset, text in enumerate(decode(path, chunk).split("\n")):
        line = chunk.first_line + offset
        if not text.strip():
            continue  # blank lines (a trailing newline) carry no request
        try:
            record = json.loads(text)
        except json.JSONDecodeError as exc:
            hint = ""
            if line == 1 and "," in text and not text.lstrip().startswith(("{", "[")):
                hint = "; this looks like CSV: use format=azure, burstgpt or csv"
            raise _error(
                path, line, None, f"invalid JSON ({exc.msg}, column {exc.colno}){hint}"
            ) from exc
        except RecursionError as exc:
            raise _error(path, line, None, "JSON nested too deeply") from exc
        if not isinstance(record, dict):
            raise _error(path, line, None, f"expected a JSON object, got {text.strip()[:80]!r}")
        yield line, record


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
    if number > MAX_TOKENS:
        raise _error(
            path,
            line,
            name,
            f"{value!r} is more than {MAX_TOKENS} tokens (the most "
            "a length may be; a corrupt value?)",
        )
    return int(number)


def _timestamp(path: str, line: int, name: str, value: Any, unit: str) -> float:
    if unit == "datetime":
        match = _DATETIME.fullmatch(str(value).strip())
        if not match:
            raise _error(
                path, line, name, f"{value!r} is not a YYYY-MM-DD HH:MM:SS[.fraction] timestamp"
            )
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
        isinstance(h, int) and not isinstance(h, bool) and 0 <= h < 2**63 for h in value
    ):
        raise _error(
            path, line, name, "expected a list of non-negative integer block ids (below 2^63)"
        )
    if len(value) * MOONCAKE_BLOCK < input_len:
        raise _error(
            path,
            line,
            name,
            f"{len(value)} block(s) of {MOONCAKE_BLOCK} tokens "
            f"cannot cover an input of {input_len} tokens",
        )
    return tuple(value)
