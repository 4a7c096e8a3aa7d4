"""What the gate compares: one side (baseline or candidate) read from disk as groups of runs.

A side is any of (docs/gate.md):
- a run folder (summary.json): one run;
- a run folder holding repeats (repeat-0/, repeat-1/, ...): one run per repeat;
- a folder of run folders with no Hydra overrides (e.g. CI's runs/0, runs/1, ...): repeats;
- a sweep (job folders with .hydra/overrides.yaml, each a run or a run with repeats): one group
  per job, matched across sides by its overrides;
- an A/B folder (ab.json): the rounds' a runs for a baseline, b runs for a candidate.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

AB_FILE = "ab.json"
_REPEAT = re.compile(r"^repeat-(\d+)$")


class InputError(ValueError):
    """A folder the gate cannot read as a run, repeats, sweep or A/B folder."""


@dataclass
class Run:
    path: Path
    status: str
    error: str | None
    metrics: dict[str, Any]
    provenance: dict[str, Any] | None
    config: dict[str, Any] | None


@dataclass
class Group:
    """The runs of one configuration (one run, its repeats, or one side of an A/B folder)."""

    label: str
    runs: list[Run]

    @property
    def complete(self) -> list[Run]:
        return [r for r in self.runs if r.status == "complete"]


@dataclass
class Side:
    path: Path
    kind: str  # run | repeats | sweep | ab
    groups: dict[tuple[str, ...], Group]
    notes: list[str] = field(default_factory=list)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def read_run(path: Path) -> Run:
    summary = _read_json(path / "summary.json")
    if summary is None:
        return Run(path, "missing", f"no readable summary.json in {path}", {}, None, None)
    config = None
    if (path / "config.yaml").is_file():
        config = yaml.safe_load((path / "config.yaml").read_text())
    status = summary.get("status") or "missing"
    if status == "running":  # a run that never wrote its final summary was cut short
        status = "incomplete"
    return Run(path, status, summary.get("error"), dict(summary.get("metrics") or {}),
               _read_json(path / "provenance.json"), config)


def _repeat_dirs(path: Path) -> list[Path]:
    found = [(int(m.group(1)), p) for p in path.iterdir()
             if p.is_dir() and (m := _REPEAT.match(p.name))]
    return [p for _, p in sorted(found)]


def read_group(path: Path, label: str) -> Group:
    """A run folder as a group: its repeats if it holds any, else itself."""
    repeats = _repeat_dirs(path)
    if repeats:
        return Group(label, [read_run(p) for p in repeats])
    return Group(label, [read_run(path)])


def override_key(overrides: list[str], ignore: set[str]) -> tuple[str, ...]:
    """A job's identity across sweeps: its overrides, minus ignored keys, in a fixed order."""
    kept = []
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if key not in ignore:
            kept.append(f"{key}={override.partition('=')[2]}")
    return tuple(sorted(kept))


def _job_sort_key(path: Path) -> tuple[bool, int, str]:
    return (not path.name.isdigit(), int(path.name) if path.name.isdigit() else 0, path.name)


def load_ab_side(path: Path, role: str) -> Side:
    """One side of an A/B folder: role `a` (baseline) or `b` (candidate), in round order."""
    ab = _read_json(path / AB_FILE)
    if ab is None:
        raise InputError(f"{path}: no readable {AB_FILE}")
    runs = [read_run(path / entry[role]) for entry in ab.get("rounds", []) if entry.get(role)]
    return Side(path, "ab", {(): Group(f"{role} side of {path.name}", runs)})


def load_side(path: str | Path, role: str, ignore: set[str] | None = None) -> Side:
    """Read a baseline (`role='a'`) or candidate (`role='b'`) folder."""
    path = Path(path)
    ignore = ignore or set()
    if not path.is_dir():
        raise InputError(f"{path}: not a folder")
    if (path / AB_FILE).is_file():
        return load_ab_side(path, role)
    if (path / "summary.json").is_file():
        group = read_group(path, path.name)
        kind = "repeats" if len(group.runs) > 1 or _repeat_dirs(path) else "run"
        return Side(path, kind, {(): group})
    children = sorted((p for p in path.iterdir() if p.is_dir()
                       and ((p / "summary.json").is_file() or _repeat_dirs(p))),
                      key=_job_sort_key)
    jobs = [p for p in children if (p / ".hydra" / "overrides.yaml").is_file()]
    if jobs:
        side = Side(path, "sweep", {})
        for job in jobs:
            overrides = yaml.safe_load((job / ".hydra" / "overrides.yaml").read_text()) or []
            key = override_key([str(o) for o in overrides], ignore)
            if key in side.groups:
                side.notes.append(f"{path}: jobs {side.groups[key].label} and {job.name} have "
                                  f"the same overrides {list(key)}; using the first")
                continue
            side.groups[key] = read_group(job, job.name)
        return side
    if children:
        runs = [run for child in children for run in read_group(child, child.name).runs]
        return Side(path, "repeats", {(): Group(path.name, runs)})
    raise InputError(f"{path}: not a run folder (summary.json), a run with repeats "
                     "(repeat-k/), a folder of runs, a sweep (job folders with "
                     f".hydra/overrides.yaml) or an A/B folder ({AB_FILE})")
