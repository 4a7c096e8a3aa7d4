"""What watches a run beside its request and step rows: a `Tracker`. The monitor
(monitors.py: samples.parquet, with a server's /metrics and a dcgm-exporter among its sources),
the profiler (profiling.py: profile/) and the quality probe (quality.py) are trackers; the run
(harness/running/experiment.py) lists them in one place, `_trackers`, and calls their hooks from
its phases, in that order, each hook guarded so that a tracker that fails never loses the run's
summary.

A tracker overrides only the hooks it needs; `engine` is the backend's describe() after load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engines.base import Backend


class Tracker:
    """The hooks, in the order a run calls them."""

    name = "tracker"  # names its failures in summary.json's finalize_errors

    def loaded(self, backend: Backend, engine: dict[str, Any]) -> None:
        """Phase load: the engine is loaded and the hardware probed (before any warm-up)."""

    def start(self, backend: Backend, engine: dict[str, Any]) -> None:
        """Phase measure: the measured requests start now (after the warm-up)."""

    def stop(self, backend: Backend, engine: dict[str, Any]) -> None:
        """Phase measure: every measured request has ended and the backend did not fail. An
        exception here fails the run (as a failed request of the probe would)."""

    def close(self) -> None:
        """Phase finish, always (also after a failure or Ctrl-C), before the backend closes:
        stop threads and profilers; safe to call when nothing was started. An OSError fails
        the run: what it wrote is torn."""

    def results(self, run_dir: Path, t0_ns: int | None) -> dict[str, Any]:
        """Phase finish, after the run's tables are written: write its own files (`t0_ns`: the
        measured run's time origin, None when it never started) and return the keys it adds to
        the run's info (summary.json). An OSError fails the run."""
        return {}
