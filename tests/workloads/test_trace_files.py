"""Trace and prompt files as a careless or hostile user hands them over: compressed, binary,
in the wrong encoding, damaged in the middle, not files at all. Each is read (`.gz`) or refused
with a ValueError naming the file and the likely cause, never a UnicodeDecodeError, a hang or
a silently short workload."""

from __future__ import annotations

import bz2
import gzip
import json
import lzma
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bounded_cli import finishes_within

from models.tokenizer import Tokenizer, default_tokenizer
from workloads import PromptsWorkload, SyntheticWorkload, TraceWorkload, trace_files
from workloads.prompt_sets import load_prompt_set
from workloads.traces import load_trace

TRACES = Path(__file__).resolve().parents[2] / "data" / "traces"
AZURE = TRACES / "AzureLLMInferenceTrace_conv.csv"
MOONCAKE = TRACES / "mooncake_conversation_trace.jsonl.gz"
SHAREGPT = TRACES / "sharegpt_v3_filtered_500.json"
MT_BENCH = TRACES / "mt_bench_questions.jsonl"
SONNET = TRACES / "vllm_sonnet.txt"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return default_tokenizer()


@pytest.fixture(scope="module")
def azure_lines() -> list[str]:
    assert TRACES.is_dir(), f"no trace folder at {TRACES}"
    return AZURE.read_text().splitlines()


@pytest.fixture(scope="module")
def mooncake_lines() -> list[str]:
    return gzip.decompress(MOONCAKE.read_bytes()).decode().splitlines()


def fields(requests: list[Any]) -> list[tuple[Any, ...]]:
    return [
        (
            r.request.request_id,
            r.request.prompt,
            r.arrival_s,
            r.prompt_tokens_requested,
            r.request.sampling.max_tokens,
            r.request.prefix_group,
            r.follows,
        )
        for r in requests
    ]


def gzipped(tmp_path: Path, source: Path) -> Path:
    path = tmp_path / (source.name + ".gz")
    path.write_bytes(gzip.compress(source.read_bytes()))
    return path


# ---- .gz is read transparently --------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("source", "options"),
    [
        (AZURE, {"format": "azure", "num_requests": 300, "input_scale": 0.05}),
        (MOONCAKE, {"format": "mooncake", "input_scale": 0.01, "start_s": 60, "end_s": 600}),
    ],
)
def test_gz_traces_replay_like_the_plain_file(
    tmp_path: Path, tok: Tokenizer, source: Path, options: dict[str, Any]
) -> None:
    if source.suffix == ".gz":  # shipped compressed: compare with its plain bytes
        plain_path = tmp_path / source.stem
        plain_path.write_bytes(gzip.decompress(source.read_bytes()))
        packed_path = source
    else:
        plain_path, packed_path = source, gzipped(tmp_path, source)
    plain = TraceWorkload(path=str(plain_path), **options)
    packed = TraceWorkload(path=str(packed_path), **options)
    assert fields(packed.build(tok)) == fields(plain.build(tok))
    assert packed.info["rows_read"] == plain.info["rows_read"] > 0


@pytest.mark.parametrize(
    ("source", "fmt"), [(SHAREGPT, "sharegpt"), (MT_BENCH, "mt_bench"), (SONNET, "text")]
)
def test_gz_prompt_sets_read_like_the_plain_file(tmp_path: Path, source: Path, fmt: str) -> None:
    plain = load_prompt_set(source, fmt)
    packed = load_prompt_set(gzipped(tmp_path, source), fmt)
    assert packed.items == plain.items and len(plain.items) > 50


# ---- binary, compressed, wrongly encoded -----------------------------------------------------

AZURE_HEAD = (
    "TIMESTAMP,ContextTokens,GeneratedTokens\n"
    "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"
)


def _zip() -> bytes:
    return b"PK\x03\x04\x14\x00\x00\x00\x08\x00" + bytes(30)


BAD_FILES: list[tuple[str, str, Callable[[], bytes], str]] = [
    (
        "gzip data without .gz",
        "t.csv",
        lambda: gzip.compress(AZURE_HEAD.encode()),
        r"looks gzip-compressed .*name it t\.csv\.gz",
    ),
    (
        "a .gz name on plain text",
        "t.csv.gz",
        lambda: AZURE_HEAD.encode(),
        r"is named \.gz but is not gzip-compressed",
    ),
    (
        "truncated gzip",
        "t.csv.gz",
        lambda: gzip.compress(AZURE_HEAD.encode() * 300)[:-40],
        r"the gzip data is truncated or corrupt",
    ),
    ("zip", "t.zip", _zip, r"is a zip archive .*unzip it"),
    ("bzip2", "t.csv.bz2", lambda: bz2.compress(AZURE_HEAD.encode()), r"looks bzip2-compressed"),
    ("xz", "t.csv.xz", lambda: lzma.compress(AZURE_HEAD.encode()), r"looks xz-compressed"),
    ("zstd", "t.csv.zst", lambda: b"(\xb5/\xfd" + bytes(range(1, 60)), r"looks zstd-compressed"),
    ("parquet", "t.parquet", lambda: b"PAR1" + bytes(range(1, 60)), r"is a Parquet file"),
    (
        "gzip of a gzip",
        "t.csv.gz",
        lambda: gzip.compress(gzip.compress(AZURE_HEAD.encode())),
        r"the gzip stream holds gzip-compressed data",
    ),
    (
        "UTF-16 with a BOM",
        "t.csv",
        lambda: AZURE_HEAD.encode("utf-16"),
        r"is UTF-16 text .*convert it to UTF-8",
    ),
    (
        "UTF-16 without a BOM",
        "t.csv",
        lambda: AZURE_HEAD.encode("utf-16-le"),
        r"line 1: binary data \(a NUL byte at column 2\)",
    ),
    ("binary", "t.csv", lambda: bytes(range(256)) * 20, r"line 1: binary data \(a NUL byte"),
    (
        "latin-1 in the middle",
        "t.csv",
        lambda: AZURE_HEAD.encode() + "2023-11-16 18:15:51.0,3,4 café\n".encode("latin-1"),
        r"line 4: not UTF-8 text \(byte 0xe9 at column 30\)",
    ),
    (
        "zeroed block after the first 4 kB",
        "t.csv",
        lambda: AZURE_HEAD.encode() * 60 + bytes(512) + b"\n",
        r"line 181: binary data \(a NUL byte at column 1\), not UTF-8 text",
    ),
]


@pytest.mark.parametrize(
    ("case", "name", "content", "message"), BAD_FILES, ids=[c[0] for c in BAD_FILES]
)
def test_binary_compressed_and_misencoded_traces_are_named(
    tmp_path: Path, case: str, name: str, content: Callable[[], bytes], message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content())
    with pytest.raises(ValueError, match=message) as excinfo:
        load_trace(path, "azure")
    assert str(path) in str(excinfo.value)
    assert not isinstance(excinfo.value, UnicodeDecodeError)


@pytest.mark.parametrize(
    ("fmt", "name", "content", "message"),
    [
        (
            "sharegpt",
            "s.json",
            lambda: gzip.compress(SHAREGPT.read_bytes()),
            r"looks gzip-compressed",
        ),
        ("sharegpt", "s.json", lambda: SHAREGPT.read_text().encode("utf-16"), r"is UTF-16 text"),
        (
            "mt_bench",
            "m.jsonl",
            lambda: MT_BENCH.read_bytes().replace(
                b"\n", '\n{"q": "caf\u00e9"}\n'.encode("latin-1"), 1
            ),
            r"line 2: not UTF-8 text",
        ),
        ("text", "p.txt", lambda: "first prompt\nsecond\n".encode("utf-16-le"), r"binary data"),
        ("text", "p.txt", lambda: b"first prompt\ncaf\xe9\n", r"line 2: not UTF-8 text"),
    ],
)
def test_bad_prompt_files_are_named(
    tmp_path: Path, fmt: str, name: str, content: Callable[[], bytes], message: str
) -> None:
    path = tmp_path / name
    path.write_bytes(content())
    with pytest.raises(ValueError, match=message) as excinfo:
        load_prompt_set(path, fmt)
    assert str(path) in str(excinfo.value)


# ---- damaged rows: an error at the line, never a short workload ----------------------------


@pytest.mark.parametrize(
    ("case", "damage", "message"),
    [
        ("cut line", lambda line: line[:25].encode(), "line 4: invalid JSON"),
        (
            "latin-1 text",
            lambda line: line.replace("}", ', "m": "caf\u00e9"}').encode("latin-1"),
            r"line 4: not UTF-8 text",
        ),
        (
            "NUL bytes",
            lambda line: bytes(len(line)),
            "line 4: binary data (a NUL byte at column 1)",
        ),
        (
            "two records on one line",
            lambda line: (line + line).encode(),
            "line 4: invalid JSON (Extra data",
        ),
        ("null", lambda line: b"null", "line 4: expected a JSON object, got 'null'"),
        (
            "deep nesting",
            lambda line: b"[" * 100_000 + b"]" * 100_000,
            "line 4: JSON nested too deeply",
        ),
    ],
)
def test_a_damaged_jsonl_line_in_the_middle_is_an_error_at_its_line(
    tmp_path: Path,
    mooncake_lines: list[str],
    case: str,
    damage: Callable[[str], bytes],
    message: str,
) -> None:
    rows = [line.encode() for line in mooncake_lines[:8]]
    rows[3] = damage(mooncake_lines[3])
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"\n".join(rows) + b"\n")
    with pytest.raises(ValueError) as excinfo:
        TraceWorkload(path=str(path), format="mooncake").build(default_tokenizer())
    assert f"{path}: {message}" in str(excinfo.value)


@pytest.mark.parametrize(
    ("case", "damage", "message"),
    [
        ("extra field", lambda row: row + ",7", r"line 5: 4 fields where the header has 3"),
        (
            "missing field",
            lambda row: row.rsplit(",", 1)[0],
            r"line 5: field 'GeneratedTokens': missing value \(the row has 2 of the header's 3",
        ),
        (
            "unbalanced quote",
            lambda row: '"' + row,
            r"line 5: a quoted field opened on this line runs to line 9",
        ),
        (
            "huge length",
            lambda row: row.rsplit(",", 2)[0] + ",1" + "0" * 30 + ",5",
            r"line 5: field 'ContextTokens': '1000000000000000000000000000000' is more than "
            r"2147483647 tokens",
        ),
    ],
)
def test_a_damaged_csv_row_is_an_error_at_its_line(
    tmp_path: Path, azure_lines: list[str], case: str, damage: Callable[[str], str], message: str
) -> None:
    rows = azure_lines[:9]
    rows[4] = damage(rows[4])
    path = tmp_path / "a.csv"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(ValueError, match=message):
        TraceWorkload(path=str(path)).build(default_tokenizer())


def test_a_row_short_of_a_column_the_replay_ignores_is_still_an_error(tmp_path: Path) -> None:
    path = tmp_path / "b.csv"
    path.write_text(
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,472,18,490,Conversation log\n45,ChatGPT,1087,20,1107\n"
    )
    with pytest.raises(ValueError, match=r"b\.csv: line 3: field 'Log Type': missing value"):
        load_trace(path, "burstgpt")


def test_the_wrong_format_gets_a_hint(
    tmp_path: Path, azure_lines: list[str], mooncake_lines: list[str]
) -> None:
    jsonl = tmp_path / "m.jsonl"
    jsonl.write_text("\n".join(mooncake_lines[:3]) + "\n")
    with pytest.raises(ValueError, match="this looks like JSON Lines: use format=mooncake"):
        load_trace(jsonl, "azure")
    table = tmp_path / "a.csv"
    table.write_text("\n".join(azure_lines[:3]) + "\n")
    with pytest.raises(ValueError, match="this looks like CSV: use format=azure, burstgpt"):
        load_trace(table, "mooncake")


def test_a_line_without_end_is_refused_not_read_forever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(trace_files, "MAX_LINE_BYTES", 1 << 20)
    path = tmp_path / "one.jsonl"
    path.write_bytes(b"{" * (3 << 20))
    with pytest.raises(ValueError, match=r"line 1: no line break in 1 MiB"):
        load_trace(path, "mooncake")


@pytest.mark.parametrize("compressed", [False, True], ids=["plain", "gz"])
def test_a_trace_or_prompt_set_over_the_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, azure_lines: list[str], compressed: bool
) -> None:
    """A trace had no size bound: a file of many gigabytes (or a small .gz that unpacks to
    them) was read to its end. Over the limit (INFERLAB_MAX_INPUT_BYTES here; counted after
    gunzip) it is refused, naming the file, the limit and how to raise it."""
    data = ("\n".join(azure_lines[:2000]) + "\n").encode()
    path = tmp_path / ("a.csv.gz" if compressed else "a.csv")
    path.write_bytes(gzip.compress(data) if compressed else data)
    assert len(data) > 40 << 10
    if compressed:  # the file is under the limit, what it unpacks to is not
        assert path.stat().st_size < 40 << 10
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "40K")
    for action in (lambda: load_trace(path, "azure"), lambda: load_prompt_set(path, "text")):
        with pytest.raises(ValueError) as exc:
            action()
        assert str(exc.value).startswith(f"{path}: ")
        assert "the 40 KiB allowed for a trace, prompt set or text; to read it, raise the " in (
            str(exc.value)
        )
        assert "INFERLAB_MAX_INPUT_BYTES" in str(exc.value)
    monkeypatch.delenv("INFERLAB_MAX_INPUT_BYTES")
    assert len(load_trace(path, "azure")) == 1999


def test_blank_lines_bom_and_crlf_read_like_the_plain_file(
    tmp_path: Path, azure_lines: list[str], mooncake_lines: list[str]
) -> None:
    azure = tmp_path / "a.csv"
    azure.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(azure_lines[:50]).encode() + b"\r\n")
    plain = tmp_path / "p.csv"
    plain.write_text("\n".join(azure_lines[:50]) + "\n")
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text("\r\n".join([*mooncake_lines[:10], "", "  ", *mooncake_lines[10:20]]))
    a, p = load_trace(azure, "azure"), load_trace(plain, "azure")
    assert a.rows == p.rows and len(a) == 49
    m = load_trace(mooncake, "mooncake")
    assert len(m) == 20 and m.rows[10].line == 13  # the blank lines keep their numbers


# ---- paths that are not files ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("make", "kind"),
    [
        (lambda tmp: tmp, "is a directory"),
        (lambda tmp: (os.mkfifo(tmp / "fifo"), tmp / "fifo")[1], r"is a FIFO \(named pipe\)"),
        (lambda tmp: Path("/dev/zero"), "is a character device"),
    ],
)
def test_a_directory_fifo_or_device_is_named_and_never_read(
    tmp_path: Path, make: Callable[[Path], Path], kind: str
) -> None:
    path = make(tmp_path)
    for action in (
        lambda: TraceWorkload(path=str(path)).validate(),
        lambda: load_trace(path, "azure"),
        lambda: PromptsWorkload(path=str(path), format="text").validate(),
        lambda: load_prompt_set(path, "text"),
    ):
        error = finishes_within(action)
        assert isinstance(error, ValueError) and str(path) in str(error)
        assert kind.replace("\\", "") in str(error).replace("\\", "")


def test_an_unreadable_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.csv"
    path.write_text(AZURE_HEAD)

    def refuse(*args: Any, **kwargs: Any) -> Any:  # what open() raises without read permission
        raise PermissionError(13, "Permission denied", str(args[0]))

    monkeypatch.setattr(trace_files, "open", refuse, raising=False)
    for action in (lambda: load_trace(path, "azure"), lambda: load_prompt_set(path, "text")):
        error = finishes_within(action)
        assert isinstance(error, ValueError)
        assert str(error) == f"{path}: cannot open it (Permission denied)"


def test_a_text_corpus_is_read_like_a_prompt_file(tmp_path: Path, tok: Tokenizer) -> None:
    packed = gzipped(tmp_path, SONNET)
    plain = SyntheticWorkload(num_requests=4, input_len=20, prompt="text", corpus=str(SONNET))
    zipped = SyntheticWorkload(num_requests=4, input_len=20, prompt="text", corpus=str(packed))
    assert fields(zipped.build(tok)) == fields(plain.build(tok))
    latin = tmp_path / "c.txt"
    latin.write_bytes(
        "Shall I compare thee\nto a summer\u2019s d\u00e9y".encode("latin-1", "replace")
    )
    with pytest.raises(ValueError, match=r"c\.txt: line 2: not UTF-8 text"):
        SyntheticWorkload(num_requests=1, prompt="text", corpus=str(latin)).build(tok)


def test_mt_bench_and_text_keep_their_line_numbers(tmp_path: Path) -> None:
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines()[:3]]
    path = tmp_path / "m.jsonl"
    path.write_text("\r\n".join(json.dumps(q) for q in questions) + "\r\n\r\n{bad\r\n")
    with pytest.raises(ValueError, match=r"m\.jsonl: line 5: invalid JSON"):
        load_prompt_set(path, "mt_bench")
    text = tmp_path / "p.txt"
    text.write_bytes(b"\xef\xbb\xbfone\r\n\r\ntwo\nthree")
    items = load_prompt_set(text, "text").items
    assert [(i.item_id, i.turns) for i in items] == [
        ("line1", ("one",)),
        ("line3", ("two",)),
        ("line4", ("three",)),
    ]
