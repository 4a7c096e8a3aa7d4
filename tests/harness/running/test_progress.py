"""Run progress without a terminal: a line per phase and one every interval_s while requests
run; with progress off, nothing."""

from __future__ import annotations

import io

from harness.running.progress import RunProgress


def test_lines_without_a_terminal(monkeypatch) -> None:
    clock = iter([0.0, 1.0, 6.0, 7.0, 12.5])
    monkeypatch.setattr("harness.running.progress.time.monotonic", lambda: next(clock))
    out = io.StringIO()
    shown = RunProgress(True, interval_s=5.0, stream=out)
    shown.phase("loading")
    shown.start_requests(4)  # t = 0
    for _ in range(4):  # t = 1, 6, 7, 12.5: a line at 6 and at 12.5
        shown.request_done()
    shown.close()
    assert out.getvalue().splitlines() == [
        "loading",
        "running 4 requests",
        "requests 2/4 done, 6 s",
        "requests 4/4 done, 12 s",
    ]


def test_nothing_when_off() -> None:
    out = io.StringIO()
    shown = RunProgress(False, stream=out)
    shown.phase("loading")
    shown.start_requests(3)
    for _ in range(3):
        shown.request_done()
    shown.close()
    assert out.getvalue() == ""
