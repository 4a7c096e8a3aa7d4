"""The fast path of the trace reader: a chunk of clean rows parsed column-wise with pyarrow.

The row-by-row parser in workloads/traces.py is the reference. This path accepts only input
on which both are known to agree (digits-only numbers, strict `YYYY-MM-DD HH:MM:SS[.f]`
times, plain JSON numbers, one record per line, no quotes, no blank lines) and returns None
for anything else, including any row the reference would refuse: the caller then parses the
chunk row by row, which yields the same values or the exact error with its line. Both parse
numbers with correct rounding (Arrow's casts and JSON parser, Python's float()), so the values
are bit-identical.
"""

from __future__ import annotations

import io
import re
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pa_csv
import pyarrow.json as pa_json

# Strict subsets of what the reference accepts (Python's float(), its datetime regex).
_WHOLE = r"^[0-9]{1,15}(\.0*)?$"
_NUMBER = r"^-?[0-9]{1,17}(\.[0-9]{0,17})?$"
_DATETIME = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}[ T][0-9]{2}:[0-9]{2}:[0-9]{2}(?:\.[0-9]{1,9})?$"
# pyarrow's JSON reader crashes (SIGSEGV, pyarrow 26) on a block whose first row is `null`:
# such lines never reach it. Blank lines would break the row-to-line numbering.
# (Both patterns start with a literal newline, which `re` scans for quickly.)
_NULL_LINE = re.compile(rb"\n[ \t\r]*null")
_BLANK_LINE = re.compile(rb"\n[ \t\r]*\n")


class Columns(NamedTuple):
    timestamps_s: np.ndarray | None  # float64 seconds (unit applied), or None: no time column
    input_lens: np.ndarray  # int64
    output_lens: np.ndarray  # int64
    hash_offsets: np.ndarray | None  # row i's ids are hash_values[off[i]:off[i + 1]]
    hash_values: np.ndarray | None


def line_count(data: bytes) -> int:
    return data.count(b"\n") + (0 if data.endswith(b"\n") else 1)


def _all_match(array: pa.Array, pattern: str) -> bool:
    return array.null_count == 0 and bool(
        pc.all(pc.match_substring_regex(array, pattern)).as_py() is not False
    )


def _datetimes(array: pa.Array) -> np.ndarray | None:
    if not _all_match(array, _DATETIME):
        return None
    try:  # Arrow's ISO parser: exact nanoseconds, years 1677 to 2262
        nanos = pc.cast(array, pa.timestamp("ns")).cast(pa.int64())
    except pa.ArrowInvalid:  # Feb 30, hour 24, second 60: the reference names the row
        return None
    ns = nanos.to_numpy(zero_copy_only=False)
    # The reference adds int(fraction) / 10 ** len(fraction) to whole seconds; the fraction
    # in nanoseconds over 1e9 is the same rational number, so it rounds to the same float.
    return (ns // 10**9).astype(np.float64) + (ns % 10**9) / 1e9


def _floats(array: pa.Array, pattern: str | None) -> np.ndarray | None:
    """float64 values of a CSV string column (matching pattern) or a JSON number column."""
    if array.null_count:
        return None
    if pa.types.is_string(array.type):
        if pattern is None or not _all_match(array, pattern):
            return None
        array = pc.cast(array, pa.float64())
    if not (pa.types.is_floating(array.type) or pa.types.is_integer(array.type)):
        return None
    return array.to_numpy(zero_copy_only=False).astype(np.float64)


def _times(array: pa.Array, unit: str, scale: dict[str, float]) -> np.ndarray | None:
    if unit == "datetime":
        return _datetimes(array) if pa.types.is_string(array.type) else None
    values = _floats(array, _NUMBER)
    if values is None or not np.isfinite(values).all():
        return None
    return values * scale[unit]


def _lengths(array: pa.Array, max_tokens: int) -> np.ndarray | None:
    values = _floats(array, _WHOLE)
    if values is None or not np.isfinite(values).all():
        return None
    if not ((values >= 0) & (values <= max_tokens) & (values == np.floor(values))).all():
        return None
    return values.astype(np.int64)


def _hash_ids(
    array: pa.Array, input_lens: np.ndarray, block: int
) -> tuple[np.ndarray, np.ndarray] | None:
    if not pa.types.is_list(array.type) or array.null_count:
        return None
    values = array.flatten()
    if values.null_count or not pa.types.is_int64(values.type):
        return None
    offsets = array.offsets.to_numpy(zero_copy_only=False).astype(np.int64)
    offsets = offsets - offsets[0]
    ids = values.to_numpy(zero_copy_only=False)
    if (ids < 0).any() or (np.diff(offsets) * block < input_lens).any():
        return None
    return offsets, ids


def _columns(
    table: pa.Table,
    layout: Any,
    previous_s: float | None,
    scale: dict[str, float],
    max_tokens: int,
    block: int,
) -> Columns | None:
    times = None
    if layout.timestamp:
        times = _times(table.column(layout.timestamp).combine_chunks(), layout.unit, scale)
        if times is None or (len(times) and previous_s is not None and times[0] < previous_s):
            return None
        if (np.diff(times) < 0).any():  # the reference names the row that goes back in time
            return None
    inputs = _lengths(table.column(layout.input_len).combine_chunks(), max_tokens)
    outputs = _lengths(table.column(layout.output_len).combine_chunks(), max_tokens)
    if inputs is None or outputs is None:
        return None
    hashes = None
    if layout.hash_ids:
        hashes = _hash_ids(table.column(layout.hash_ids).combine_chunks(), inputs, block)
        if hashes is None:
            return None
    return Columns(times, inputs, outputs, *(hashes or (None, None)))


#: pyarrow's readers drop a UTF-8 byte-order mark at the start of what they are given, as a
#: file's; at the start of a later chunk it is a stray character the row parser refuses.
BOM = "\ufeff".encode()


def csv_columns(
    data: bytes,
    header: list[str],
    layout: Any,
    previous_s: float | None,
    scale: dict[str, float],
    max_tokens: int,
) -> Columns | None:
    """Columns of a chunk of CSV data rows (no header), or None: parse it row by row."""
    if b'"' in data or data.count(b"\r") != data.count(b"\r\n") or BOM in data:
        return None  # quoting, bare CR line ends, a stray BOM: left to Python's csv module
    needed = list(
        dict.fromkeys(c for c in (layout.timestamp, layout.input_len, layout.output_len) if c)
    )
    try:
        table = pa_csv.read_csv(
            io.BytesIO(data),
            read_options=pa_csv.ReadOptions(column_names=header, use_threads=False),
            parse_options=pa_csv.ParseOptions(ignore_empty_lines=False),
            convert_options=pa_csv.ConvertOptions(
                include_columns=needed, column_types=dict.fromkeys(needed, pa.string())
            ),
        )
    except (pa.ArrowException, ValueError):  # a ragged row, say: the reference names it
        return None
    if table.num_rows != line_count(data):
        return None
    return _columns(table, layout, previous_s, scale, max_tokens, 0)


def jsonl_columns(
    data: bytes,
    layout: Any,
    previous_s: float | None,
    scale: dict[str, float],
    max_tokens: int,
    block: int,
) -> Columns | None:
    """Columns of a chunk of JSON lines, or None: parse it row by row."""
    framed = b"\n" + (data if data.endswith(b"\n") else data + b"\n")
    if (b"null" in data and _NULL_LINE.search(framed)) or _BLANK_LINE.search(framed):
        return None
    if BOM in data:
        return None
    fields: dict[str, pa.DataType] = {}
    roles = [(layout.input_len, pa.float64()), (layout.output_len, pa.float64())]
    if layout.timestamp:
        roles.append((layout.timestamp, pa.string() if layout.unit == "datetime" else pa.float64()))
    if layout.hash_ids:
        roles.append((layout.hash_ids, pa.list_(pa.int64())))
    for name, kind in roles:
        if fields.setdefault(name, kind) != kind:
            return None  # one key read as two kinds: left to the reference
    try:
        table = pa_json.read_json(
            io.BytesIO(data),
            read_options=pa_json.ReadOptions(use_threads=False, block_size=len(data) + 1),
            parse_options=pa_json.ParseOptions(
                explicit_schema=pa.schema(list(fields.items())), unexpected_field_behavior="ignore"
            ),
        )
    except (pa.ArrowException, ValueError):
        return None
    if table.num_rows != line_count(data):  # `{...}{...}` on one line reads as two rows
        return None
    return _columns(table, layout, previous_s, scale, max_tokens, block)
