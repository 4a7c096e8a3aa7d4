"""Trace loaders and replay, prompt sets: the real files in data/traces, fixtures for
BurstGPT and generic csv/jsonl, and malformed files that must fail with file, line and field."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pytest

from models.tokenizer import Tokenizer, default_tokenizer
from workloads import PromptsWorkload, SyntheticWorkload, TraceWorkload
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


@pytest.fixture
def shared() -> Path:
    # shipped in the repository (data/traces): a missing folder is a failure
    assert TRACES.is_dir(), f"no trace folder at {TRACES}"
    return TRACES


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---- Azure ----------------------------------------------------------------------------------


def test_azure_trace_rows_timestamps_and_span(shared: Path) -> None:
    trace = load_trace(AZURE, "azure")
    assert trace.rows_read == 19366 and len(trace.rows) == 19366 and trace.skipped == {}
    first, second = trace.rows[:2]
    assert (first.line, first.input_len, first.output_len) == (2, 374, 44)
    # 7 fractional digits: 18:15:50.9951690 - 18:15:46.6805900
    assert second.timestamp_s - first.timestamp_s == pytest.approx(4.314579, abs=1e-6)
    assert first.timestamp_s % 1 == pytest.approx(0.6805900, abs=1e-6)
    span = trace.last_timestamp_s - trace.first_timestamp_s
    assert 3501 < span < 3503  # 18:15:46.68 to 19:14:08.40


def test_azure_replay_scales_time_and_lengths(shared: Path, tok: Tokenizer) -> None:
    rows = load_trace(AZURE, "azure").rows
    w = TraceWorkload(
        path=str(AZURE), format="azure", num_requests=200, time_scale=10, input_scale=0.1, seed=3
    )
    reqs = w.build(tok)
    assert len(reqs) == 200 and w.info["requests"] == 200
    # reading stopped at the 200th row: the rest of the trace is neither read nor spanned
    assert w.info["rows_read"] == 200 and w.info["read_to_end"] is False
    assert w.info["trace_span_s"] is None
    t0 = rows[0].timestamp_s
    for r, row in zip(reqs, rows, strict=False):
        assert r.arrival_s == pytest.approx((row.timestamp_s - t0) / 10)
        assert (
            len(r.request.prompt) == r.prompt_tokens_requested == max(1, round(row.input_len * 0.1))
        )
        assert r.request.sampling.max_tokens == row.output_len
        assert r.request.sampling.ignore_eos and r.request.sampling.temperature == 0
    assert w.info["arrival_span_s"] == pytest.approx(reqs[-1].arrival_s)
    whole = TraceWorkload(path=str(AZURE), format="azure", input_scale=0.01)
    whole.build(tok)
    assert whole.info["rows_read"] == 19366 and whole.info["read_to_end"] is True
    assert whole.info["trace_span_s"] == pytest.approx(3501.72, abs=0.01)


def test_azure_window_and_clipping(shared: Path, tok: Tokenizer) -> None:
    w = TraceWorkload(
        path=str(AZURE),
        start_s=600,
        end_s=660,
        max_input_len=500,
        input_scale=0.5,
        max_output_len=100,
    )
    reqs = w.build(tok, context_len=400)
    trace = load_trace(AZURE, "azure")
    t0 = trace.first_timestamp_s
    expected = [r for r in trace.rows if 600 <= r.timestamp_s - t0 < 660]
    assert len(reqs) == len(expected) > 10
    assert reqs[0].arrival_s == 0.0 and max(r.arrival_s for r in reqs) < 60
    for r, row in zip(reqs, expected, strict=True):
        out = min(row.output_len, 100)
        assert r.request.sampling.max_tokens == out
        assert len(r.request.prompt) == min(round(row.input_len * 0.5), 500, 400 - out)
    assert w.info["clipped_max_output_len"] == sum(r.output_len > 100 for r in expected)
    assert w.info["clipped_input"] > 0 and w.info["context_len"] == 400


def test_empty_window_is_an_error(shared: Path) -> None:
    with pytest.raises(ValueError, match=r"workload\.start_s: 9000\.0 is invalid"):
        TraceWorkload(path=str(AZURE), start_s=9000.0).build()


# ---- Mooncake -------------------------------------------------------------------------------


def mooncake_fixture(tmp_path: Path) -> Path:
    rows = [
        {"timestamp": 0, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 0, "input_length": 1400, "output_length": 6, "hash_ids": [0, 1, 3]},
        {"timestamp": 3000, "input_length": 700, "output_length": 7, "hash_ids": [0, 4]},
        {"timestamp": 3000, "input_length": 900, "output_length": 8, "hash_ids": [5, 6]},
    ]
    return write(tmp_path, "mc.jsonl", "".join(json.dumps(r) + "\n" for r in rows))


def test_mooncake_shared_hash_ids_share_exactly_their_blocks(
    tmp_path: Path, tok: Tokenizer
) -> None:
    w = TraceWorkload(
        path=str(mooncake_fixture(tmp_path)), format="mooncake", input_scale=0.125, seed=5
    )  # block = 64 tokens
    a, b, c, d = (r.request.prompt for r in w.build(tok))
    block = 64
    assert w.info["block_len"] == block
    assert [len(p) for p in (a, b, c, d)] == [188, 175, 88, 112]  # round(len / 8)
    assert a[: 2 * block] == b[: 2 * block] and a[2 * block : 3 * block] != b[2 * block : 3 * block]
    assert a[:block] == c[:block] and a[block : 2 * block] != c[block : 2 * block]
    assert a[:block] != d[:block]
    reqs = w.build(tok)
    assert [r.request.prefix_group for r in reqs] == ["0", "0", "0", "5"]
    assert [r.arrival_s for r in reqs] == [0.0, 0.0, 3.0, 3.0]
    other_seed = TraceWorkload(path=w.path, format="mooncake", input_scale=0.125, seed=6)
    assert other_seed.build(tok)[0].request.prompt[:block] != a[:block]


def test_mooncake_real_trace_prefix_sharing(shared: Path, tok: Tokenizer) -> None:
    trace = load_trace(MOONCAKE, "mooncake")
    assert trace.rows_read == 12031 and len(trace.rows) == 12031
    assert trace.last_timestamp_s == pytest.approx(3536.999)
    n = 400
    rows = trace.rows[:n]
    # The pair (i, j) with the longest common run of leading hash ids (k >= 2 blocks).
    best = (0, 0, 0)
    for i in range(n):
        for j in range(i + 1, n):
            a, b = rows[i].hash_ids, rows[j].hash_ids
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            if k < min(len(a), len(b)) and k > best[2]:
                best = (i, j, k)
    i, j, k = best
    assert k >= 2
    w = TraceWorkload(
        path=str(MOONCAKE), format="mooncake", num_requests=n, input_scale=1 / 16, output_scale=0.5
    )
    reqs = w.build(tok)
    block = w.info["block_len"]
    assert block == 32
    pa, pb = reqs[i].request.prompt, reqs[j].request.prompt
    assert pa[: k * block] == pb[: k * block]
    assert pa[k * block : (k + 1) * block] != pb[k * block : (k + 1) * block]
    assert all(r.request.prefix_group == "0" for r in reqs)  # every row starts with hash 0
    assert all(
        len(r.request.prompt) == max(1, round(row.input_len / 16))
        for r, row in zip(reqs, rows, strict=True)
    )


def test_mooncake_text_prompts(tmp_path: Path, tok: Tokenizer) -> None:
    w = TraceWorkload(
        path=str(mooncake_fixture(tmp_path)), format="mooncake", input_scale=0.05, prompt="text"
    )
    reqs = w.build(tok)
    assert all(isinstance(r.request.prompt, str) and r.request.prompt for r in reqs)
    assert reqs[0].request.prompt[:40] == reqs[1].request.prompt[:40]


# ---- BurstGPT and generic csv / jsonl -------------------------------------------------------

BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,ChatGPT,1087,0,1087,Conversation log
118,GPT-4,417,276,693,Conversation log
120,ChatGPT,0,31,31,API log
130.5,GPT-4,12,3,15,API log
"""


def test_burstgpt_skips_and_counts_failed_rows(tmp_path: Path, tok: Tokenizer) -> None:
    path = write(tmp_path, "burst.csv", BURSTGPT)
    trace = load_trace(path, "burstgpt")
    assert trace.rows_read == 5 and len(trace.rows) == 3
    assert trace.skipped == {"zero_output_len": 1, "zero_input_len": 1}
    w = TraceWorkload(path=str(path), format="burstgpt", time_scale=2.0)
    reqs = w.build(tok)
    assert [r.arrival_s for r in reqs] == [0.0, 56.5, 62.75]
    assert [r.prompt_tokens_requested for r in reqs] == [472, 417, 12]
    assert [r.request.sampling.max_tokens for r in reqs] == [18, 276, 3]
    assert w.info["rows_skipped"] == {"zero_output_len": 1, "zero_input_len": 1}
    assert w.info["rows_read"] == 5 and w.info["rows_usable"] == 3
    assert w.info["trace_span_s"] == 125.5  # skipped rows still belong to the trace's clock


def test_generic_csv_and_jsonl_with_column_mappings(tmp_path: Path, tok: Tokenizer) -> None:
    csv_path = write(tmp_path, "t.csv", "arrive_ms,prompt,gen\n1000,10,2\n1500,20,3\n4000,5,1\n")
    columns = {
        "timestamp": "arrive_ms",
        "input_len": "prompt",
        "output_len": "gen",
        "timestamp_unit": "ms",
    }
    reqs = TraceWorkload(path=str(csv_path), format="csv", columns=columns).build(tok)
    assert [r.arrival_s for r in reqs] == [0.0, 0.5, 3.0]
    assert [len(r.request.prompt) for r in reqs] == [10, 20, 5]
    jsonl = write(
        tmp_path,
        "t.jsonl",
        '{"t": "2024-01-01 00:00:00.1234567", "i": 3, "o": 4}\n'
        '\n{"t": "2024-01-01 00:00:01.5", "i": 7, "o": 1}\n',
    )
    w = TraceWorkload(
        path=str(jsonl),
        format="jsonl",
        columns={
            "timestamp": "t",
            "input_len": "i",
            "output_len": "o",
            "timestamp_unit": "datetime",
        },
    )
    reqs = w.build(tok)
    assert reqs[1].arrival_s == pytest.approx(1.3765433)
    untimed = write(tmp_path, "u.jsonl", '{"input_len": 3, "output_len": 4}\n')
    reqs = TraceWorkload(path=str(untimed), format="jsonl", columns={"timestamp": None}).build(tok)
    assert reqs[0].arrival_s == 0.0 and len(reqs[0].request.prompt) == 3


# ---- malformed input: file, line, field ----------------------------------------------------

MALFORMED = [
    (
        "azure",
        "a.csv",
        "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46.6805900,3\n",
        1,
        "GeneratedTokens",
        "missing column",
    ),
    (
        "azure",
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,3,4\n2023-11-16 18:15:47.1,-5,4\n",
        3,
        "ContextTokens",
        "is negative",
    ),
    (
        "azure",
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,3,many\n",
        2,
        "GeneratedTokens",
        "not a whole number",
    ),
    (
        "azure",
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900,3,4\n2023-11-16 18:15:45.0,3,4\n",
        3,
        "TIMESTAMP",
        "earlier than the previous",
    ),
    (
        "azure",
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n16/11/2023 18:15,3,4\n",
        2,
        "TIMESTAMP",
        "not a YYYY-MM-DD",
    ),
    (
        "azure",
        "a.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46,3\n",
        2,
        "GeneratedTokens",
        "missing value",
    ),
    ("azure", "a.csv", "", 1, None, "empty file"),
    ("azure", "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", 2, None, "no data rows"),
    (
        "burstgpt",
        "b.csv",
        "Timestamp,Request tokens,Response tokens\n1,2,3\nsoon,2,3\n",
        3,
        "Timestamp",
        "not a number of s",
    ),
    (
        "burstgpt",
        "b.csv",
        "Timestamp,Request tokens,Response tokens\n1,2.5,3\n",
        2,
        "Request tokens",
        "not a whole number",
    ),
    (
        "mooncake",
        "m.jsonl",
        '{"timestamp": 0, "input_length": 5, "output_length": 1, '
        '"hash_ids": [0]}\n{"timestamp": 1, "input_length": \n',
        2,
        None,
        "invalid JSON",
    ),
    (
        "mooncake",
        "m.jsonl",
        '{"timestamp": 0, "input_length": 5, "hash_ids": [0]}\n',
        1,
        "output_length",
        "missing value",
    ),
    (
        "mooncake",
        "m.jsonl",
        '{"timestamp": 0, "input_length": 1025, "output_length": 1, "hash_ids": [0, 1]}\n',
        1,
        "hash_ids",
        "cannot cover",
    ),
    (
        "mooncake",
        "m.jsonl",
        '{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [-1]}\n',
        1,
        "hash_ids",
        "non-negative",
    ),
    ("mooncake", "m.jsonl", "[1, 2]\n", 1, None, "expected a JSON object"),
    ("mooncake", "m.jsonl", "\n\n", 1, None, "empty file"),
    (
        "jsonl",
        "g.jsonl",
        '{"timestamp": 2, "input_len": 1, "output_len": 1}\n'
        '{"timestamp": 1, "input_len": 1, "output_len": 1}\n',
        2,
        "timestamp",
        "earlier than the previous",
    ),
]


@pytest.mark.parametrize(("fmt", "name", "text", "line", "field", "problem"), MALFORMED)
def test_malformed_traces_name_file_line_and_field(
    tmp_path: Path, fmt: str, name: str, text: str, line: int, field: str | None, problem: str
) -> None:
    path = write(tmp_path, name, text)
    with pytest.raises(ValueError) as excinfo:
        TraceWorkload(path=str(path), format=fmt).build(default_tokenizer())
    message = str(excinfo.value)
    assert str(path.resolve()) in message and f": line {line}: " in message
    if field is not None:
        assert f"field {field!r}" in message
    assert problem in message


@pytest.mark.parametrize(
    ("fmt", "text", "where", "problem"),
    [
        (
            "sharegpt",
            '[{"id": "a", "conversations": [{"from": "human", "value": "hi"}]},\n {"id": "b"}]',
            "entry 2: field 'conversations'",
            "expected a list",
        ),
        (
            "sharegpt",
            '[{"id": "a", "conversations": [{"from": "human"}]}]',
            "entry 1: field 'conversations[0]'",
            "expected",
        ),
        ("sharegpt", '[{"id": "a",\n "conversations": [}]', "line 2", "invalid JSON"),
        ("sharegpt", '{"id": "a"}', "line 1", "expected a JSON array"),
        (
            "mt_bench",
            '{"question_id": 1, "turns": ["a", "b"]}\n{"question_id": 2, "turns": []}\n',
            "line 2: field 'turns'",
            "non-empty list",
        ),
        ("mt_bench", '{"turns": ["a"]}\n', "line 1: field 'question_id'", "missing"),
        ("mt_bench", '{"question_id": 1, "turns": ["a"]}\nnot json\n', "line 2", "invalid JSON"),
        ("mt_bench", "", "line 1", "empty file"),
        ("text", "\n  \n", "line 1", "empty file"),
    ],
)
def test_malformed_prompt_sets_name_file_and_place(
    tmp_path: Path, fmt: str, text: str, where: str, problem: str
) -> None:
    path = write(tmp_path, "set.txt", text)
    with pytest.raises(ValueError, match=re.escape(f"{path}: {where}")) as excinfo:
        load_prompt_set(path, fmt)
    assert problem in str(excinfo.value)


# ---- prompt sets ----------------------------------------------------------------------------


def test_sharegpt_first_human_turns(shared: Path, tok: Tokenizer) -> None:
    data = json.loads(SHAREGPT.read_text())
    w = PromptsWorkload(path=str(SHAREGPT), format="sharegpt", output_len=[10, 20], seed=1)
    reqs = w.build(tok)
    assert len(reqs) == 500 and w.info["items_read"] == 500 and w.info["items_skipped"] == {}
    for r, entry in zip(reqs, data, strict=True):
        assert r.request.prompt == entry["conversations"][0]["value"]  # raw text by default
        assert 10 <= r.request.sampling.max_tokens <= 20  # no replies: from output_len
        assert r.prompt_tokens_requested == len(
            tok.encode(r.request.prompt, add_special_tokens=False)
        )
        assert r.follows is None and r.request.session_id is None
    chat = PromptsWorkload(path=str(SHAREGPT), format="sharegpt", chat=True, num_requests=3)
    assert chat.build(tok)[0].request.prompt == [
        {"role": "user", "content": data[0]["conversations"][0]["value"]}
    ]


def test_sharegpt_reference_outputs_and_cycling(tmp_path: Path, tok: Tokenizer) -> None:
    convs = [
        {
            "id": "x",
            "conversations": [
                {"from": "human", "value": "Say hi."},
                {"from": "gpt", "value": "Hello there, friend!"},
            ],
        },
        {"id": "y", "conversations": [{"from": "gpt", "value": "orphan reply"}]},
        {"id": "z", "conversations": [{"from": "human", "value": "Count to three."}]},
    ]
    path = write(tmp_path, "s.json", json.dumps(convs))
    w = PromptsWorkload(path=str(path), output_len=9, num_requests=5)
    reqs = w.build(tok)
    reply = len(tok.encode("Hello there, friend!", add_special_tokens=False))
    assert [r.request.sampling.max_tokens for r in reqs] == [reply, 9, reply, 9, reply]
    assert [r.request.prompt for r in reqs][:3] == ["Say hi.", "Count to three.", "Say hi."]
    assert len({r.request_id for r in reqs}) == 5
    assert w.info["items_skipped"] == {"no_human_turn": 1} and w.info["passes"] == 3
    fixed = PromptsWorkload(path=str(path), output_len=9, use_reference_output=False)
    assert [r.request.sampling.max_tokens for r in fixed.build(tok)] == [9, 9]


def test_mt_bench_sessions(shared: Path, tok: Tokenizer) -> None:
    w = PromptsWorkload(
        path=str(MT_BENCH),
        format="mt_bench",
        think_time_s=2.0,
        arrival={"process": "poisson", "rate": 1.0},
    )
    reqs = w.build(tok)
    assert len(reqs) == 160 and w.info["sessions"] == 80 and w.info["chat"]
    questions = [json.loads(line) for line in MT_BENCH.read_text().splitlines()]
    by_id = {r.request_id: r for r in reqs}
    firsts = [r for r in reqs if r.request.turn == 0]
    seconds = [r for r in reqs if r.request.turn == 1]
    assert len(firsts) == len(seconds) == 80
    for first, second, q in zip(firsts, seconds, questions, strict=True):
        assert first.follows is None and second.follows == first.request_id
        assert by_id[second.follows] is first
        assert first.request.session_id == second.request.session_id
        assert first.request.prompt == [{"role": "user", "content": q["turns"][0]}]
        assert second.request.prompt == [{"role": "user", "content": q["turns"][1]}]
        assert second.arrival_s == 2.0
    starts = [r.arrival_s for r in firsts]
    assert starts[0] == 0.0 and starts == sorted(starts) and starts[-1] > 0
    assert len({r.request.session_id for r in reqs}) == 80
    with pytest.raises(ValueError, match=r"workload\.chat: False is invalid"):
        PromptsWorkload(path=str(MT_BENCH), format="mt_bench", chat=False).validate()
    cut = PromptsWorkload(path=str(MT_BENCH), format="mt_bench", num_requests=3).build(tok)
    assert [(r.request.session_id, r.request.turn) for r in cut] == [
        ("prompt-s0", 0),
        ("prompt-s0", 1),
        ("prompt-s1", 0),
    ]


def test_sonnet_text_lines_and_corpus(shared: Path, tok: Tokenizer) -> None:
    lines = [x for x in SONNET.read_text().splitlines() if x.strip()]
    w = PromptsWorkload(path=str(SONNET), format="text", output_len=8)
    reqs = w.build(tok)
    assert len(reqs) == len(lines) == 518
    assert [r.request.prompt for r in reqs] == lines
    words = set(SONNET.read_text().split())
    synth = SyntheticWorkload(num_requests=5, input_len=30, prompt="text", corpus=str(SONNET))
    for r in synth.build(tok):
        assert isinstance(r.request.prompt, str)
        inner = r.request.prompt.split()[:-1]  # the window's end may cut a word
        assert set(inner) <= words


def test_prompt_clipping_truncates_to_the_context(shared: Path, tok: Tokenizer) -> None:
    w = PromptsWorkload(path=str(SHAREGPT), output_len=50, num_requests=100)
    reqs = w.build(tok, context_len=120)
    for r in reqs:
        n = len(tok.encode(r.request.prompt, add_special_tokens=False))
        assert r.prompt_tokens_requested <= 70 and abs(n - r.prompt_tokens_requested) <= 2
    assert w.info["clipped_input"] > 0 and w.info["clipped_output"] == 0
    assert np.isclose(w.info["input_len_mean"], np.mean([r.prompt_tokens_requested for r in reqs]))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({}, r"workload\.path: None is invalid"),
        ({"path": "/no/such/trace.csv"}, r"workload\.path: no file"),
        ({"format": "parquet"}, r"workload\.format: 'parquet' is invalid; allowed: azure\|"),
        ({"time_scale": 0}, r"workload\.time_scale"),
        ({"input_scale": -1.0}, r"workload\.input_scale"),
        ({"start_s": 10.0, "end_s": 5.0}, r"workload\.end_s"),
        ({"max_input_len": 0}, r"workload\.max_input_len"),
        ({"columns": {"timestamp": "t"}}, r"workload\.columns: .* null for format azure"),
        (
            {"format": "csv", "columns": {"timestamp_unit": "h"}},
            r"workload\.columns\.timestamp_unit: 'h' is invalid; allowed: s\|ms\|us\|datetime",
        ),
        ({"format": "csv", "columns": {"size": "x"}}, r"workload\.columns: unknown key"),
        ({"prompt": "poetry"}, r"workload\.prompt"),
        ({"num_requests": -3}, r"workload\.num_requests"),
    ],
)
def test_trace_settings_name_the_field(tmp_path: Path, options: dict, message: str) -> None:
    path = write(tmp_path, "t.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n")
    options = {"path": str(path), **options} if "path" not in options and options else options
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        TraceWorkload(**options).validate()


def test_shipped_traces_are_the_published_bytes(shared: Path) -> None:
    """data/traces holds byte-for-byte copies (README: origins, licences, SHA-256 of each; a
    gzip-compressed one's is the published file's, after decompression)."""
    readme = (shared / "README.md").read_text(encoding="utf-8")
    listed = dict(
        line.split()[::-1]
        for line in readme.splitlines()
        if len(line.split()) == 2 and len(line.split()[0]) == 64
    )
    assert sorted(listed) == sorted(p.name for p in shared.iterdir() if p.name != "README.md")
    for name, digest in listed.items():
        data = (shared / name).read_bytes()
        published = gzip.decompress(data) if name.endswith(".gz") else data
        assert hashlib.sha256(published).hexdigest() == digest, name


@pytest.mark.parametrize(
    ("text", "time_scale", "line"),
    [
        ("timestamp,input_len,output_len\n0,5,4\n1e308,5,4\n", 1.0, 3),  # OverflowError before
        ("timestamp,input_len,output_len\n0,5,4\n1,5,4\n2e9,5,4\n", 1.0, 4),
        ("timestamp,input_len,output_len\n0,5,4\n1,5,4\n", 1e-300, 3),  # time_scale too
    ],
)
def test_arrivals_past_the_drivers_clock_name_the_line(
    tmp_path: Path, tok: Tokenizer, text: str, time_scale: float, line: int
) -> None:
    path = write(tmp_path, "far.csv", text)
    with pytest.raises(ValueError, match=rf"workload\.path: .* line {line} arrives"):
        TraceWorkload(path=str(path), format="csv", time_scale=time_scale).build(tok)
