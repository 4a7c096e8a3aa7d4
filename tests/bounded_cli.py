"""`inferlab ...` in a child process that cannot hang or swamp the machine: for the tests that
hand it /dev/zero or a FIFO, where a regression would read for ever (until the OOM killer) or
block for ever. The child's address space is capped, so reading /dev/zero whole ends in a
MemoryError within seconds, and a FIFO that blocks ends at the timeout as a failed test.
`finishes_within` bounds a call in the test's own process the same way (in time only)."""

from __future__ import annotations

import resource
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
ADDRESS_SPACE_BYTES = 6 << 30  # torch's import alone maps about 1 GiB
TIMEOUT_S = 120  # the child's imports take seconds on a busy machine; a refusal, no more


def _cap_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_BYTES, ADDRESS_SPACE_BYTES))


def run_inferlab(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            [sys.executable, "-m", "harness.cli", *args],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            preexec_fn=_cap_memory,
            env=env,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"inferlab {' '.join(args)} did not end in {TIMEOUT_S} s (blocked reading?)")


def finishes_within(action: Callable[[], Any], seconds: float = 60.0) -> Any:
    """The action's exception (or None); the test fails, rather than hangs, if it blocks."""
    outcome: list[Any] = []

    def run() -> None:
        try:
            action()
            outcome.append(None)
        except Exception as exc:  # handed to the test, which checks it
            outcome.append(exc)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert outcome, f"still running after {seconds} s (reading a device or a FIFO?)"
    return outcome[0]
