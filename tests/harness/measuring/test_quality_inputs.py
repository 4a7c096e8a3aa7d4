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
