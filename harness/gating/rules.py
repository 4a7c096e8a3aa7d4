"""The gate's rules: configs/gate/default.yaml merged with an optional user file, validated
once. Every error names the field (`rules.timing.min_effect`) and what it may be."""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from configs import CONFIG_DIR
from harness.gating.stats import STATISTICS, BootstrapSettings
from harness.measuring.checks import Check, CheckError, contradictions, parse_checks
from harness.measuring.metrics import REGISTRY, SWEEP_ANSWERS
from models.files import SETTINGS, UserFileError, read_input_bytes

DEFAULT_RULES = CONFIG_DIR / "gate" / "default.yaml"
NEUTRAL_CHANGE = ("regression", "warn")
DIFFERENT_MACHINE = ("warn", "inconclusive")
# A bound on memory, not on precision: the bootstrap holds resamples x runs indices and values
# per side (10^6 resamples of 10 runs: about 320 MB); the default 10^4 is plenty.
MAX_RESAMPLES = 1_000_000
_SCHEMA: dict[str, Any] = {
    "metrics": {"timing": None, "deterministic": None, "exclude": None, "require": None},
    "timing": {
        "statistic": None,
        "min_effect": None,
        "confidence": None,
        "resamples": None,
        "min_samples": None,
        "seed": None,
    },
    "deterministic": {"rel_tol": None, "abs_tol": None, "neutral_change": None},
    "different_machine": None,
    "per_metric": None,
    "checks": None,
}


class RulesError(ValueError):
    """A rules file has a field the gate cannot use."""


@dataclass(frozen=True)
class GateRules:
    timing_metrics: tuple[str, ...]
    deterministic_metrics: tuple[str, ...]
    bootstrap: BootstrapSettings
    min_effect: float
    min_samples: int
    rel_tol: float
    abs_tol: float
    neutral_change: str
    different_machine: str
    per_metric: dict[str, dict[str, float]] = field(default_factory=dict)
    required_metrics: tuple[str, ...] = ()  # absent on either side: inconclusive (exit 2)
    # absolute bounds every complete candidate run must meet (`ttft_p99_s <= 2`), whatever
    # the baseline did: a failed one is a regression, a metric absent is inconclusive
    checks: tuple[Check, ...] = ()

    def min_effect_for(self, metric: str) -> float:
        return self.per_metric.get(metric, {}).get("min_effect", self.min_effect)

    def tolerance_for(self, metric: str) -> tuple[float, float]:
        own = self.per_metric.get(metric, {})
        return own.get("rel_tol", self.rel_tol), own.get("abs_tol", self.abs_tol)

    def to_dict(self) -> dict[str, Any]:
        return {
            "metrics": {
                "timing": list(self.timing_metrics),
                "deterministic": list(self.deterministic_metrics),
                "require": list(self.required_metrics),
            },
            "timing": {
                "statistic": self.bootstrap.statistic,
                "min_effect": self.min_effect,
                "confidence": self.bootstrap.confidence,
                "resamples": self.bootstrap.resamples,
                "min_samples": self.min_samples,
                "seed": self.bootstrap.seed,
            },
            "deterministic": {
                "rel_tol": self.rel_tol,
                "abs_tol": self.abs_tol,
                "neutral_change": self.neutral_change,
            },
            "different_machine": self.different_machine,
            "per_metric": self.per_metric,
            "checks": [str(check) for check in self.checks],
        }


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict) and key != "per_metric":
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _check_keys(values: Any, schema: dict[str, Any], where: str) -> None:
    if not isinstance(values, dict):
        raise RulesError(f"{where}: expected a mapping with keys {sorted(schema)}, got {values!r}")
    unknown = sorted(set(values) - set(schema))
    if unknown:
        raise RulesError(f"{where}: unknown key(s) {unknown}; allowed: {sorted(schema)}")
    for key, sub in schema.items():
        if sub is not None and key in values:
            _check_keys(values[key], sub, f"{where}.{key}")


def _number(
    value: Any,
    where: str,
    low: float,
    high: float | None = None,
    low_open: bool = False,
    high_open: bool = False,
) -> float:
    # nan fails every comparison below; inf is refused by name (an infinite tolerance would
    # make every counter equal: a check that cannot fail)
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (
            high is None or (value < high if high_open else value <= high)
        )
    if not ok:
        left, right = "(" if low_open else "[", ")" if high_open or high is None else "]"
        raise RulesError(
            f"{where}: {value!r} is invalid; allowed: a number in "
            f"{left}{low}, {'inf' if high is None else high}{right}"
        )
    return float(value)


def _integer(value: Any, where: str, low: int, high: int | None = None) -> int:
    if (
        not isinstance(value, int)
        or isinstance(value, bool)
        or value < low
        or (high is not None and value > high)
    ):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RulesError(f"{where}: {value!r} is invalid; allowed: an integer {allowed}")
    return value


def _choice(value: Any, where: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise RulesError(f"{where}: {value!r} is invalid; allowed: {'|'.join(allowed)}")
    return str(value)


def _metric_list(value: Any, where: str, kind: str) -> tuple[str, ...]:
    candidates = [
        m.name
        for m in REGISTRY.values()
        if m.kind == kind and (kind == "deterministic" or m.better != "none")
    ]
    if value == "all":
        return tuple(candidates)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RulesError(f"{where}: expected `all` or a list of metric names, got {value!r}")
    for name in value:
        metric = REGISTRY.get(name)
        if metric is None:
            raise RulesError(f"{where}: unknown metric {name!r}; allowed: {candidates}")
        if metric.kind != kind:
            raise RulesError(
                f"{where}: {name!r} is a {metric.kind} metric, not {kind}; "
                f"list it under rules.metrics.{metric.kind}"
            )
        if metric.better == "none" and kind == "timing":
            raise RulesError(
                f"{where}: {name!r} has no better direction (better: none), so "
                f"it cannot gate; allowed: {candidates}"
            )
    return tuple(dict.fromkeys(value))


def _per_metric(value: Any, gated: set[str]) -> dict[str, dict[str, float]]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RulesError(f"rules.per_metric: expected a mapping metric -> settings, got {value!r}")
    out: dict[str, dict[str, float]] = {}
    for name, settings in value.items():
        where = f"rules.per_metric.{name}"
        metric = REGISTRY.get(name)
        if metric is None:
            raise RulesError(
                f"{where}: unknown metric; allowed: the registry's names (docs/metrics.md)"
            )
        allowed = ("min_effect",) if metric.kind == "timing" else ("rel_tol", "abs_tol")
        if not isinstance(settings, dict) or set(settings) - set(allowed):
            raise RulesError(
                f"{where}: {settings!r} is invalid; allowed keys for a "
                f"{metric.kind} metric: {list(allowed)}"
            )
        out[name] = {}
        for key, number in settings.items():
            if key == "min_effect":
                out[name][key] = _number(number, f"{where}.{key}", 0.0, 1.0, high_open=True)
            else:
                out[name][key] = _number(number, f"{where}.{key}", 0.0)
        if name not in gated:
            raise RulesError(
                f"{where}: {name!r} does not gate under these rules; add it to "
                f"rules.metrics.{metric.kind} or drop its settings"
            )
    return out


def _required(value: Any, where: str, gated: set[str]) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise RulesError(f"{where}: expected a list of metric names, got {value!r}")
    for name in value:
        metric = REGISTRY.get(name)
        if metric is None:
            raise RulesError(
                f"{where}: unknown metric {name!r}; allowed: a metric that gates "
                f"under these rules: {sorted(gated)}"
            )
        if name not in gated:
            raise RulesError(
                f"{where}: {name!r} does not gate under these rules; add it to "
                f"rules.metrics.{metric.kind} (and out of rules.metrics.exclude)"
            )
    return tuple(dict.fromkeys(value))


def parse_rules(values: dict[str, Any], require: tuple[str, ...] = ()) -> GateRules:
    """Validate a merged rules mapping into GateRules; `require` adds the metrics named with
    --require-metric to rules.metrics.require."""
    _check_keys(values, _SCHEMA, "rules")
    metrics, timing, det = values["metrics"], values["timing"], values["deterministic"]
    exclude = metrics.get("exclude") or []
    if not isinstance(exclude, list) or not all(isinstance(v, str) for v in exclude):
        raise RulesError(f"rules.metrics.exclude: expected a list of metric names, got {exclude!r}")
    unknown = [name for name in exclude if name not in REGISTRY]
    if unknown:
        raise RulesError(f"rules.metrics.exclude: unknown metric(s) {unknown}")
    timing_metrics = tuple(
        m
        for m in _metric_list(metrics["timing"], "rules.metrics.timing", "timing")
        if m not in exclude
    )
    deterministic_metrics = tuple(
        m
        for m in _metric_list(
            metrics["deterministic"], "rules.metrics.deterministic", "deterministic"
        )
        if m not in exclude
    )
    gated = set(timing_metrics) | set(deterministic_metrics)
    if not gated:
        raise RulesError(
            "rules.metrics: no metric gates (rules.metrics.timing and "
            "rules.metrics.deterministic are empty, or all excluded), so the gate "
            "would compare nothing; name at least one metric"
        )
    required = _required(metrics.get("require"), "rules.metrics.require", gated)
    required += tuple(
        m for m in _required(list(require), "--require-metric", gated) if m not in required
    )
    statistic = _choice(timing["statistic"], "rules.timing.statistic", STATISTICS)
    bootstrap = BootstrapSettings(
        statistic=statistic,  # type: ignore[arg-type]
        confidence=_number(
            timing["confidence"], "rules.timing.confidence", 0.5, 1.0, high_open=True
        ),
        resamples=_integer(timing["resamples"], "rules.timing.resamples", 100, MAX_RESAMPLES),
        seed=_integer(timing["seed"], "rules.timing.seed", 0),
    )
    return GateRules(
        timing_metrics=timing_metrics,
        deterministic_metrics=deterministic_metrics,
        bootstrap=bootstrap,
        min_effect=_number(
            timing["min_effect"], "rules.timing.min_effect", 0.0, 1.0, high_open=True
        ),
        min_samples=_integer(timing["min_samples"], "rules.timing.min_samples", 2),
        rel_tol=_number(det["rel_tol"], "rules.deterministic.rel_tol", 0.0),
        abs_tol=_number(det["abs_tol"], "rules.deterministic.abs_tol", 0.0),
        neutral_change=_choice(
            det["neutral_change"], "rules.deterministic.neutral_change", NEUTRAL_CHANGE
        ),
        different_machine=_choice(
            values["different_machine"], "rules.different_machine", DIFFERENT_MACHINE
        ),
        per_metric=_per_metric(values.get("per_metric"), gated),
        required_metrics=required,
        checks=_checks(values.get("checks")),
    )


def _checks(value: Any) -> tuple[Check, ...]:
    """rules.checks: a list of 'METRIC OP BOUND' (or a mapping {METRIC: BOUND}); any
    registered metric, gated or not (slo_attainment is no gated metric by default)."""
    try:
        checks = parse_checks(value, "rules.checks")
    except CheckError as exc:
        raise RulesError(str(exc)) from None
    clash = contradictions(checks)
    if clash:  # as run.search.slo: every candidate would fail one of them
        raise RulesError(f"rules.checks: contradictory: {'; '.join(clash)}")
    for i, check in enumerate(checks):
        if check.metric in SWEEP_ANSWERS:  # no run has it: every run would be "absent"
            raise RulesError(
                f"rules.checks[{i}]: {check} is invalid; allowed: a run's metric "
                f"({check.metric} is a capacity search's answer, in search.json: the gate "
                "compares it with the baseline's on its own, docs/gate.md)"
            )
    return checks


def add_require_argument(parser: argparse.ArgumentParser) -> None:
    """--require-metric, shared by `inferlab gate` and `inferlab gate ab`."""
    parser.add_argument(
        "--require-metric",
        action="append",
        default=[],
        metavar="NAME",
        help="a gated metric that must be present in every complete run of "
        "both sides, else exit 2 (repeatable; adds to the rules' "
        "metrics.require)",
    )


class _KeyGivenTwice(Exception):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(key, line)
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, but a mapping that names a key twice is refused: the safe loader
    keeps the last, so a second `timing:` block silently replaced the first's thresholds."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults`, merged by super()
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # an unhashable key: the safe loader refuses it itself
                continue
            if duplicate:
                raise _KeyGivenTwice(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_rules(path: str | Path | None = None, require: tuple[str, ...] = ()) -> GateRules:
    """The default rules, with the file at `path` (if any) merged over them, and the metrics
    of --require-metric (`require`) added to rules.metrics.require."""
    defaults = yaml.safe_load(DEFAULT_RULES.read_text())
    if path is None:
        return parse_rules(defaults, require)
    path = Path(path)
    if not path.exists():
        raise RulesError(f"--rules: {path} is not a file")
    try:  # a regular file of a bounded size: /dev/zero or a FIFO is refused, not read
        user = yaml.load(read_input_bytes(path, SETTINGS).decode("utf-8"), _UniqueKeyLoader)
    except UserFileError as exc:
        raise RulesError(f"--rules: {exc}") from exc
    except _KeyGivenTwice as exc:
        raise RulesError(
            f"--rules: {path}: line {exc.line}: {exc.key!r} is given twice; allowed: each key once"
        ) from exc
    except UnicodeDecodeError as exc:
        raise RulesError(f"--rules: {path} is not UTF-8 text (byte {exc.start})") from exc
    except yaml.YAMLError as exc:
        raise RulesError(f"--rules: {path} is not valid YAML: {exc}") from exc
    except RecursionError as exc:
        raise RulesError(f"--rules: {path} is nested too deeply") from exc
    if user is None:
        user = {}
    if not isinstance(user, dict):
        raise RulesError(f"rules: {path} must hold a mapping, got {type(user).__name__}")
    _check_keys(user, _SCHEMA, "rules")
    return parse_rules(_merge(defaults, user), require)
