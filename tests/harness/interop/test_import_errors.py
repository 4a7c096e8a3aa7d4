"""`inferlab import` on bad input: one line on stderr naming the file and what is wrong (not
JSON, a key missing, a value of the wrong type, a tool that cannot be told), exit status 2, and
nothing written."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from bounded_cli import run_inferlab

from harness import cli
from harness.run_folder import short_json

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
DETAILED = json.loads((FIXTURES / "vllm" / "detailed.json").read_text())


def bad_vllm(**changes: object) -> str:
    return json.dumps({**DETAILED, **changes})


@pytest.mark.parametrize(
    ("name", "content", "options", "expected"),
    [
        ("r.json", "{oops", [], "r.json: not valid JSON (Expecting property name"),
        ("r.json", "  \n", [], "r.json: empty file"),
        ("r.json", b"\xff\xfe\x00binary", [], "r.json: not UTF-8 text (byte 0)"),
        ("r.yaml", "a: [1, 2", [], "r.yaml: not valid YAML"),
        (
            "r.json",
            '{"a": 1}',
            [],
            "r.json: cannot tell which tool wrote it (not a result file of vllm, guidellm, "
            "aiperf, genai-perf, llmperf as the lab knows them); give --format "
            "vllm|guidellm|aiperf|genai-perf|llmperf",
        ),
        ("r.json", "[1, 2, 3]", [], "r.json: cannot tell which tool wrote it"),
        ("r.csv", "name,value\nx,1\n", [], "r.csv: cannot tell which tool wrote it"),
        (
            "r.json",
            '{"a": 1}',
            ["--format", "vllm"],
            "r.json: not a vllm bench serve result (--save-result JSON): missing key 'duration'",
        ),
        (
            "r.json",
            bad_vllm(completed="three"),
            [],  # told from its other keys, then checked
            "r.json: not a vllm bench serve result (--save-result JSON): key 'completed': "
            "Input should be a valid integer",
        ),
        (
            "r.json",
            bad_vllm(itls=[[0.04]] * 3),
            [],
            "r.json: not a vllm bench serve result (--save-result JSON): 'itls' has 3 "
            "entries, 'ttfts' 4",
        ),
        (
            "r.json",
            bad_vllm(),
            ["--format", "guidellm"],
            "r.json: not a guidellm benchmark report: missing key 'benchmarks'",
        ),
        (
            "r.json",
            '{"metadata": {"guidellm_version": "0.8.1"}, "benchmarks": []}',
            [],
            "r.json: a guidellm benchmark report with no benchmark in it",
        ),
        (
            "r.json",
            bad_vllm(),
            ["--format", "llmperf"],
            "r.json: not an LLMPerf summary (*_summary.json): missing key "
            "'results_num_completed_requests'",
        ),
        (
            "profile_export.jsonl",
            '{"metadata": {"request_end_ns": 2}, "metrics": {}}\n{"metadata": {}}\n',
            ["--format", "aiperf"],
            "profile_export.jsonl: not an AIPerf record (line 1): missing key "
            "'metadata.request_start_ns'",
        ),
        (
            "r.csv",
            "Stat,avg\nx,1\n",
            ["--format", "aiperf"],
            "r.csv: a CSV table starts with ['Stat', 'avg']; expected a header row 'Metric,...'",
        ),
        (
            "r.csv",
            "Metric,avg\nRequest Latency (ms),fast\n",
            ["--format", "genai-perf"],
            "r.csv: Request Latency (ms), avg: 'fast' is not a number",
        ),
        (
            "r.json",
            bad_vllm(),
            ["--format", "bogus"],
            "--format: 'bogus' is invalid; allowed: auto|",
        ),
        ("r.json", bad_vllm(), ["--benchmark", "1"], "--benchmark: 1 is invalid; allowed: 0 to 0"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    content: str | bytes,
    options: list[str],
    expected: str,
) -> None:
    path = tmp_path / name
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content)
    out = tmp_path / "out"
    assert cli.main(["import", str(path), "--out", str(out), *options]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferlab import: error: ") and err.count("\n") == 1, err
    assert expected in err
    assert not out.exists()


def test_missing_files_and_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["import", str(tmp_path / "nope.json")]) == 2
    assert f"{tmp_path / 'nope.json'}: no such file" in capsys.readouterr().err
    assert cli.main(["import", str(tmp_path)]) == 2
    assert f"{tmp_path}: a folder; give the result file in it" in capsys.readouterr().err


def test_an_existing_output_folder_is_not_written_over(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    source = FIXTURES / "vllm" / "detailed.json"
    assert cli.main(["import", str(source), "--out", str(out)]) == 2
    assert "exists and is not an empty folder" in capsys.readouterr().err
    assert (out / "summary.json").read_text() == "{}"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli.main(["import", str(source), "--out", str(empty)]) == 0  # an empty one is fine


def test_default_output_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shutil.copy(FIXTURES / "vllm" / "detailed.json", tmp_path / "my run.json")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["import", "my run.json"]) == 0
    [folder] = (tmp_path / "results" / "imported").iterdir()
    assert folder.name.endswith("_vllm_my-run")
    assert (folder / "summary.json").is_file() and (folder / "requests.parquet").is_file()


def bad_guidellm_aggregate() -> str:
    """A guidellm report whose requests are sampled (so its aggregates are read) with a
    negative mean TTFT."""
    report = json.loads((FIXTURES / "guidellm" / "benchmarks.json").read_text())
    benchmark = report["benchmarks"][0]
    benchmark["requests"]["successful"] = benchmark["requests"]["successful"][:2]
    benchmark["metrics"]["time_to_first_token_ms"]["successful"]["mean"] = -5.0
    return json.dumps(report)


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (  # a duration of the wrong type was an internal error in telling the tool
            bad_vllm(duration="fast"),
            "r.json: not a vllm bench serve result (--save-result JSON): key 'duration': "
            "Input should be a valid number",
        ),
        (  # negative numbers made negative latencies, counts and rates in summary.json
            bad_vllm(queue_times=[-100.0, 0.01, 0.0, 0.02]),
            "r.json: request 0: its first token before its scheduled arrival",
        ),
        (bad_vllm(latencies=[-0.2, 0.26, 0.0, 0.14]), "r.json: request 0: its last token before"),
        (bad_vllm(output_lens=[-5, 6, 0, 4]), "r.json: request 0: a negative output token count"),
        (bad_vllm(input_lens=[-32, 48, 40, 16]), "r.json: request 0: a negative prompt token"),
        (bad_vllm(itls=[[-1.0], [0.04], [], [0.03]]), "r.json: itls: a chunk gap of -1 s"),
        (
            bad_vllm(spec_decode_acceptance_rate=-50.0),
            "r.json: spec_decode_acceptance_rate: gives spec_acceptance_rate = -0.5; a "
            "negative fraction value is not a measurement",
        ),
        (
            bad_guidellm_aggregate(),
            "r.json: time_to_first_token_ms.successful.mean: gives ttft_mean_s = -0.005",
        ),
    ],
)
def test_bad_values_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, expected: str
) -> None:
    path = tmp_path / "r.json"
    path.write_text(content)
    out = tmp_path / "out"
    assert cli.main(["import", str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("inferlab import: error: ") and err.count("\n") == 1, err
    assert expected in err
    assert not out.exists()


def test_a_result_of_zero_requests(tmp_path: Path) -> None:
    """`--save-detailed` lists with no entry (num_prompts 0) were an internal error."""
    empty: dict[str, object] = {
        k: [] for k, v in DETAILED.items() if isinstance(v, list) and k != "itls"
    }
    path = tmp_path / "r.json"
    path.write_text(
        bad_vllm(
            **empty,
            itls=[],
            num_prompts=0,
            completed=0,
            failed=0,
            total_input_tokens=0,
            total_output_tokens=0,
            duration=0.0,
            request_throughput=0.0,
        )
    )
    assert cli.main(["import", str(path), "--out", str(tmp_path / "out")]) == 0
    metrics = json.loads((tmp_path / "out" / "summary.json").read_text())["metrics"]
    assert metrics["num_requests"] == metrics["num_completed"] == 0
    assert "ttft_mean_s" not in metrics


def test_short_json_encodes_only_what_it_shows() -> None:
    class Unprintable:
        def __str__(self) -> str:
            raise AssertionError("encoded past the part shown")

    assert short_json([0] * 100 + [Unprintable()]) == ("[" + "0, " * 20)[:57] + "..."


@pytest.mark.parametrize("out", ["", "  "])
def test_an_empty_output_folder_is_an_error_not_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], out: str
) -> None:
    """`--out ""` (an unset shell variable) wrote to results/imported/..., as without --out."""
    monkeypatch.chdir(tmp_path)
    source = FIXTURES / "vllm" / "detailed.json"
    assert cli.main(["import", str(source), "--out", out]) == 2
    err = capsys.readouterr().err.strip()
    allowed = "allowed: a folder path (or no --out)"
    assert err == f"inferlab import: error: --out: {out!r} is invalid; {allowed}"
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda tmp: Path("/dev/zero"), "/dev/zero: is a character device, not a regular file"),
        (lambda tmp: (os.mkfifo(tmp / "r.json"), tmp / "r.json")[1], "is a FIFO (named pipe)"),
    ],
    ids=["/dev/zero", "fifo"],
)
def test_a_device_or_fifo_is_refused_not_read(
    tmp_path: Path, make: Callable[[Path], Path], expected: str
) -> None:
    """`inferlab import /dev/zero --format vllm` read until the OOM killer ended it (13.8 GB);
    a FIFO blocked for ever. Both are refused, naming the file, before a byte is read."""
    path = make(tmp_path)
    done = run_inferlab("import", str(path), "--format", "vllm", "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("inferlab import: error: ") and expected in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr
    assert not (tmp_path / "out").exists()


def test_a_result_file_over_the_limit_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    source = FIXTURES / "vllm" / "detailed.json"
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "1K")  # the fixture is 1488 bytes
    assert cli.main(["import", str(source), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"inferlab import: error: {source}: 1.45 KiB is more than the 1 KiB allowed for a "
        "result file; to read it, raise the limit with the environment variable "
        "INFERLAB_MAX_INPUT_BYTES (e.g. INFERLAB_MAX_INPUT_BYTES=8G)\n"
    )
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "lots")
    assert cli.main(["import", str(source), "--out", str(tmp_path / "out")]) == 2
    assert "INFERLAB_MAX_INPUT_BYTES: 'lots' is invalid; allowed: a number of bytes" in (
        capsys.readouterr().err
    )
    monkeypatch.setenv("INFERLAB_MAX_INPUT_BYTES", "2K")
    assert cli.main(["import", str(source), "--out", str(tmp_path / "out")]) == 0
