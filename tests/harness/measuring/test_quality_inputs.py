"""`run.quality`'s files are checked before the run: the probe reads them after the benchmark,
so a missing file, a FIFO, /dev/zero or an empty text failed the run only once all of it had
run, with exit 1 and an error that did not name the key."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.measuring.quality import check_inputs

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"text": "/dev/zero"}, "run.quality.text: /dev/zero: is a character device, not a"),
        ({"text": "{tmp}/none.txt"}, "run.quality.text: {tmp}/none.txt: cannot open it (No such"),
        ({"text": "{tmp}/fifo"}, "run.quality.text: {tmp}/fifo: is a FIFO (named pipe), not a"),
        ({"text": "{tmp}/empty.txt"}, "run.quality.text: {tmp}/empty.txt: empty; the probe"),
        (
            {"prompt_sets": ["data/traces/mt_bench_questions.jsonl", "/dev/zero"]},
            "run.quality.prompt_sets[1]: /dev/zero: is a character device, not a regular file",
        ),
        (
            {"prompt_sets": ["{tmp}/none.json"]},
            "run.quality.prompt_sets[0]: no file at {tmp}/none.json (looked in",
        ),
    ],
)
def test_the_probes_files_are_refused_by_name(tmp_path: Path, settings: dict, says: str) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "empty.txt").write_text("")
    given = json.loads(json.dumps(settings).replace("{tmp}", str(tmp_path)))
    with pytest.raises(ValueError) as refused:
        check_inputs(given)
    assert str(refused.value).startswith(says.format(tmp=tmp_path)), refused.value


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"text": "{tmp}/latin1.txt"}, "run.quality.text: {tmp}/latin1.txt: not UTF-8 text"),
        (
            {"prompt_sets": ["{tmp}/bad.json"]},
            "run.quality.prompt_sets[0]: {tmp}/bad.json: entry 1: field 'conversations': "
            "expected a list of turns",
        ),
        (
            {"prompt_sets": ["{tmp}/cut.jsonl"]},
            "run.quality.prompt_sets[0]: {tmp}/cut.jsonl: line 1",
        ),
    ],
)
def test_files_that_do_not_read_or_parse_are_refused_before_the_run(
    tmp_path: Path, settings: dict, says: str
) -> None:
    """Before, these passed the check and failed the run after its benchmark: exit 1 with
    'models.files.UserFileError: ...' or 'ValueError: ...', naming no key."""
    (tmp_path / "latin1.txt").write_bytes("café crème ".encode("latin-1") * 50)
    (tmp_path / "bad.json").write_text('[{"id": 1, "conversations": "oops"}]')
    (tmp_path / "cut.jsonl").write_text('{"question_id": 1, "turns": ["a"')
    given = json.loads(json.dumps(settings).replace("{tmp}", str(tmp_path)))
    with pytest.raises(ValueError) as refused:
        check_inputs(given)
    assert str(refused.value).startswith(says.format(tmp=tmp_path)), refused.value


def test_shipped_files_pass() -> None:
    check_inputs({"text": None, "prompt_sets": ["data/traces/mt_bench_questions.jsonl"]})


def test_inferlab_run_refuses_them_before_the_benchmark(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "harness.cli", "run", "model=tiny", "workload.num_requests=2",
         "run.warmup_requests=0", "run.quality.enabled=true", "run.quality.text=/dev/zero",
         f"hydra.run.dir={run_dir}"],
        cwd=REPO, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .endswith("run.quality.text: /dev/zero: is a character device, not a regular file")
    )
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["error_kind"] == "config" and summary["metrics"]["num_steps"] == 0
