"""The gate's absolute checks and its capacity comparison (docs/gate.md).

- `check_rows`: rules.checks ('slo_attainment >= 0.99') on every complete candidate run; a
  failed check is a regression naming the check and the value, a metric absent in a candidate
  run is inconclusive (as rules.metrics.require makes it).
- `capacity_rows`: a capacity search's answer (search.json in a sweep folder: the highest rate,
  or concurrency, that met its SLO) against the baseline's. A search only knows its answer to
  within its bracket (the highest load measured to meet the SLO, the lowest measured to miss
  it), so the candidate regressed only where its bracket lies wholly below the baseline's: it
  missed the SLO at a load below one where the baseline met it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harness.gating.inputs import Group, InputError, Side, is_number
from harness.gating.row import Row
from harness.measuring.checks import Check
from harness.run_folder import SEARCH_FILE, UnreadableFile, read_search_records

ANSWER_KEYS = {"rate": "max_rate_at_slo", "concurrency": "max_concurrency_at_slo"}


def check_rows(job: str, group: Group, checks: tuple[Check, ...], n_baseline: int) -> list[Row]:
    """One row per check over the group's complete candidate runs: the worst value among them
    (the highest for an upper bound, the lowest for a lower one)."""
    runs = group.complete
    rows = []
    for check in checks:
        values = [(run, run.metrics.get(check.metric)) for run in runs]
        absent = [run for run, v in values if not is_number(v) or not math.isfinite(v)]
        present = [float(v) for _, v in values if is_number(v) and math.isfinite(v)]
        worst = (max if check.lower_is_better else min)(present) if present else None
        row = Row(
            job=job,
            metric=check.metric,
            kind="check",
            baseline=None,
            candidate=worst,
            n_baseline=n_baseline,
            n_candidate=len(present),
            ratio=None,
            ci=None,
            verdict="pass",
            note=f"check {check}",
        )
        failed = [
            (run, float(v))
            for run, v in values
            if is_number(v) and math.isfinite(v) and check.holds({check.metric: v}) is False
        ]
        if failed:
            run, value = failed[0]
            row.verdict = "regression"
            row.note = f"check {check} failed: {value:.4g} in {run.path}" + (
                f" (and {len(failed) - 1} more run(s))" if len(failed) > 1 else ""
            )
        elif absent:
            row.verdict = "inconclusive"
            row.note = (
                f"check {check}: {check.metric} absent in {len(absent)} of {len(runs)} "
                f"candidate run(s), e.g. {absent[0].path / 'summary.json'}"
            )
        rows.append(row)
    return rows


def read_searches(side: Side) -> dict[str, dict[str, Any]]:
    """The side's capacity searches (search.json), keyed by their grid point ("" for a sweep of
    one search); one that cannot be read is an InputError naming it."""
    try:
        records = read_search_records(Path(side.path))
    except UnreadableFile as exc:
        raise InputError(str(exc)) from None
    out = {}
    for record in records:
        over = record.get("over", "rate")
        if over not in ANSWER_KEYS:
            raise InputError(
                f"{Path(side.path) / SEARCH_FILE}: over: {over!r} is invalid; allowed: "
                f"{'|'.join(ANSWER_KEYS)}"
            )
        out[_grid_label(record.get("grid"))] = record
    return out


def _grid_label(grid: Any) -> str:
    """A grid point as the row's job: its overrides (`engine.max_num_seqs=4`)."""
    if not isinstance(grid, Mapping):
        return ""
    return " ".join(f"{key}={value}" for key, value in sorted(grid.items()))


def _load(bracket: Any, end: str) -> float | None:
    point = bracket.get(end) if isinstance(bracket, Mapping) else None
    load = point.get("load") if isinstance(point, Mapping) else None
    return float(load) if is_number(load) and math.isfinite(load) else None


def capacity_rows(base: Side, cand: Side) -> list[Row]:
    """One capacity row per search (per grid point, when the sweep searched a grid) comparing
    the two sides' answers; none when neither side has a search."""
    bases, cands = read_searches(base), read_searches(cand)
    if len(bases) == 1 and len(cands) == 1:  # one search each: compared whatever their grids
        return [_capacity_row("", next(iter(bases.values())), next(iter(cands.values())))]
    points = sorted(set(bases) | set(cands))
    return [_capacity_row(point, bases.get(point), cands.get(point)) for point in points]


def _capacity_row(job: str, b: dict[str, Any] | None, c: dict[str, Any] | None) -> Row:
    given = b or c
    assert given is not None
    metric = ANSWER_KEYS[given.get("over", "rate")]
    row = Row(
        job=job,
        metric=metric,
        kind="capacity",
        baseline=None,
        candidate=None,
        n_baseline=0,
        n_candidate=0,
        ratio=None,
        ci=None,
        verdict="inconclusive",
    )
    if b is None or c is None:
        row.verdict, row.gates = "missing", False
        row.note = f"no {SEARCH_FILE} search in the {'baseline' if b is None else 'candidate'}"
        return row
    answers = {"baseline": _answer(b), "candidate": _answer(c)}
    row.baseline = float(answers["baseline"]) if is_number(answers["baseline"]) else None
    row.candidate = float(answers["candidate"]) if is_number(answers["candidate"]) else None
    row.n_baseline, row.n_candidate = (_runs(s.get("num_points")) for s in (b, c))
    if row.baseline and row.candidate is not None:
        row.ratio = row.candidate / row.baseline
    why = _not_comparable(b, c)
    if why:
        row.note = why
        return row
    # below_range: no load of the range met the SLO (the answer lies below its lowest load);
    # above_range: every load met it (the answer lies above its highest)
    base_meets = _load(b.get("bracket"), "meets")
    cand_misses = _load(c.get("bracket"), "misses")
    base_misses = _load(b.get("bracket"), "misses")
    cand_meets = _load(c.get("bracket"), "meets")
    if base_meets is not None and cand_misses is not None and cand_misses < base_meets:
        row.verdict = "regression"
        row.note = (
            f"the candidate missed its SLO at {cand_misses:g}, below {base_meets:g}, where "
            "the baseline met it (the brackets do not overlap)"
        )
    elif cand_meets is not None and base_misses is not None and cand_meets > base_misses:
        row.verdict = "improved"
        row.note = (
            f"the candidate met its SLO at {cand_meets:g}, above {base_misses:g}, where the "
            "baseline missed it"
        )
    elif (base_meets is None and b.get("outcome") != "below_range") or (
        cand_misses is None and c.get("outcome") != "above_range"
    ):
        row.note = "a search.json without its bracket (bracket.meets / bracket.misses loads)"
    else:
        row.verdict = "pass"
        row.note = (
            f"the brackets overlap (baseline {_span(b)}, candidate {_span(c)}): no change "
            "beyond the searches' resolution"
        )
    return row


def _runs(value: Any) -> int:
    """num_points as a count: 0 for anything but a finite number >= 0 (a damaged file's
    Infinity or NaN made int() raise)."""
    return int(value) if is_number(value) and math.isfinite(value) and value >= 0 else 0


def _answer(search: Mapping[str, Any]) -> Any:
    return search.get(ANSWER_KEYS[search.get("over", "rate")])


def _span(search: Mapping[str, Any]) -> str:
    low, high = _load(search.get("bracket"), "meets"), _load(search.get("bracket"), "misses")
    return f"[{'-' if low is None else f'{low:g}'}, {'-' if high is None else f'{high:g}'})"


def _not_comparable(b: Mapping[str, Any], c: Mapping[str, Any]) -> str | None:
    """Why the two searches cannot be compared (None: they can)."""
    for side, search in (("baseline", b), ("candidate", c)):
        if search.get("outcome") == "failed":
            return f"the {side}'s search failed: {search.get('note') or 'no answer'}"
        if search.get("outcome") not in ("found", "below_range", "above_range"):
            return (
                f"the {side}'s search.json outcome {search.get('outcome')!r} is invalid; "
                "allowed: found|below_range|above_range|failed"
            )
    if b.get("over", "rate") != c.get("over", "rate"):
        return (
            f"the baseline searched {b.get('over', 'rate')}, the candidate {c.get('over', 'rate')}"
        )
    if b.get("slo") != c.get("slo"):
        return f"the searches' SLOs differ: baseline {b.get('slo')}, candidate {c.get('slo')}"
    return None
