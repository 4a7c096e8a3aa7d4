"""The gate's comparison: baseline and candidate groups of runs -> one row per metric with a
verdict, and the overall verdict (docs/gate.md).

Deterministic counters (kind `deterministic` in the metric registry) are compared as values:
equal within a tight tolerance passes; worse in the registry's `better` direction is a
regression, better is an improvement; a change in a counter with no direction is `changed`
(a regression unless the rules say warn). Timing metrics are compared as ratios with a
bootstrap interval over runs (harness.gating.stats).

The gate never passes on nothing: a configuration where no gated metric has a value on both
sides gets an inconclusive `status` row, a gated metric present on one side only is a warning,
and a required metric (rules.metrics.require, --require-metric) absent anywhere is inconclusive.
"""

from __future__ import annotations

import json
import math
import reprlib
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from harness.gating.capacity import capacity_rows, check_rows
from harness.gating.inputs import Group, Run, Side, is_number
from harness.gating.row import Row
from harness.gating.rules import GateRules
from harness.gating.stats import RatioEstimate, bootstrap_paired, bootstrap_ratio, decide
from harness.measuring.metrics import REGISTRY

EXIT_CODES = {"pass": 0, "regression": 1, "inconclusive": 2}


@dataclass
class GateResult:
    rows: list[Row]
    warnings: list[str] = field(default_factory=list)
    paired: bool = False

    @property
    def verdict(self) -> str:
        outcomes = {row.outcome for row in self.rows}
        if "regression" in outcomes:
            return "regression"
        if "inconclusive" in outcomes or not any(row.compared for row in self.rows):
            return "inconclusive"  # a pass needs at least one metric compared
        return "pass"

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "exit_code": self.exit_code,
            "paired": self.paired,
            "warnings": self.warnings,
            "rows": [asdict(row) for row in self.rows],
        }


def _values(runs: Iterable[Run], metric: str) -> list[float]:
    return [float(run.metrics[metric]) for run in runs if is_number(run.metrics.get(metric))]


def _nonfinite(job: str, metric: str, kind: str, base: list[Run], cand: list[Run]) -> Row | None:
    """An inconclusive row when a run holds nan or inf for the metric: no comparison with it
    can mean anything (nan is neither worse nor better), and it must not read as a pass."""
    for side, runs in (("baseline", base), ("candidate", cand)):
        for run in runs:
            value = run.metrics.get(metric)
            if is_number(value) and not math.isfinite(value):
                return Row.unmeasured(
                    job,
                    metric,
                    kind,
                    len(_values(base, metric)),
                    len(_values(cand, metric)),
                    "inconclusive",
                    f"not a finite number ({value}) in {side} run {run.path}",
                )
    return None


def _equal(a: float, b: float, rel_tol: float, abs_tol: float) -> bool:
    return abs(a - b) <= abs_tol + rel_tol * abs(a)


def _varies(values: list[float], rel_tol: float, abs_tol: float) -> bool:
    return any(not _equal(values[0], v, rel_tol, abs_tol) for v in values[1:])


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _timing_row(
    job: str,
    metric: str,
    kind: str,
    base: list[float],
    cand: list[float],
    pairs: list[tuple[float, float]] | None,
    rules: GateRules,
    note: str = "",
) -> Row:
    better = REGISTRY[metric].better
    n_base, n_cand = (len(pairs), len(pairs)) if pairs is not None else (len(base), len(cand))
    row = Row.unmeasured(job, metric, kind, n_base, n_cand, "inconclusive", note)
    values = [v for pair in pairs for v in pair] if pairs is not None else base + cand
    if not n_base or not n_cand:
        row.verdict = "missing"
        row.note = "absent in " + ("baseline" if not n_base else "candidate")
        row.gates = False
        if pairs is None:  # the side that has it, for the reader (a geomean needs v > 0)
            row.baseline = _center(base, rules) if base and min(base) > 0 else None
            row.candidate = _center(cand, rules) if cand and min(cand) > 0 else None
        return row
    if any(v <= 0 for v in values):
        row.note = "non-positive values: no ratio"
        return row
    estimate: RatioEstimate
    if pairs is not None:
        estimate = bootstrap_paired([b / a for a, b in pairs], rules.bootstrap)
        base, cand = [a for a, _ in pairs], [b for _, b in pairs]
    else:
        estimate = bootstrap_ratio(base, cand, rules.bootstrap)
    row.baseline, row.candidate = _center(base, rules), _center(cand, rules)
    row.ratio, row.ci = estimate.ratio, (estimate.low, estimate.high)
    if better == "none":
        row.verdict, row.gates = "info", False
        return row
    verdict, why = decide(estimate, better, rules.min_effect_for(metric), rules.min_samples)
    if min(n_base, n_cand) < rules.min_samples:
        row.ci = None  # an interval from one or two runs would only look precise
    row.verdict = verdict
    row.note = "; ".join(x for x in (note, why) if x)
    return row


def _center(values: list[float], rules: GateRules) -> float:
    if rules.bootstrap.statistic == "median":
        return _median(values)
    product = 1.0
    for v in values:
        product *= v ** (1.0 / len(values))
    return product


def _counter_row(
    job: str,
    metric: str,
    base: list[float],
    cand: list[float],
    pairs: list[tuple[float, float]] | None,
    rules: GateRules,
) -> Row | None:
    if not base and not cand:
        return None
    better = REGISTRY[metric].better
    rel_tol, abs_tol = rules.tolerance_for(metric)
    if not base or not cand:
        return Row(
            job,
            metric,
            "deterministic",
            base[0] if base else None,
            cand[0] if cand else None,
            len(base),
            len(cand),
            None,
            None,
            "missing",
            "absent in " + ("baseline" if not base else "candidate"),
            gates=False,
        )
    if _varies(base, rel_tol, abs_tol) or _varies(cand, rel_tol, abs_tol):
        # Timing-dependent under this workload (e.g. steps under real-time arrivals): compare
        # it the way timings are compared rather than fail on noise.
        return _timing_row(
            job,
            metric,
            "deterministic",
            base,
            cand,
            pairs,
            rules,
            note="varies between runs: compared statistically",
        )
    b, c = base[0], cand[0]
    ratio = c / b if b else None
    row = Row(job, metric, "deterministic", b, c, len(base), len(cand), ratio, None, "pass")
    if _equal(b, c, rel_tol, abs_tol):
        return row
    if better == "none":
        row.verdict = "changed"
        row.gates = rules.neutral_change == "regression"
        row.note = "the runs did different work" if row.gates else "warning only"
    else:
        worse = c > b if better == "lower" else c < b
        row.verdict = "regression" if worse else "improved"
    return row


def _status_rows(job: str, base: Group, cand: Group, warnings: list[str]) -> list[Row]:
    rows = []
    for side, group in (("baseline", base), ("candidate", cand)):
        for run in group.runs:
            warnings += [f"{side} run: {note}" for note in run.notes]
            if run.status != "complete":
                warnings.append(
                    f"{side} run {run.path} is {run.status}"
                    f"{': ' + run.error if run.error else ''}; left out"
                )
    cand_failed = [r for r in cand.runs if r.status == "failed"]
    base_failed = [r for r in base.runs if r.status == "failed"]
    if cand_failed and not base_failed:
        failed = f"{len(cand_failed)} candidate run(s) failed: {cand_failed[0].error}"
        rows.append(_status(job, len(base.runs), len(cand.runs), "regression", failed))
    if not base.complete or not cand.complete:
        missing = "baseline" if not base.complete else "candidate"
        none_complete = f"no complete {missing} run"
        rows.append(
            _status(job, len(base.complete), len(cand.complete), "inconclusive", none_complete)
        )
    return rows


def _names(metrics: list[str], limit: int = 8) -> str:
    shown = ", ".join(metrics[:limit])
    return shown + (f" ... and {len(metrics) - limit} more" if len(metrics) > limit else "")


def _one_sided(job: str, metrics: tuple[str, ...], base: list[Run], cand: list[Run]) -> list[str]:
    """Warnings naming the gated metrics that one side has and the other lacks: their rows are
    `missing` and do not gate (unless required), so the warning says what went unchecked."""
    where = f"job {job}: " if job else ""
    has = {
        side: {m for m in metrics if _values(runs, m)}
        for side, runs in (("baseline", base), ("candidate", cand))
    }
    warnings = []
    for side, other in (("candidate", "baseline"), ("baseline", "candidate")):
        absent = [m for m in metrics if m in has[other] and m not in has[side]]
        if not absent:
            continue
        if not has[side]:
            warnings.append(
                f"{where}the {side} runs hold none of the gated metrics "
                f"({len(absent)} present in the {other}: {_names(absent)})"
            )
        else:
            warnings.append(
                f"{where}gated metric(s) absent in the {side}, present in the "
                f"{other}: {_names(absent)}"
            )
    return warnings


def _require(job: str, rows: list[Row], base: list[Run], cand: list[Run], rules: GateRules) -> None:
    """A required metric absent (or null) in any complete run of either side makes its row
    gate as inconclusive; a regression found in the runs that have it still stands."""
    for metric in rules.required_metrics:
        lacking = [
            (side, runs, [r for r in runs if not is_number(r.metrics.get(metric))])
            for side, runs in (("baseline", base), ("candidate", cand))
        ]
        found = next(((side, runs, bad) for side, runs, bad in lacking if bad), None)
        if found is None:
            continue
        side, runs, bad = found
        note = (
            f"absent in {len(bad)} of {len(runs)} {side} run(s), e.g. "
            f"{bad[0].path / 'summary.json'}"
        )
        row = next((r for r in rows if r.metric == metric), None)
        if row is None:
            kind = REGISTRY[metric].kind
            n_base, n_cand = len(_values(base, metric)), len(_values(cand, metric))
            rows.append(Row.unmeasured(job, metric, kind, n_base, n_cand, "missing", note))
        elif row.verdict == "missing":
            row.gates, row.note = True, note
        elif row.outcome != "regression":
            row.verdict, row.gates = "inconclusive", True
            row.note = "; ".join(x for x in (note, row.note) if x)


def _nothing_compared(
    job: str, rows: list[Row], base: list[Run], cand: list[Run], rules: GateRules
) -> Row | None:
    if any(row.compared for row in rows):
        return None
    gated = rules.deterministic_metrics + rules.timing_metrics
    empty = [
        side
        for side, runs in (("baseline", base), ("candidate", cand))
        if not any(_values(runs, m) for m in gated)
    ]
    why = {
        0: "",
        1: f" (the {' and '.join(empty)} runs hold none)",
        2: " (neither side holds any)",
    }[len(empty)]
    nothing = f"none of the {len(gated)} gated metrics has a value on both sides{why}"
    return _status(job, len(base), len(cand), "inconclusive", f"nothing compared: {nothing}")


def _status(job: str, n_baseline: int, n_candidate: int, verdict: str, note: str) -> Row:
    """The job's `status` row: a verdict on its runs, not on a metric."""
    return Row.unmeasured(job, "status", "status", n_baseline, n_candidate, verdict, note)


def compare_groups(
    job: str, base: Group, cand: Group, rules: GateRules, pairs: list[tuple[Run, Run]] | None = None
) -> tuple[list[Row], list[str]]:
    """Rows for one configuration; `pairs` (A/B rounds) switches timing to paired ratios."""
    warnings: list[str] = []
    rows = _status_rows(job, base, cand, warnings)
    if not base.complete or not cand.complete:
        return rows, warnings
    if pairs is not None:
        pairs = [(a, b) for a, b in pairs if a.status == "complete" and b.status == "complete"]

    def paired_values(metric: str) -> list[tuple[float, float]] | None:
        if pairs is None:
            return None
        out = []
        for a, b in pairs:
            va, vb = _values([a], metric), _values([b], metric)
            if va and vb:
                out.append((va[0], vb[0]))
        return out

    for metric in rules.deterministic_metrics:
        row = _nonfinite(job, metric, "deterministic", base.complete, cand.complete)
        if row is None:
            row = _counter_row(
                job,
                metric,
                _values(base.complete, metric),
                _values(cand.complete, metric),
                paired_values(metric),
                rules,
            )
        if row is not None:
            rows.append(row)
    for metric in rules.timing_metrics:
        base_values, cand_values = _values(base.complete, metric), _values(cand.complete, metric)
        row = _nonfinite(job, metric, "timing", base.complete, cand.complete)
        if row is not None:
            rows.append(row)
        elif base_values or cand_values:  # e.g. TPOT when every request makes one token
            rows.append(
                _timing_row(
                    job, metric, "timing", base_values, cand_values, paired_values(metric), rules
                )
            )
    gated = rules.deterministic_metrics + rules.timing_metrics
    warnings += _one_sided(job, gated, base.complete, cand.complete)
    _require(job, rows, base.complete, cand.complete, rules)
    nothing = _nothing_compared(job, rows, base.complete, cand.complete, rules)
    if nothing is not None:
        rows.append(nothing)
    return rows, warnings


def _plain(value: Any) -> Any:
    """A provenance field as a hashable value, whatever a damaged file holds there."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def machine_of(run: Run) -> tuple[Any, ...] | None:
    prov = run.provenance
    if not prov:
        return None
    cpu, gpu = prov.get("cpu"), prov.get("gpu")
    cpu, gpu = cpu if isinstance(cpu, dict) else {}, gpu if isinstance(gpu, dict) else {}
    return tuple(
        _plain(v)
        for v in (
            prov.get("hostname_hash"),
            cpu.get("model"),
            cpu.get("logical_cpus"),
            gpu.get("name"),
            gpu.get("count"),
            prov.get("torch_num_threads"),
        )
    )


def _describe_machines(machines: set[tuple[Any, ...]]) -> str:
    return "; ".join(
        f"host {m[0]}, cpu {m[1]} x{m[2]}, gpu {m[3] or 'none'}, torch threads {m[5]}"
        for m in sorted(machines, key=str)
    )


def machine_warnings(base: Side, cand: Side) -> list[str]:
    def machines(side: Side) -> set[tuple[Any, ...]]:
        found = {machine_of(run) for group in side.groups.values() for run in group.complete}
        return {m for m in found if m is not None}

    mb, mc = machines(base), machines(cand)
    if not mb or not mc or mb == mc:
        return []
    return [
        f"baseline and candidate ran on different machines (provenance.json): baseline "
        f"{_describe_machines(mb)}; candidate {_describe_machines(mc)}"
    ]


def unknown_machines(base: Side, cand: Side) -> list[str]:
    """Complete runs whose machine cannot be told (no readable provenance.json)."""
    return [
        str(run.path)
        for side in (base, cand)
        for group in side.groups.values()
        for run in group.complete
        if machine_of(run) is None
    ]


def apply_machine_rule(
    result: GateResult, rules: GateRules, different: bool, why: str = "different machines"
) -> None:
    """Under `different_machine: inconclusive`, timing verdicts across machines are void (and
    so are they when a run's machine is unknown: the rule could not be checked)."""
    if not different or rules.different_machine != "inconclusive":
        return
    for row in result.rows:
        if row.kind == "timing" and row.verdict in ("pass", "improved", "regression"):
            row.verdict = "inconclusive"
            row.note = f"{why} (rules.different_machine: inconclusive)"


_SHORT_REPR = reprlib.Repr()
_SHORT_REPR.maxlevel, _SHORT_REPR.maxlist, _SHORT_REPR.maxdict = 2, 4, 4
_SHORT_REPR.maxstring = _SHORT_REPR.maxother = 80


def config_differences(base: Side, cand: Side, limit: int = 8) -> list[str]:
    """The configuration keys that differ between the first runs of the two sides."""

    def first_config(side: Side) -> dict[str, Any] | None:
        for group in side.groups.values():
            for run in group.runs:
                if run.config is not None:
                    return run.config
        return None

    def flat(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in config.items():
            if isinstance(value, dict) and value:
                out.update(flat(value, f"{prefix}{key}."))
            else:
                out[f"{prefix}{key}"] = value
        return out

    a, b = first_config(base), first_config(cand)
    if a is None or b is None or len(base.groups) > 1:
        return []
    fa, fb = flat(a), flat(b)
    shown = _SHORT_REPR.repr  # bounded: a long list (or a YAML alias bomb) is not printed whole
    diffs = [
        f"{key}: {shown(fa.get(key))} -> {shown(fb.get(key))}"
        for key in sorted(set(fa) | set(fb))
        if fa.get(key) != fb.get(key)
    ]
    if len(diffs) > limit:
        diffs = [*diffs[:limit], f"... and {len(diffs) - limit} more"]
    return diffs


def unmatched_reasons(base: Side, cand: Side, ignore: set[str], limit: int = 5) -> list[str]:
    """Why no job of two sweeps matched: the override keys whose values differ between the
    sides, and the --ignore-override keys that neither sweep has (a typo)."""

    def values(side: Side) -> dict[str, set[str]]:
        found: dict[str, set[str]] = {}
        for group_key in side.groups:
            for item in group_key:
                key, _, value = item.partition("=")
                found.setdefault(key, set()).add(value)
        return found

    ours, theirs = values(base), values(cand)
    differ = [k for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k)]
    shown = [
        f"{k} (baseline {', '.join(sorted(ours.get(k, {'-'})))}; "
        f"candidate {', '.join(sorted(theirs.get(k, {'-'})))})"
        for k in differ[:limit]
    ]
    if len(differ) > limit:
        shown.append(f"and {len(differ) - limit} more")
    reasons = [f"they differ in {', '.join(shown)}"] if shown else []
    unused = sorted(ignore - base.override_keys - cand.override_keys)
    reasons += [f"--ignore-override {key} is no override of either sweep" for key in unused]
    return reasons


def compare_sides(
    base: Side,
    cand: Side,
    rules: GateRules,
    pairs: list[tuple[Run, Run]] | None = None,
    ignore: set[str] | None = None,
) -> GateResult:
    """Match groups (sweep jobs by their overrides) and compare each matched pair."""
    result = GateResult([], [*base.notes, *cand.notes], paired=pairs is not None)
    if (base.kind == "sweep") != (cand.kind == "sweep"):
        sweep, other = (
            ("baseline", "candidate") if base.kind == "sweep" else ("candidate", "baseline")
        )
        raise ValueError(
            f"the {sweep} is a sweep but the {other} is not: compare a sweep "
            "with a sweep, or pick one job folder of it"
        )
    matched = [key for key in base.groups if key in cand.groups]
    for key in base.groups:
        if key not in cand.groups:
            result.warnings.append(
                f"baseline job {base.groups[key].label} ({list(key)}) has "
                "no candidate job with the same overrides; skipped"
            )
    for key in cand.groups:
        if key not in base.groups:
            result.warnings.append(
                f"candidate job {cand.groups[key].label} ({list(key)}) "
                "has no baseline job with the same overrides; skipped"
            )
    capacity = capacity_rows(base, cand)
    if not matched and not capacity:
        raise ValueError(
            "no job of the baseline sweep matches a candidate job by its overrides"
            + "".join(f"; {why}" for why in unmatched_reasons(base, cand, ignore or set()))
            + " (--ignore-override KEY leaves a key out of the matching)"
        )
    for key in matched:
        job = " ".join(key) if base.kind == "sweep" else ""
        rows, warnings = compare_groups(job, base.groups[key], cand.groups[key], rules, pairs)
        result.rows += rows
        result.warnings += warnings
    # absolute checks hold for every candidate job, matched or not (a capacity search's
    # loads differ between the sides)
    for key, group in cand.groups.items():
        job = " ".join(key) if cand.kind == "sweep" else ""
        n_base = len(base.groups[key].complete) if key in base.groups else 0
        result.rows += check_rows(job, group, rules.checks, n_base)
    if not matched:
        result.warnings.append(
            "no job matches between the sides by its overrides: only the capacity "
            "searches (and rules.checks) are compared"
        )
    result.rows += capacity
    different = machine_warnings(base, cand)
    result.warnings += different
    apply_machine_rule(result, rules, bool(different))
    unknown = unknown_machines(base, cand)
    if unknown and rules.different_machine == "inconclusive":
        result.warnings.append(
            f"{len(unknown)} run(s) have no readable provenance.json (e.g. "
            f"{unknown[0]}): their machine is unknown"
        )
        apply_machine_rule(result, rules, True, "machine unknown")
    return result


def definition_warnings(base: Side, cand: Side, result: GateResult) -> list[str]:
    """The compared metrics that an imported run (`inferlab import`) says its tool defines
    differently from the lab (summary.json `definitions`, docs/interop.md): named, so that a
    ratio of two definitions is not read as a change of the system."""
    compared = {row.metric for row in result.rows if row.compared}
    warnings = []
    for role, side in (("baseline", base), ("candidate", cand)):
        names = sorted(
            {
                name
                for group in side.groups.values()
                for run in group.complete
                for name in run.defined_differently & compared
            }
        )
        if names:
            warnings.append(
                f"the {role} holds imported runs whose tool defines {', '.join(names)} "
                "differently from the lab (their summary.json definitions): those ratios "
                "compare two definitions"
            )
    return warnings
