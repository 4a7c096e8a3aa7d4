"""Every command that writes where the user says refuses a run folder's own file (the one
guard, harness.run_folder.refuse_run_file; docs/run_folder.md "Files the commands write"):
named directly, through a link to it, or through a linked folder. Exit 2, one line naming the
option, and the run folder byte for byte as it was. `train-tiny` (and `convert`,
tests/models/test_gguf_convert.py), below the harness, refuse any --out that exists instead."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from harness import cli

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
VLLM_RESULT = FIXTURES / "vllm" / "detailed.json"


@pytest.fixture(scope="module")
def imported_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real run folder (summary.json, requests.parquet, provenance.json, config.yaml),
    imported from a vLLM result: made in a moment, without a model."""
    run = tmp_path_factory.mktemp("guard") / "run"
    assert cli.main(["import", str(VLLM_RESULT), "--out", str(run)]) == 0
    return run


@pytest.fixture
def run(imported_run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "run"
    shutil.copytree(imported_run, copy)
    return copy


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


#: the run's own file a target reaches, and how: (name, make(tmp, run) -> the path given)
TARGETS: dict[str, Callable[[Path, Path], Path]] = {
    "summary.json": lambda tmp, run: run / "summary.json",
    "requests.parquet": lambda tmp, run: run / "requests.parquet",
    "config.yaml": lambda tmp, run: run / "config.yaml",
    "app.log": lambda tmp, run: run / "app.log",  # Hydra's log of the run
    "a link to summary.json": lambda tmp, run: _link(tmp / "result.json", run / "summary.json"),
    "summary.json in a linked folder": lambda tmp, run: _link(tmp / "linked", run) / "summary.json",
    "a new file in profile/": lambda tmp, run: run / "profile" / "gate.json",
}


def _link(link: Path, target: Path) -> Path:
    link.symlink_to(target)
    return link


#: each command's argv writing to `out`; `other` is a second run folder to read
WRITERS: dict[str, Callable[[Path, Path], list[str]]] = {
    "gate --markdown": lambda other, out: [
        "gate", "--baseline", str(other), "--candidate", str(other), "--markdown", str(out)
    ],
    "gate --json": lambda other, out: [
        "gate", "--baseline", str(other), "--candidate", str(other), "--json", str(out)
    ],
    "export --out": lambda other, out: ["export", str(other), "--out", str(out)],
    "import --out": lambda other, out: ["import", str(VLLM_RESULT), "--out", str(out)],
    "report --out": lambda other, out: ["report", str(other), "--out", str(out)],
    "train-tiny --out": lambda other, out: ["train-tiny", "--steps", "1", "--out", str(out)],
    "gate ab --out": lambda other, out: [
        "gate", "ab", "--baseline", "", "--candidate", "engine.kv_cache=paged", "--out", str(out)
    ],
}  # fmt: skip


#: train-tiny knows no run folder: a new folder inside a run's profile/ replaces nothing there
CASES = [
    (writer, target)
    for writer in WRITERS
    for target in TARGETS
    if (writer, target) != ("train-tiny --out", "a new file in profile/")
]


@pytest.mark.parametrize(("writer", "target"), CASES)
def test_no_writer_writes_over_a_run_folders_own_file(
    imported_run: Path,
    run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    writer: str,
    target: str,
) -> None:
    """`gate --json RUN/summary.json` wrote the gate's result over the run's summary (the
    next gate said "not valid JSON"); `train-tiny --out RUN/summary.json` trained, then ended
    in a traceback; a run's file reached through a link was written over; `export --out
    RUN/app.log` replaced the run's log with the export."""
    (run / "profile").mkdir()
    (run / "app.log").write_text("[2026-01-01 00:00:00,000][harness][WARNING] - the run's log\n")
    before = snapshot(run)
    out = TARGETS[target](tmp_path, run)
    assert cli.main(WRITERS[writer](imported_run, out)) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "--out" in err or writer.split()[-1] in err
    assert snapshot(run) == before
    assert not (run / "profile" / "gate.json").exists()


def test_an_earlier_output_is_written_over(
    imported_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The other half of the rule: a file that is no run's own, such as the gate's JSON of an
    earlier gate, is replaced (as export replaces an earlier export)."""
    out = tmp_path / "gate.json"
    out.write_text("an earlier gate\n")
    gate = ["gate", "--baseline", str(imported_run), "--candidate", str(imported_run)]
    assert cli.main([*gate, "--json", str(out), "--markdown", str(tmp_path / "gate.md")]) == 2
    assert json.loads(out.read_text())["verdict"] == "inconclusive"
    assert (tmp_path / "gate.md").read_text().startswith("## inferlab gate: INCONCLUSIVE")


def test_report_never_writes_through_a_link_in_its_out_folder(
    imported_run: Path, run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A report.md (or figure) in --out that links to a run's summary.json was written
    through, replacing the summary with the report."""
    before = snapshot(run)
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.md").symlink_to(run / "summary.json")
    assert cli.main(["report", str(imported_run), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--out: " in err and "is a file of the run folder" in err
    assert snapshot(run) == before


#: the writers that write one file where the user says
FILE_WRITERS = ["gate --markdown", "gate --json", "export --out"]


@pytest.mark.parametrize("writer", FILE_WRITERS)
def test_a_fifo_nothing_reads_is_an_error_not_a_hang(
    imported_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], writer: str
) -> None:
    """`gate --json FIFO` (and --markdown, export --out) blocked for ever in open() when no
    process read the FIFO. (Should it block, a reader opened after 20 s lets the test end.)"""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    done = threading.Event()

    def unblock() -> None:
        if not done.wait(20):
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))

    watchdog = threading.Thread(target=unblock)
    watchdog.start()
    try:
        code = cli.main(WRITERS[writer](imported_run, fifo))
    finally:
        done.set()
        watchdog.join()
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    option = writer.split()[-1]
    assert f"{option}: {fifo}: a FIFO (named pipe) that no process reads" in err


@pytest.mark.parametrize("writer", FILE_WRITERS)
def test_a_pipe_with_a_reader_gets_the_output(
    imported_run: Path, tmp_path: Path, writer: str
) -> None:
    """What the FIFO check must keep working: `--json >(jq .)`, `--json /dev/stdout | ...`."""
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    # the read end is open before the writer starts (a reader opened in a thread might not be
    # yet); it reads in a thread, so output past the pipe's buffer is drained while written.
    # A write end of our own keeps it from reading end-of-file before the command writes.
    read_end = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(read_end, True)
    held_open = os.open(fifo, os.O_WRONLY)
    received: list[bytes] = []

    def drain() -> None:
        with os.fdopen(read_end, "rb") as pipe:
            received.append(pipe.read())

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        code = cli.main(WRITERS[writer](imported_run, fifo))
    finally:
        os.close(held_open)
    reader.join(timeout=30)
    # the gate of a run with itself is inconclusive (2); the export succeeds
    assert code == (2 if writer.startswith("gate") else 0)
    assert received and received[0].strip(), received


@pytest.mark.parametrize("writer", FILE_WRITERS)
def test_a_failed_write_names_the_option_and_the_file(
    imported_run: Path, capsys: pytest.CaptureFixture[str], writer: str
) -> None:
    """`gate --json /dev/full` said only `inferlab gate: error: No space left on device`."""
    assert cli.main(WRITERS[writer](imported_run, Path("/dev/full"))) == 2
    err = capsys.readouterr().err.strip()
    option = writer.split()[-1]
    assert f"{option}: /dev/full: cannot be written: No space left on device" in err


@pytest.mark.parametrize("name", ["report.md", "report.html", "latency_cdf.png"])
def test_a_fifo_in_the_report_folder_is_named_not_waited_on(
    imported_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str
) -> None:
    """`report --out DIR` whose report.md (or a figure) was a FIFO blocked for ever."""
    out = tmp_path / "report"
    out.mkdir()
    os.mkfifo(out / name)
    done = threading.Event()

    def unblock() -> None:  # should it block: a reader after 20 s lets the test end
        if not done.wait(20):
            os.close(os.open(out / name, os.O_RDONLY | os.O_NONBLOCK))

    watchdog = threading.Thread(target=unblock)
    watchdog.start()
    try:
        code = cli.main(["report", str(imported_run), "--out", str(out)])
    finally:
        done.set()
        watchdog.join()
    assert code == 2
    err = capsys.readouterr().err
    fifo = "is a FIFO (named pipe), not a regular file"
    assert err == f"inferlab report: --out: {out / name}: {fifo}\n"


@pytest.mark.parametrize("script", ["bench_server_ttft.py", "client_ceiling.py"])
def test_benchmark_scripts_refuse_a_bad_out_before_they_measure(run: Path, script: str) -> None:
    """scripts/bench_server_ttft.py --out RUN/summary.json measured for minutes, then wrote its
    JSON over the run's summary; --out "" (an unset variable) or a folder measured, then
    ended in a traceback. Each is refused before anything runs (argparse's exit 2)."""
    before = snapshot(run)
    script_path = Path(__file__).resolve().parents[2] / "scripts" / script
    for out, says in (
        (str(run / "summary.json"), f"--out: {run / 'summary.json'} is a file of the run folder"),
        ("", "--out: '' is invalid; allowed: a file's path"),
        (str(run), f"--out: {run} is a folder; allowed: a file's path"),
    ):
        done = subprocess.run(
            [sys.executable, str(script_path), "--out", out],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 2 and f"error: {says}" in done.stderr, done.stderr
    assert snapshot(run) == before


@pytest.mark.parametrize("writer", [w for w in WRITERS if w != "train-tiny --out"])
def test_an_empty_output_path_is_refused_not_read_as_none(
    imported_run: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    writer: str,
) -> None:
    """`gate --json "$OUT"` with OUT unset wrote no JSON and said nothing (the step after it
    found no file), and `report RUN --out ""` wrote the report into RUN; `export` and
    `import` already refused an empty --out. Every writer now refuses it, naming the option."""
    monkeypatch.chdir(tmp_path)
    before = snapshot(imported_run)
    argv = [arg if arg != "EMPTY" else "" for arg in WRITERS[writer](imported_run, Path("EMPTY"))]
    assert cli.main(argv) == 2
    option = writer.split()[-1]
    err = capsys.readouterr().err.strip()
    assert f"{option}: '' is invalid; allowed: " in err and err.count("\n") == 0, err
    assert snapshot(imported_run) == before and not any(tmp_path.iterdir())
