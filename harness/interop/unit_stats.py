"""The metric records NVIDIA's benchmark clients export, shared by AIPerf and genai-perf:
`{"unit": "ms", "avg": ..., "p50": ..., "min": ..., ...}` per metric in their JSON, and the same
statistics as a CSV table (`Metric,avg,min,max,...` with one row per metric named
`Display Name (unit)`, a blank row, then `Metric,Value` for single values)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from harness.interop.errors import InteropError
from harness.interop.imported import Definition, ImportedRun
from harness.interop.sources import csv_sections, describe
from harness.measuring.metrics import find_metric, percentile_stat

SECONDS_PER_UNIT = {"ns": 1e-9, "us": 1e-6, "ms": 1e-3, "s": 1.0, "sec": 1.0}
# `Name (unit)`: a unit is a word or words over slashes (ms, tokens/sec/user, %) or genai-perf's
# `per sec`; other parentheses are part of the name (`Completed Requests (Success + Error)`)
DISPLAY = re.compile(r"^(?P<name>.*?)(?: \((?P<unit>[A-Za-z%]+(?:/[A-Za-z]+)*|per [a-z]+)\))?$")
#: display names whose tag is not the name itself (AIPerf's totals)
TAG_ALIASES = {
    "total_input_sequence_length": "total_isl",
    "total_output_sequence_length": "total_osl",
    "completed_requests_success_error": "completed_request_count",
}


class Stat(BaseModel):
    """One exported metric: its unit and statistics (avg, min, max, std, pNN...)."""

    model_config = ConfigDict(extra="allow")

    unit: str = ""
    avg: float | str | None = None

    def get(self, stat: str) -> float | None:
        """`avg` for the mean, else the statistic of that name (p50, p99, min...), if any."""
        value = self.avg if stat in ("avg", "mean") else (self.model_extra or {}).get(stat)
        if isinstance(value, str):  # older genai-perf versions wrote numbers as strings
            try:
                value = float(value)
            except ValueError:
                return None
        return float(value) if isinstance(value, int | float) else None

    def seconds_per_unit(self, tag: str, path: Path) -> float:
        try:
            return SECONDS_PER_UNIT[self.unit]
        except KeyError:
            raise InteropError(
                f"{path}: '{tag}' has unit {self.unit!r}; the lab reads times in "
                f"{'|'.join(SECONDS_PER_UNIT)}"
            ) from None


def stats_from_json(data: dict[str, Any], path: Path) -> dict[str, Stat]:
    """Every `{unit, avg, ...}` record of an export JSON, by metric tag."""
    stats = {}
    for tag, value in data.items():
        if isinstance(value, dict) and "unit" in value:
            try:
                stats[tag] = Stat.model_validate(value)
            except ValidationError as exc:
                raise InteropError(f"{path}: metric '{tag}': {describe(exc)}") from exc
    return stats


def _number(cell: str, path: Path, where: str) -> float | None:
    text = cell.replace(",", "")  # genai-perf writes thousands separators (f"{v:,.2f}")
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise InteropError(f"{path}: {where}: {cell!r} is not a number") from None


def tag_of(display: str) -> tuple[str, str]:
    """`Time to First Token (ms)` -> (time_to_first_token, ms)."""
    match = DISPLAY.match(display.strip())
    assert match is not None  # the pattern matches any text
    name = re.sub(r"[^a-z0-9]+", "_", match["name"].lower()).strip("_")
    return TAG_ALIASES.get(name, name), match["unit"] or ""


def stats_from_csv(text: str, path: Path) -> dict[str, Stat]:
    """Every row of an export CSV's tables, by metric tag (values as written: rounded to the
    two decimals the CSV keeps)."""
    stats: dict[str, Stat] = {}
    for section in csv_sections(path, text):
        header = section[0]
        if not header or header[0] != "Metric" or len(header) < 2:
            raise InteropError(
                f"{path}: a CSV table starts with {header[:3]}; expected a header row "
                "'Metric,...' (AIPerf's or genai-perf's CSV export)"
            )
        names = ["avg" if h == "Value" else h for h in header[1:]]
        for row in section[1:]:
            tag, unit = tag_of(row[0])
            values = {
                name: _number(cell, path, f"{row[0]}, {name}")
                for name, cell in zip(names, row[1:], strict=False)
            }
            stats[tag] = Stat.model_validate({"unit": unit, **values})
    if not stats:
        raise InteropError(f"{path}: no metric rows in the CSV")
    return stats


def put_stat(
    run: ImportedRun,
    stats: dict[str, Stat],
    tag: str,
    lab: str,
    *,
    same: bool,
    note: str,
    path: Path,
    time: bool = True,
) -> None:
    """Every statistic of `tag` the lab has a metric for under the prefix `lab` (mean, std,
    max, p1 ... p99, as the record holds them; times converted to seconds). Both tools' std is
    numpy's (ddof=0), as the lab's."""
    stat = stats.get(tag)
    if stat is None:
        return
    scale = stat.seconds_per_unit(tag, path) if time else 1.0
    for word in ("avg", *(stat.model_extra or {})):
        match = re.fullmatch(r"p(\d+(?:\.\d+)?)", word)
        which = "mean" if word == "avg" else percentile_stat(float(match[1])) if match else word
        name = f"{lab}_{which}_s"
        if find_metric(name) is None:
            continue
        value = stat.get(word)
        run.put(
            name, None if value is None else value * scale, Definition(f"{tag}.{word}", same, note)
        )


def value_of(stats: dict[str, Stat], tag: str) -> float | None:
    """A single-valued record's value (its avg)."""
    stat = stats.get(tag)
    return None if stat is None else stat.get("avg")
