"""Counters, gauges and histograms rendered in the Prometheus text exposition format (0.0.4).

Small on purpose: the server needs a dozen metrics, label sets known in advance, and one
thread (the event loop) updating them, so no locking and no client library.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from typing import TypeVar

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[tuple[str, str], ...]


def _labels(labels: Labels, extra: tuple[str, str] | None = None) -> str:
    pairs = [*labels, extra] if extra else list(labels)
    if not pairs:
        return ""
    escaped = (v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"') for _, v in pairs)
    return "{" + ",".join(f'{k}="{v}"' for (k, _), v in zip(pairs, escaped, strict=True)) + "}"


def _value(x: float) -> str:
    if math.isinf(x):
        return "+Inf" if x > 0 else "-Inf"
    if math.isnan(x):
        return "NaN"
    return repr(int(x)) if float(x).is_integer() and abs(x) < 2**53 else repr(float(x))


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str) -> None:
        self.name = name
        self.help_text = help_text

    def header(self) -> list[str]:
        help_text = self.help_text.replace("\\", "\\\\").replace("\n", "\\n")
        return [f"# HELP {self.name} {help_text}", f"# TYPE {self.name} {self.kind}"]

    def samples(self) -> Iterable[str]:
        raise NotImplementedError

    def render(self) -> list[str]:
        return [*self.header(), *self.samples()]


class Counter(Metric):
    """Monotonic; one value per label set (name it `..._total`)."""

    kind = "counter"

    def __init__(self, name: str, help_text: str, label_sets: Sequence[Labels] = ((),)) -> None:
        super().__init__(name, help_text)
        self.values: dict[Labels, float] = {labels: 0.0 for labels in label_sets}

    def inc(self, amount: float = 1.0, labels: Labels = ()) -> None:
        if amount < 0:
            raise ValueError(f"{self.name}: a counter cannot decrease (inc by {amount})")
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def get(self, labels: Labels = ()) -> float:
        return self.values.get(labels, 0.0)

    def samples(self) -> Iterable[str]:
        for labels, value in self.values.items():
            yield f"{self.name}{_labels(labels)} {_value(value)}"


class Gauge(Metric):
    """Read at scrape time from a callback, so it is never stale."""

    kind = "gauge"

    def __init__(self, name: str, help_text: str, read: Callable[[], float]) -> None:
        super().__init__(name, help_text)
        self.read = read

    def samples(self) -> Iterable[str]:
        yield f"{self.name} {_value(float(self.read()))}"


class Histogram(Metric):
    kind = "histogram"

    def __init__(self, name: str, help_text: str, buckets: Sequence[float]) -> None:
        super().__init__(name, help_text)
        if list(buckets) != sorted(set(buckets)):
            raise ValueError(f"{name}: buckets must be strictly increasing")
        self.bounds = [float(b) for b in buckets]
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def samples(self) -> Iterable[str]:
        cumulative = 0
        for bound, count in zip([*self.bounds, math.inf], self.counts, strict=True):
            cumulative += count
            yield f"{self.name}_bucket{_labels((), ('le', _value(bound)))} {cumulative}"
        yield f"{self.name}_sum {_value(self.sum)}"
        yield f"{self.name}_count {self.count}"


M = TypeVar("M", bound=Metric)


class Registry:
    def __init__(self) -> None:
        self.metrics: list[Metric] = []

    def add(self, metric: M) -> M:
        if any(m.name == metric.name for m in self.metrics):
            raise ValueError(f"metric {metric.name} registered twice")
        self.metrics.append(metric)
        return metric

    def render(self) -> str:
        return "\n".join(line for metric in self.metrics for line in metric.render()) + "\n"
