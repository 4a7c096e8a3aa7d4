"""`inferlab import` on bad input: one line on stderr naming the file and what is wrong (not
JSON, a key missing, a value of the wrong type, a tool that cannot be told), exit status 2, and
nothing written."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from harness import cli

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
