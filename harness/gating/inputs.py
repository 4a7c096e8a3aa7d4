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

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeGuard

from harness.measuring.metrics import REGISTRY
from harness.run_folder import (
    AB_FILE,
    CONFIG_FILE,
    HOW_TO_RUN_KEYS,
    PROVENANCE_FILE,
    REPEAT_DIR,
    SUMMARY_FILE,
    UnreadableFile,
    has_summary,
    is_sweep_job,
    json_kind,
    read_json_object,
    read_overrides,
    read_yaml,
    short_json,
)


class InputError(UnreadableFile):
    """A folder the gate cannot read as a run, repeats, sweep or A/B folder, or a file in it
    that is not what the harness writes."""


@dataclass
class Run:
    path: Path
    status: str
    error: str | None
    metrics: dict[str, Any]
    provenance: dict[str, Any] | None
    config: dict[str, Any] | None
    notes: list[str] = field(default_factory=list)  # optional files that could not be used
    # metrics an imported run (inferlab import) says another tool defines differently from the
    # lab (summary.json definitions, same_as_lab false)
    defined_differently: set[str] = field(default_factory=set)


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
    # a sweep's override keys as its jobs give them, the ignored ones included
    override_keys: set[str] = field(default_factory=set)


def is_number(value: Any) -> TypeGuard[int | float]:
    """A metric value the gate can compare: an int or float (finite or not), never a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _metrics(summary: dict[str, Any], path: Path) -> dict[str, Any]:
    """summary.json's `metrics`: absent or null reads as no metrics (the comparison then says
    so); anything but a mapping of registry names to numbers or null is an error."""
    metrics = summary.get("metrics")
    if metrics is None:
        return {}
    if not isinstance(metrics, dict):
        raise InputError(
            f"{path}: `metrics` must be an object of metric names to numbers, "
            f"got {json_kind(metrics)}"
        )
    out = dict(metrics)
    for name, value in metrics.items():
        if name not in REGISTRY or value is None:
            continue
        if not is_number(value):
            raise InputError(
                f"{path}: metrics.{name}: {short_json(value)} is not a number "
                "(allowed: a number or null)"
            )
        try:
            out[name] = float(value)  # JSON integers have no bound; the comparison needs floats
        except OverflowError as exc:
            raise InputError(
                f"{path}: metrics.{name}: an integer of {len(str(value))} digits is out of range"
            ) from exc
    return out


def _optional_mapping(
    path: Path, notes: list[str], reader: Callable[[Path], Any]
) -> dict[str, Any] | None:
    """provenance.json and config.yaml only inform warnings: a damaged one is a note (the
    check it feeds is skipped for this run), not a reason to refuse the comparison."""
    if not path.exists():
        return None
    try:
        value = reader(path)
    except UnreadableFile as exc:
        notes.append(f"{exc}; not used")
        return None
    if not isinstance(value, dict):
        notes.append(f"{path}: expected a mapping, got {json_kind(value)}; not used")
        return None
    return value


def read_run(path: Path) -> Run:
    summary_path = path / SUMMARY_FILE
    if not summary_path.exists():  # a run cut short before its first summary: left out
        return Run(path, "missing", f"no summary.json in {path}", {}, None, None)
    summary = read_json_object(summary_path)
    status = summary.get("status")
    if status is not None and not isinstance(status, str):
        raise InputError(
            f"{summary_path}: `status` must be a string such as 'complete', got {json_kind(status)}"
        )
    status = status or "missing"
    if status == "running":  # a run that never wrote its final summary was cut short
        status = "incomplete"
    error = summary.get("error")
    notes: list[str] = []
    metrics = _metrics(summary, summary_path)
    if status == "complete" and not any(name in REGISTRY for name in metrics):
        held = (
            "absent"
            if "metrics" not in summary
            else "null"
            if summary["metrics"] is None
            else "empty"
            if not metrics
            else "without any registry metric"
        )
        notes.append(f"{summary_path}: status complete but `metrics` is {held}")
    provenance = _optional_mapping(path / PROVENANCE_FILE, notes, read_json_object)
    config = _optional_mapping(path / CONFIG_FILE, notes, read_yaml)
    definitions = summary.get("definitions")
    differently = {
        name
        for name, definition in (definitions.items() if isinstance(definitions, dict) else ())
        if isinstance(definition, dict) and definition.get("same_as_lab") is False
    }
    return Run(
        path,
        status,
        None if error is None else str(error),
        metrics,
        provenance,
        config,
        notes,
        differently,
    )


def _repeat_dirs(path: Path) -> list[Path]:
    found = [
        (int(m.group(1)), p)
        for p in path.iterdir()
        if p.is_dir() and (m := REPEAT_DIR.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def read_group(path: Path, label: str) -> Group:
    """A run folder as a group: its repeats if it holds any, else itself."""
    repeats = _repeat_dirs(path)
    if repeats:
        return Group(label, [read_run(p) for p in repeats])
    return Group(label, [read_run(path)])


def override_key(overrides: list[str], ignore: set[str]) -> tuple[str, ...]:
    """A job's identity across sweeps: its overrides, minus ignored keys and those that only
    say how to run (a job resumed with run.resume=true is the job the other side ran), in a
    fixed order."""
    kept = []
    for override in overrides:
        key = override.partition("=")[0].lstrip("+~")
        if key not in ignore and key not in HOW_TO_RUN_KEYS:
            kept.append(f"{key}={override.partition('=')[2]}")
    return tuple(sorted(kept))


def _job_sort_key(path: Path) -> tuple[bool, int, str]:
    return (not path.name.isdigit(), int(path.name) if path.name.isdigit() else 0, path.name)


def _round_dir(value: Any, where: str) -> str | None:
    """A round's run folder name: a plain name inside the A/B folder, as `gate ab` writes
    (never a path that leads out of it)."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or value in (".", "..") or "/" in value or "\\" in value:
        raise InputError(
            f"{where}: {short_json(value)} is invalid; allowed: the name of a run "
            "folder inside the A/B folder (e.g. 'round-0-a')"
        )
    return value


def ab_rounds(path: Path) -> list[dict[str, Any]]:
    """The measured rounds of an A/B folder's ab.json, checked: a list of objects whose `a` and
    `b` name run folders inside `path`."""
    ab_path = path / AB_FILE
    ab = read_json_object(ab_path)
    rounds = ab.get("rounds", [])
    if not isinstance(rounds, list):
        raise InputError(f"{ab_path}: `rounds` must be a list of rounds, got {json_kind(rounds)}")
    out = []
    for k, entry in enumerate(rounds):
        if not isinstance(entry, dict):
            raise InputError(
                f"{ab_path}: rounds[{k}] must be an object with `a` and `b`, got {json_kind(entry)}"
            )
        names = {
            role: _round_dir(entry.get(role), f"{ab_path}: rounds[{k}].{role}")
            for role in ("a", "b")
        }
        out.append({**entry, **names})
    return out


def load_ab_side(path: Path, role: str) -> Side:
    """One side of an A/B folder: role `a` (baseline) or `b` (candidate), in round order."""
    runs = [read_run(path / entry[role]) for entry in ab_rounds(path) if entry[role]]
    return Side(path, "ab", {(): Group(f"{role} side of {path.name}", runs)})


def _is_run_or_repeats(path: Path) -> bool:
    return has_summary(path) or bool(_repeat_dirs(path))


def load_side(path: str | Path, role: str, ignore: set[str] | None = None) -> Side:
    """Read a baseline (`role='a'`) or candidate (`role='b'`) folder."""
    path = Path(path)
    ignore = ignore or set()
    if not path.is_dir():
        raise InputError(f"{path}: {'not a folder' if path.exists() else 'no such folder'}")
    if (path / AB_FILE).exists():
        return load_ab_side(path, role)
    if has_summary(path):
        group = read_group(path, path.name)
        kind = "repeats" if len(group.runs) > 1 or _repeat_dirs(path) else "run"
        return Side(path, kind, {(): group})
    children = sorted(
        (p for p in path.iterdir() if p.is_dir() and _is_run_or_repeats(p)), key=_job_sort_key
    )
    jobs = [p for p in children if is_sweep_job(p)]
    if jobs:
        side = Side(path, "sweep", {})
        for job in jobs:
            overrides = read_overrides(job)
            side.override_keys |= {o.partition("=")[0].lstrip("+~") for o in overrides}
            key = override_key(overrides, ignore)
            if key in side.groups:
                side.notes.append(
                    f"{path}: jobs {side.groups[key].label} and {job.name} have "
                    f"the same overrides {list(key)}; using the first"
                )
                continue
            side.groups[key] = read_group(job, job.name)
        return side
    if children:
        runs = [run for child in children for run in read_group(child, child.name).runs]
        return Side(path, "repeats", {(): Group(path.name, runs)})
    raise InputError(
        f"{path}: not a run folder (summary.json), a run with repeats "
        "(repeat-k/), a folder of runs, a sweep (job folders with "
        f".hydra/overrides.yaml) or an A/B folder ({AB_FILE})"
    )
