"""The chunked trace reader: it stops once the rows asked for are in, the window is pushed
down, and the column-wise fast path gives exactly what the row-by-row reference gives (and
what an independent reading of the shared traces gives)."""

from __future__ import annotations

import calendar
import csv
import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from models.tokenizer import Tokenizer, default_tokenizer
from workloads import TraceWorkload, trace_arrow, trace_files, traces
from workloads.trace_files import Chunk
from workloads.traces import Trace, load_trace

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl.gz"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return default_tokenizer()


@pytest.fixture
def paths(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, int]]:
    """Counts of chunks parsed column-wise ("fast") and row by row ("reference")."""
    counts = {"fast": 0, "reference": 0}
    for name in ("csv_columns", "jsonl_columns"):
        original = getattr(trace_arrow, name)

        def spy(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            result = _original(*args, **kwargs)
            counts["fast" if result is not None else "reference"] += 1
            return result

        monkeypatch.setattr(trace_arrow, name, spy)
    yield counts


def reference_only(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("csv_columns", "jsonl_columns"):
        monkeypatch.setattr(trace_arrow, name, lambda *args, **kwargs: None)


def same(a: Trace, b: Trace) -> None:
    assert np.array_equal(a.lines, b.lines)
    assert (a.timestamps_s is None) == (b.timestamps_s is None)
    if a.timestamps_s is not None:
        assert np.array_equal(a.timestamps_s, b.timestamps_s)  # bit for bit
    assert np.array_equal(a.input_lens, b.input_lens)
    assert np.array_equal(a.output_lens, b.output_lens)
    assert [a.hash_ids(i) for i in range(len(a))] == [b.hash_ids(i) for i in range(len(b))]
    assert (a.rows_read, a.skipped, a.first_timestamp_s, a.last_timestamp_s, a.read_to_end) == (
        b.rows_read,
        b.skipped,
        b.first_timestamp_s,
        b.last_timestamp_s,
        b.read_to_end,
    )


def fresh(path: Path, fmt: str, **options: Any) -> Trace:
    """A read that bypasses the cache of earlier reads."""
    from workloads import traces

    traces._load.cache_clear()
    return load_trace(path, fmt, **options)


# ---- the fast path is exact ----------------------------------------------------------------


@pytest.mark.parametrize(("path", "fmt"), [(AZURE, "azure"), (MOONCAKE, "mooncake")])
def test_fast_path_equals_the_row_by_row_reference_on_the_shared_traces(
    monkeypatch: pytest.MonkeyPatch, paths: dict[str, int], path: Path, fmt: str
) -> None:
    fast = fresh(path, fmt)
    assert paths["fast"] >= 1 and paths["reference"] == 0  # the clean traces take the fast path
    reference_only(monkeypatch)
    same(fast, fresh(path, fmt))


def test_azure_values_match_an_independent_reading(paths: dict[str, int]) -> None:
    trace = fresh(AZURE, "azure")
    with AZURE.open(newline="") as f:
        rows = list(csv.DictReader(f))
    expected = []
    for row in rows:
        clock, _, fraction = row["TIMESTAMP"].partition(".")
        fields = [int(x) for x in clock.replace("-", " ").replace(":", " ").split()]
        whole = calendar.timegm((*fields, 0, 0, 0))
        expected.append(whole + int(fraction) / 10 ** len(fraction))
    assert paths["fast"] >= 1 and paths["reference"] == 0
    assert trace.timestamps_s.tolist() == expected
    assert trace.input_lens.tolist() == [int(r["ContextTokens"]) for r in rows]
    assert trace.output_lens.tolist() == [int(r["GeneratedTokens"]) for r in rows]
    assert trace.lines.tolist() == list(range(2, len(rows) + 2))


def test_mooncake_values_match_an_independent_reading(paths: dict[str, int]) -> None:
    trace = fresh(MOONCAKE, "mooncake")
    rows = [json.loads(line) for line in _lines(MOONCAKE)]
    assert paths["fast"] >= 1 and paths["reference"] == 0
    assert trace.timestamps_s.tolist() == [r["timestamp"] * 1e-3 for r in rows]
    assert trace.input_lens.tolist() == [r["input_length"] for r in rows]
    assert [list(trace.hash_ids(i)) for i in range(len(trace))] == [r["hash_ids"] for r in rows]


@pytest.mark.parametrize(("path", "fmt"), [(AZURE, "azure"), (MOONCAKE, "mooncake")])
def test_chunk_boundaries_change_nothing(
    monkeypatch: pytest.MonkeyPatch, path: Path, fmt: str
) -> None:
    whole = fresh(path, fmt)
    monkeypatch.setattr(trace_files, "CHUNK_BYTES", 7001)  # hundreds of cuts, odd places
    monkeypatch.setattr(trace_files, "FIRST_CHUNK_BYTES", 333)
    same(whole, fresh(path, fmt))
    windowed = fresh(path, fmt, start_s=300.0, end_s=900.0, limit=2000)
    monkeypatch.undo()
    same(windowed, fresh(path, fmt, start_s=300.0, end_s=900.0, limit=2000))


def test_rows_the_fast_path_declines_are_read_by_the_reference(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, paths: dict[str, int]
) -> None:
    lines = AZURE.read_text().splitlines()
    # A quoted value, a length with a space before it and a blank line, in the middle: those
    # chunks go row by row, the others column-wise; together they read as the clean file does.
    lines[3000] = '"{}",{},{}'.format(*lines[3000].split(","))
    lines[9000] = "{}, {},{}".format(*lines[9000].split(","))
    lines.insert(15000, "")
    mixed = tmp_path / "mixed.csv"
    mixed.write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(trace_files, "CHUNK_BYTES", 64 << 10)
    got = fresh(mixed, "azure")
    assert paths["fast"] > 3 and paths["reference"] == 3
    expected = fresh(AZURE, "azure")
    assert np.array_equal(got.timestamps_s, expected.timestamps_s)
    assert np.array_equal(got.input_lens, expected.input_lens)
    assert np.array_equal(got.output_lens, expected.output_lens)
    assert got.lines[15000 - 1] == expected.lines[15000 - 1] + 1  # after the blank line


# What a damaged or odd trace may hold: the fast path must decline it or agree exactly.
ODD = [
    "",
    " ",
    "\t",
    "\r",
    "\n",
    "\r\n",
    '"',
    ",",
    ".",
    "-",
    "+",
    "0",
    "9",
    "e",
    "Z",
    "T",
    "null",
    "true",
    "NaN",
    "Infinity",
    "1e400",
    "\x1c",
    "\u00a0",
    "\u0663",
    "{",
    "}",
    "[",
    "]",
    ":",
    '"timestamp"',
    "1.5",
    "0x10",
    "1_0",
    "99999999999999999999",
    "2023-02-30",
    "24:00:00",
    ":60",
    ".0",
    "  ",
    "\ufeff",
    "\u2028",
]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fmt=st.sampled_from(["azure", "burstgpt", "mooncake"]),
    start=st.integers(1, 5000),
    count=st.integers(1, 8),
    newline=st.booleans(),
    edits=st.lists(st.tuples(st.floats(0, 1), st.sampled_from(ODD), st.integers(0, 2)), max_size=3),
    previous=st.sampled_from([None, 0.0, 1.7e9, 1e12]),
)
# found by hypothesis: pyarrow dropped a byte-order mark at a chunk's start as a file's BOM
@example(fmt="mooncake", start=1, count=1, newline=False, edits=[(0.0, "\ufeff", 0)], previous=None)
@example(fmt="azure", start=1, count=1, newline=False, edits=[(0.0, "\ufeff", 0)], previous=None)
def test_fast_path_declines_or_agrees_with_the_reference(
    fmt: str,
    start: int,
    count: int,
    newline: bool,
    edits: list[tuple[float, str, int]],
    previous: float | None,
) -> None:
    source = MOONCAKE if fmt == "mooncake" else AZURE
    lines = _lines(source)
    rows = lines[start : start + count]
    if fmt == "burstgpt":  # a numeric time column: seconds since the first row
        rows = [
            f"{i * 0.5},{line.split(',')[1]},{int(line.split(',')[2]) % 3}"
            for i, line in enumerate(rows)
        ]
    text = "\n".join(rows) + ("\n" if newline else "")
    for where, piece, cut in edits:
        at = int(where * len(text))
        text = text[:at] + piece + text[at + cut :]
    data = text.encode()
    layout = traces._LAYOUTS[fmt]
    header = (
        lines[0].split(",")
        if fmt == "azure"
        else ["Timestamp", "Request tokens", "Response tokens"]
        if fmt == "burstgpt"
        else None
    )
    if header is not None:
        fast = trace_arrow.csv_columns(
            data, header, layout, previous, traces._UNIT_SCALE, traces.MAX_TOKENS
        )
    else:
        fast = trace_arrow.jsonl_columns(
            data, layout, previous, traces._UNIT_SCALE, traces.MAX_TOKENS, traces.MOONCAKE_BLOCK
        )
    event("declined" if fast is None else "parsed column-wise")
    if fast is None:
        return
    chunk = Chunk(data, 2, True)
    records = (
        traces._csv_records("t", chunk, header)
        if header is not None
        else traces._jsonl_records("t", chunk)
    )
    got_lines, reference = traces._rows("t", records, layout, previous)  # must not raise
    assert got_lines.tolist() == list(range(2, 2 + len(fast.input_lens)))
    for a, b in zip(fast, reference, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            assert np.array_equal(a, b)


_LINES: dict[Path, list[str]] = {}


def _lines(path: Path) -> list[str]:
    if path not in _LINES:
        data = path.read_bytes()
        _LINES[path] = (
            (gzip.decompress(data) if path.suffix == ".gz" else data).decode().splitlines()
        )
    return _LINES[path]


# ---- stopping early -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~10 MB: the shared Azure rows repeated on 14 consecutive days, then a damaged tail."""
    header, *rows = AZURE.read_text().splitlines()
    body = "\n".join(rows) + "\n"
    path = tmp_path_factory.mktemp("long") / "azure_long.csv"
    with path.open("wb") as f:
        f.write((header + "\n").encode())
        for day in range(14):
            f.write(body.replace("2023-11-16", f"2023-11-{16 + day:02d}").encode())
        f.write(b"2023-11-30 00:00:00.0,\xff\xfe garbage \x00\x00,5\n")
    return path


def test_num_requests_reads_only_the_first_rows(
    long_trace: Path, tok: Tokenizer, paths: dict[str, int]
) -> None:
    assert long_trace.stat().st_size > 2 * trace_files.CHUNK_BYTES
    w = TraceWorkload(path=str(long_trace), num_requests=10, input_scale=0.1)
    reqs = w.build(tok)
    assert len(reqs) == 10 and paths["fast"] + paths["reference"] == 1  # one small chunk
    assert w.info["rows_read"] == 10 and w.info["rows_usable"] == 10
    assert w.info["read_to_end"] is False and w.info["trace_span_s"] is None
    expected = fresh(AZURE, "azure", limit=10)
    assert [r.arrival_s for r in reqs] == (
        expected.timestamps_s - expected.timestamps_s[0]
    ).tolist()
    # the damaged last line is real: reading the whole trace reaches it
    with pytest.raises(ValueError, match=rf"{long_trace}: line {14 * 19366 + 2}: "):
        TraceWorkload(path=str(long_trace), num_requests=None).build(tok)


def test_the_window_is_pushed_down(long_trace: Path, tok: Tokenizer, paths: dict[str, int]) -> None:
    # 2 days and 10 minutes in: the first row at or past end_s ends the read
    start = 2 * 86400 + 600.0
    w = TraceWorkload(path=str(long_trace), start_s=start, end_s=start + 60, input_scale=0.01)
    reqs = w.build(tok)
    chunks_read = paths["fast"] + paths["reference"]
    full = fresh(AZURE, "azure")
    since = full.timestamps_s - full.timestamps_s[0]
    inside = (since >= 600) & (since < 660)
    assert len(reqs) == int(inside.sum()) > 10
    assert [r.prompt_tokens_requested for r in reqs] == [
        max(1, round(n * 0.01)) for n in full.input_lens[inside]
    ]
    assert w.info["read_to_end"] is False
    assert 2 * 19366 < w.info["rows_read"] < 3 * 19366
    assert chunks_read == 4  # 64 kB, 256 kB, 1 MB and 4 MB hold the first 2.2 days
    later = TraceWorkload(path=str(long_trace), start_s=start, num_requests=5).build(tok)
    assert [r.arrival_s for r in later] == pytest.approx(
        (full.timestamps_s[inside][:5] - full.timestamps_s[inside][0]).tolist()
    )


def test_read_to_end_says_whether_the_end_of_the_file_was_reached() -> None:
    assert fresh(AZURE, "azure", limit=19366).read_to_end is True  # the last row is needed
    partial = fresh(AZURE, "azure", limit=19365)
    assert partial.read_to_end is False and partial.rows_read == 19365
    assert fresh(AZURE, "azure", end_s=4000.0).read_to_end is True


def test_an_empty_window_inside_the_trace_says_so(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "gap.csv"
    path.write_text("Timestamp,Request tokens,Response tokens\n0,5,1\n1,5,1\n100,5,1\n200,5,1\n")
    with pytest.raises(
        ValueError,
        match=r"workload\.start_s: 10\.0 is invalid; allowed: a "
        r"window .* no usable row of the trace lies in it",
    ):
        TraceWorkload(path=str(path), format="burstgpt", start_s=10.0, end_s=50.0).build(tok)
    with pytest.raises(ValueError, match=r"the trace spans 0 to 200\.000 s"):
        TraceWorkload(path=str(path), format="burstgpt", start_s=500.0).build(tok)
    none = TraceWorkload(path=str(path), format="burstgpt", num_requests=0)
    assert none.build(tok) == [] and none.info["requests"] == 0


def test_scaling_past_the_token_limit_is_an_error(tmp_path: Path, tok: Tokenizer) -> None:
    path = tmp_path / "t.csv"
    path.write_text("Timestamp,Request tokens,Response tokens\n0,2000000000,1\n")
    with pytest.raises(
        ValueError,
        match=r"workload\.input_scale: 4\.0 is invalid; allowed: "
        r"a scale that keeps every length within 2147483647 tokens",
    ):
        TraceWorkload(path=str(path), format="burstgpt", input_scale=4.0).build(tok)
