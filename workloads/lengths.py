"""Token length specifications, sampled seeded, and the rule that fits lengths to a context.

Spec forms (each value is rounded to an integer and raised to at least 1):
  128                                      fixed
  [64, 192]                                uniform integers, both ends included
  {dist: uniform, low: 64, high: 192}      the same, as a mapping
  {dist: normal, mean: 128, std: 32}
  {dist: lognormal, mean: 128, sigma: 0.5} `mean` is the mean of the lengths themselves
                                           (mu = ln(mean) - sigma^2 / 2), not of their log
  {dist: empirical, path: ..., format: azure, field: input}
                                           drawn with replacement from a trace's lengths
                                           (csv/jsonl traces also take `columns`)

Context clipping (`clip_to_context`): the output is clipped to at most context_len - 1 (a
request needs at least one prompt token), then the input to at most context_len - output, so
prompt + output always fits. Output is kept first because it is what decode benchmarks measure.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from workloads.common import (
    check_choice,
    check_keys,
    check_number,
    invalid,
    is_int,
    resolve_path,
)
from workloads.traces import TRACE_FORMATS, load_trace, parse_columns

LENGTH_DISTS = ("uniform", "normal", "lognormal", "empirical")
_DIST_KEYS = {
    "uniform": ("dist", "low", "high"),
    "normal": ("dist", "mean", "std"),
    "lognormal": ("dist", "mean", "sigma"),
    "empirical": ("dist", "path", "format", "field", "columns"),
}
_ALLOWED = "an integer >= 1, a range [low, high], or a mapping with dist: " + "|".join(LENGTH_DISTS)


class LengthSpec:
    """A parsed length spec; `sample(n, rng)` returns n integer lengths >= 1."""

    def __init__(self, field: str, kind: str, **params: Any) -> None:
        self.field = field
        self.kind = kind  # fixed | uniform | normal | lognormal | empirical
        self.params = params

    def __repr__(self) -> str:
        shown = {k: v for k, v in self.params.items() if k != "values"}
        return f"LengthSpec({self.field}: {self.kind} {shown})"

    @property
    def low(self) -> int:
        """The smallest length this spec can produce."""
        p = self.params
        if self.kind == "fixed":
            return int(p["value"])
        if self.kind == "uniform":
            return int(p["low"])
        if self.kind == "empirical":
            return int(min(p["values"]))
        return 1

    @property
    def high(self) -> int | None:
        """The largest length this spec can produce (None: unbounded)."""
        p = self.params
        if self.kind == "fixed":
            return int(p["value"])
        if self.kind == "uniform":
            return int(p["high"])
        if self.kind == "empirical":
            return int(max(p["values"]))
        return None

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        p = self.params
        if self.kind == "fixed":
            raw = np.full(n, p["value"], dtype=float)
        elif self.kind == "uniform":
            raw = rng.integers(p["low"], p["high"] + 1, size=n).astype(float)
        elif self.kind == "normal":
            raw = rng.normal(p["mean"], p["std"], size=n)
        elif self.kind == "lognormal":
            sigma = p["sigma"]
            raw = rng.lognormal(math.log(p["mean"]) - sigma * sigma / 2, sigma, size=n)
        else:
            raw = rng.choice(np.asarray(p["values"], dtype=float), size=n, replace=True)
        return np.maximum(np.rint(raw), 1).astype(np.int64)


def parse_length(field: str, value: Any) -> LengthSpec:
    """Parse and validate a length spec; errors name `workload.<field>`."""
    if is_int(value):
        if value < 1:
            raise invalid(field, value, _ALLOWED)
        return LengthSpec(field, "fixed", value=int(value))
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        if len(value) != 2 or not all(is_int(v) for v in value):
            raise invalid(field, value, _ALLOWED)
        return _uniform(field, value, value[0], value[1])
    if not isinstance(value, Mapping):
        raise invalid(field, value, _ALLOWED)
    spec = dict(value)
    dist = check_choice(f"{field}.dist", spec.get("dist"), LENGTH_DISTS)
    check_keys(field, spec, _DIST_KEYS[dist], f"dist {dist}")
    missing = [k for k in _DIST_KEYS[dist] if k not in spec and k != "columns"]
    if missing:
        raise invalid(f"{field}.{missing[0]}", None, f"a value (dist {dist} needs {missing})")
    if dist == "uniform":
        return _uniform(field, value, spec["low"], spec["high"])
    if dist == "normal":
        mean = check_number(f"{field}.mean", spec["mean"], 0.0, strict=True)
        std = check_number(f"{field}.std", spec["std"], 0.0)
        return LengthSpec(field, "normal", mean=mean, std=std)
    if dist == "lognormal":
        mean = check_number(f"{field}.mean", spec["mean"], 0.0, strict=True)
        sigma = check_number(f"{field}.sigma", spec["sigma"], 0.0)
        return LengthSpec(field, "lognormal", mean=mean, sigma=sigma)
    return _empirical(field, spec)


def _uniform(field: str, value: Any, low: Any, high: Any) -> LengthSpec:
    if not (is_int(low) and is_int(high)) or low < 1 or high < low:
        raise invalid(field, value, "integers with 1 <= low <= high")
    return LengthSpec(field, "uniform", low=int(low), high=int(high))


def _empirical(field: str, spec: dict[str, Any]) -> LengthSpec:
    fmt = check_choice(f"{field}.format", spec["format"], TRACE_FORMATS)
    which = check_choice(f"{field}.field", spec["field"], ("input", "output"))
    columns = spec.get("columns")
    if fmt in ("csv", "jsonl"):
        columns = parse_columns(f"{field}.columns", columns or {})
    elif columns:
        raise invalid(f"{field}.columns", columns, f"null for format {fmt}")
    path = resolve_path(f"{field}.path", spec["path"])
    trace = load_trace(path, fmt, columns)
    values = (trace.input_lens if which == "input" else trace.output_lens).tolist()
    if not values:
        raise invalid(
            f"{field}.path", str(path), f"a trace with usable rows (skipped: {trace.skipped})"
        )
    return LengthSpec(
        field, "empirical", path=str(path), format=fmt, which=which, values=tuple(values)
    )


def clip_to_context(
    inputs: np.ndarray, outputs: np.ndarray, context_len: int | None
) -> tuple[np.ndarray, np.ndarray, dict[str, Any]]:
    """Apply the clipping rule (module docstring); return clipped copies and the counts."""
    inputs = np.asarray(inputs, dtype=np.int64).copy()
    outputs = np.asarray(outputs, dtype=np.int64).copy()
    info: dict[str, Any] = {
        "context_len": context_len,
        "clipped_output": 0,
        "clipped_input": 0,
        "clipped_requests": 0,
    }
    if context_len is None:
        return inputs, outputs, info
    if not is_int(context_len) or context_len < 2:
        raise ValueError(
            f"context_len: {context_len!r} is invalid; allowed: an integer >= 2 "
            "(one prompt and one output token)"
        )
    out_clipped = outputs > context_len - 1
    outputs = np.minimum(outputs, context_len - 1)
    in_clipped = inputs > context_len - outputs
    inputs = np.minimum(inputs, context_len - outputs)
    info.update(
        clipped_output=int(out_clipped.sum()),
        clipped_input=int(in_clipped.sum()),
        clipped_requests=int((out_clipped | in_clipped).sum()),
    )
    return inputs, outputs, info
