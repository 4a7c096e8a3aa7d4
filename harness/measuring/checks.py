"""Absolute checks on a run's metrics: `ttft_p99_s <= 2`, `slo_attainment >= 0.99`. One
definition for every place that asks whether a run met a bound: the capacity search's SLOs
(`run.search`), the gate's absolute checks, the report's "best configuration per SLO".

A check is written as a string `METRIC OP BOUND` (OP one of <=, <, >=, >) or, in a mapping,
`{METRIC: BOUND}`, where the metric's better direction gives the operator (lower: <=, higher:
>=). The metric must be a registered one (harness/measuring/metrics.py)."""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from harness.measuring.metrics import find_metric

_OPERATORS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le,
    "<": operator.lt,
    ">=": operator.ge,
    ">": operator.gt,
}
_FORM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(<=|>=|<|>)\s*(\S+)\s*$")


class CheckError(ValueError):
    """A check that cannot be read: its message names where it was given and what is allowed."""


@dataclass(frozen=True)
class Check:
    metric: str
    op: str  # one of _OPERATORS
    bound: float

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.bound:g}"

    def holds(self, metrics: Mapping[str, Any]) -> bool | None:
        """Whether the metrics meet it; None when the metric has no finite value there."""
        value = metrics.get(self.metric)
        if (
            not isinstance(value, int | float)
            or isinstance(value, bool)
            or not math.isfinite(value)
        ):
            return None
        return _OPERATORS[self.op](float(value), self.bound)

    @property
    def lower_is_better(self) -> bool:
        return self.op in ("<=", "<")


def _bound(value: Any, where: str) -> float:
    if isinstance(value, bool):  # YAML's `true` is no bound of 1
        raise CheckError(f"{where}: bound {value!r} is invalid; allowed: a finite number")
    try:
        bound = float(value)
    except (TypeError, ValueError, OverflowError):
        raise CheckError(f"{where}: bound {value!r} is invalid; allowed: a finite number") from None
    if not math.isfinite(bound):
        raise CheckError(f"{where}: bound {value!r} is invalid; allowed: a finite number")
    return bound


def _known(metric: str, where: str) -> str:
    found = find_metric(metric)
    if found is None:
        raise CheckError(
            f"{where}: {metric!r} is not a metric; allowed: a registered metric "
            "(docs/metrics.md), e.g. ttft_p99_s, tpot_p50_s, slo_attainment"
        )
    return metric


def parse_check(text: Any, where: str) -> Check:
    """One check from its string form `METRIC OP BOUND`."""
    if not isinstance(text, str) or not (match := _FORM.match(text)):
        raise CheckError(
            f"{where}: {text!r} is invalid; allowed: 'METRIC OP BOUND' with OP one of "
            f"{list(_OPERATORS)}, e.g. 'ttft_p99_s <= 2'"
        )
    metric, op, bound = match.groups()
    return Check(_known(metric, where), op, _bound(bound, where))


def from_metric_bound(metric: Any, bound: Any, where: str) -> Check:
    """The check `{metric: bound}` stands for: at most the bound for a lower-is-better metric,
    at least it for a higher-is-better one."""
    name = _known(str(metric), where)
    better = find_metric(name).better  # type: ignore[union-attr]
    if better == "none":
        raise CheckError(
            f"{where}: {name!r} has no better direction; allowed: write it as "
            f"'{name} <= BOUND' or '{name} >= BOUND'"
        )
    return Check(name, "<=" if better == "lower" else ">=", _bound(bound, f"{where}.{name}"))


def parse_checks(value: Any, where: str) -> tuple[Check, ...]:
    """Checks from a list of strings, a mapping {metric: bound}, or one string (None: none)."""
    if value is None:
        return ()
    if isinstance(value, str):
        return (parse_check(value, where),)
    if isinstance(value, Mapping):
        return tuple(from_metric_bound(k, v, where) for k, v in value.items())
    if isinstance(value, list | tuple):
        return tuple(parse_check(text, f"{where}[{i}]") for i, text in enumerate(value))
    raise CheckError(
        f"{where}: {value!r} is invalid; allowed: a list of 'METRIC OP BOUND' strings or a "
        "mapping {METRIC: BOUND}"
    )


def contradictions(checks: tuple[Check, ...]) -> list[str]:
    """Pairs of checks on one metric that no value can meet together (`x <= 1` and `x >= 2`)."""
    out = []
    for i, a in enumerate(checks):
        for b in checks[i + 1 :]:
            if a.metric != b.metric or a.lower_is_better == b.lower_is_better:
                continue
            upper, lower = (a, b) if a.lower_is_better else (b, a)
            strict = upper.op == "<" or lower.op == ">"
            if upper.bound < lower.bound or (strict and upper.bound == lower.bound):
                out.append(f"{upper} and {lower} cannot both hold")
    return out


def failed_checks(checks: tuple[Check, ...], metrics: Mapping[str, Any]) -> list[str]:
    """The checks `metrics` do not meet, each with the value it had (a missing value fails)."""
    out = []
    for check in checks:
        held = check.holds(metrics)
        if held is None:
            out.append(f"{check}: no value")
        elif not held:
            out.append(f"{check}: {metrics[check.metric]:.4g}")
    return out
