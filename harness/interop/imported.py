"""One benchmark read from another tool's files, in the lab's terms: metrics under registry
names and units, each with its Definition (where it came from, and whether the source computes
it as the lab does), per-request rows in the lab's `requests` columns, and what the file says
about the workload and target. Tool-neutral: every importer builds these, one writer writes
them (write.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from harness.interop.errors import InteropError
from harness.measuring.metrics import REGISTRY

#: The Definition.source of a metric the lab computed itself from the file's per-request rows.
FROM_REQUESTS = "per-request rows (recomputed by the lab)"
#: Units whose values are whole numbers (stored as integers, as the lab's own runs store them).
INTEGER_UNITS = frozenset({"count", "tokens"})
#: Metrics that may be below 0: a request sent before its scheduled arrival (a tool's clock
#: jitter) is early, not bad input.
MAY_BE_NEGATIVE = frozenset({"send_lateness_p99_s"})


@dataclass(frozen=True)
class Definition:
    """How one imported metric was obtained: `source` is the source file's key (or
    FROM_REQUESTS), `same_as_lab` whether it measures what the lab's metric of that name
    measures, the same way (docs/metrics.md), and `note` what differs or what to know."""

    source: str
    same_as_lab: bool
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "same_as_lab": self.same_as_lab, "note": self.note}


@dataclass
class ImportedRun:
    tool: str  # vllm | guidellm | aiperf | genai-perf | llmperf
    format: str  # the kind of file, in words (e.g. "vllm bench serve --save-result JSON")
    files: list[Path]
    tool_version: str | None = None
    label: str | None = None  # which of the file's benchmarks, when it holds several
    status: str = "complete"  # or "incomplete" (the tool says it was cancelled)
    error: str | None = None
    metrics: dict[str, float | int] = field(default_factory=dict)
    definitions: dict[str, Definition] = field(default_factory=dict)
    unmapped: list[str] = field(default_factory=list)  # source metrics the lab has no name for
    # source metrics not used because the metric already had a value (recomputed from rows)
    superseded: list[str] = field(default_factory=list)
    requests: pd.DataFrame | None = None  # the lab's `requests` columns
    # the file the per-request rows came from, when it is not files[0] (LLMPerf's individual
    # responses and AIPerf's records beside the summary given): errors about a row name it
    rows_file: Path | None = None
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # per-request values the import could not use, by the file's field: {field: requests};
    # each also a warning (printed on stderr) saying how many, which field, why, and what the
    # import did instead
    unusable_values: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def put(self, metric: str, value: Any, definition: Definition) -> bool:
        """Record `metric` (a registry name, in the registry's unit) unless it already has a
        value: importers put the figures they trust most first (the lab's own computation over
        per-request rows), then fill the rest from the file's aggregates. A missing, null or
        non-finite value is left absent, never stored as 0. A value for a metric that already
        has one is not used; its source is listed in `superseded`. True when recorded.

        A negative value is bad input (every figure an import records is a time, a count, a
        rate or a fraction): an InteropError naming the file and the value's source, not a
        negative latency or count in summary.json."""
        if metric not in REGISTRY:
            raise AssertionError(f"{metric!r} is not a registered metric")
        if value is None:
            return False
        if metric in self.metrics:
            if definition.source != self.definitions[metric].source:
                self.superseded.append(definition.source)
            return False
        number = float(value)
        if not math.isfinite(number):
            return False
        if number < 0 and metric not in MAY_BE_NEGATIVE:
            raise InteropError(
                f"{self.files[0]}: {definition.source}: gives {metric} = {number:g}; a "
                f"negative {REGISTRY[metric].unit} value is not a measurement"
            )
        self.metrics[metric] = (
            int(number)
            if REGISTRY[metric].unit in INTEGER_UNITS and number.is_integer()
            else number
        )
        self.definitions[metric] = definition
        return True

    def warn_unusable(self, source_field: str, count: int, why: str) -> None:
        """`count` requests whose `source_field` held no usable value (`why`: what it held and
        what the import did instead), counted in summary.json and said on stderr."""
        self.unusable_values[source_field] = self.unusable_values.get(source_field, 0) + count
        self.warnings.append(f"{self.rows_source}: {count} request(s): '{source_field}' {why}")

    @property
    def rows_source(self) -> Path:
        """The file the per-request rows were read from."""
        return self.rows_file or self.files[0]

    def leave_out(self, *source_keys: str) -> None:
        """Source metrics the lab has no counterpart for (listed in summary.json `unmapped`)."""
        for key in source_keys:
            if key not in self.unmapped:
                self.unmapped.append(key)
