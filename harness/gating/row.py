"""One row of the gate's table: a metric (or a status, a check, a capacity search) compared
between the baseline and the candidate, with its verdict."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Row:
    job: str
    metric: str
    kind: str  # deterministic | timing | status | check | capacity
    baseline: float | None
    candidate: float | None
    n_baseline: int
    n_candidate: int
    ratio: float | None
    ci: tuple[float, float] | None
    verdict: str  # pass | improved | regression | inconclusive | changed | missing | info
    note: str = ""
    gates: bool = True  # counts towards the overall verdict

    @classmethod
    def unmeasured(
        cls,
        job: str,
        metric: str,
        kind: str,
        n_baseline: int,
        n_candidate: int,
        verdict: str,
        note: str,
    ) -> Row:
        """A row with no values to show: a status row, or a metric that could not be compared."""
        return cls(
            job, metric, kind, None, None, n_baseline, n_candidate, None, None, verdict, note
        )

    @property
    def outcome(self) -> str:
        """What the row means for the exit code: pass, regression or inconclusive (a gating
        `missing` row is a required metric that is absent)."""
        if not self.gates or self.verdict in ("pass", "improved", "info"):
            return "pass"
        if self.verdict in ("regression", "changed"):
            return "regression"
        return "inconclusive"

    @property
    def compared(self) -> bool:
        """A gated metric with values on both sides (whatever the verdict)."""
        return self.kind != "status" and self.gates and self.verdict != "missing"
